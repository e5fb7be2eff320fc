"""The sans-I/O OpenAI Realtime (GA) session core.

Every entry point takes the current monotonic time (`now`, seconds) and returns a
`CoreOutput`: server events (dicts, each with a unique `event_id`, in send order) and
effects for the driver. The core opens no sockets, starts no tasks and reads no clock. See
"session realtime core API" in docs/CONTRACTS.md for the driver's side.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from session.realtime import errors as E
from session.realtime.audio_store import AudioStore
from session.realtime.config import SessionConfig
from session.realtime.conversation import Content, Conversation, Item, text_bytes
from session.realtime.effects import (
    CancelResponse,
    ClearAudioOutput,
    Close,
    CoreOutput,
    LiveControl,
    LiveUpdate,
    StartResponse,
)
from session.realtime.errors import ProtocolError
from session.realtime.events import (
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    OutputAudioBufferClear,
    ResponseCancel,
    ResponseCreate,
    SessionUpdate,
    append_audio,
    decode_event,
    parse_client_event,
)
from session.realtime.ids import IdFactory, random_id
from session.realtime.input_audio import InputAudio, ms_of
from session.realtime.prompt import build_submit_params, item_from_client
from session.realtime.records import StateChanges, config_record, item_from_record, item_to_record
from session.realtime.response_request import ResponseRequest, resolve_response_request
from session.realtime.responses import (
    CancelReason,
    PromptStats,
    ResponseRun,
    ResponseSettings,
    ResponseStatus,
    end_orphaned_responses,
)
from session.realtime.server_events import Outbox
from session.realtime.turns import SpeechDetector
from session.realtime.user_input import MIN_COMMIT_MS, UserInput

__all__ = ["MIN_COMMIT_MS", "CoreOptions", "RealtimeSessionCore"]

# Session settings a model that takes its own turns is conditioned on (`LiveUpdate`).
_LIVE_CONDITIONING = ("instructions", "voice", "output_modalities", "tools")


@dataclass(slots=True)
class CoreOptions:
    """Server-side settings of a session (not visible to or changeable by the client)."""

    config: SessionConfig = field(default_factory=SessionConfig)  # initial session config
    max_duration_s: float = 3600.0
    output_frame_ms: int = 40  # size of response.output_audio.delta payloads (20–100)
    audio_out_via_track: bool = False  # WebRTC: audio out as PlayAudio effects, not deltas
    # The pipeline's `Transcript` output transcribes the audio of StartResponse; if False,
    # every committed item is transcribed with a TranscribeInput effect (when configured).
    pipeline_transcribes_input: bool = True
    # With such a pipeline and server VAD, once a pause in speech has lasted this long
    # (capped at the silence duration) the turn so far is transcribed ahead of the turn's
    # end (`PrepareTranscript`), hiding ASR time inside the silence. 0: never.
    prepare_transcript_after_ms: int = 64
    # ... and once it has lasted this long (capped likewise), the response that the turn's end
    # would start is started ahead on that transcript (`RespondAhead`), its output held back
    # until the turn does end (then the client gets it at once) or dropped if the speaker goes
    # on. Hides the responder's and TTS's time to first audio inside the silence. 0: never.
    respond_ahead_after_ms: int = 200
    # Seconds of audio the conversation keeps, newest items first (the newest item with audio
    # always keeps its own): older items keep transcripts and text, and are retrieved without
    # `audio`. Bounds a session's memory (at most ~0.5 MB at 10 s; far less with an
    # `audio_store`); pipelines only take the trailing user turn's audio (see
    # `Conversation.retain_audio`).
    audio_retention_s: float = 10.0
    # Where retained audio that no prompt needs any more goes (the server's: a disk spool
    # shared by its sessions). None: it stays in memory.
    audio_store: AudioStore | None = None
    session_id: str | None = None
    new_id: IdFactory = random_id
    # Whether the core stamps its events' `event_id`s. False when a session log stamps them as it
    # logs them (hosted sessions: `SessionLog.append`), so every event is stamped once.
    stamp_event_ids: bool = True
    # The pipeline takes its own turns (a native full-duplex model): input audio goes out as
    # `LiveAudio` effects for its live request, responses open when it starts speaking
    # (`on_live_response_started`), the user's audio is committed as user items then; no
    # server VAD, and `response.create` is refused.
    live_responses: bool = False
    # The live request transcribes the user while they speak (a live ASR stage after the VAD
    # stage): the core marks its turns there (`LiveControl` "speech_started" / "speech_stopped")
    # and the driver transcribes pauses on it (`PrepareTranscript`).
    live_transcribes_input: bool = False
    # Per-session budgets (docs/sessions.md "Limits"): what one client can make the server
    # keep. Text of all conversation items (UTF-8 bytes; a create past it is refused with
    # `conversation_too_large`), the instructions (`string_above_max_length`), and the
    # uncommitted input audio (`input_audio_buffer_too_large`; commit or clear it). 0: none.
    max_conversation_bytes: int = 8 * 1024 * 1024
    max_instructions_bytes: int = 512 * 1024
    max_input_audio_s: float = 300.0


def check_instructions(text: str | None, limit: int, param: str) -> None:
    """Refuse instructions over `limit` UTF-8 bytes (0: no limit) before anything changes."""
    if text and limit and len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise ProtocolError(
            E.STRING_TOO_LONG,
            f"Invalid '{param}': string too long. Expected a string with maximum length {limit} bytes.",
            param=param,
        )


class RealtimeSessionCore(UserInput):
    def __init__(self, options: CoreOptions | None = None) -> None:
        self.options = opts = options or CoreOptions()
        self._new_id = opts.new_id
        self.session_id = opts.session_id or self._new_id("sess")
        self.conversation_id = self._new_id("conv")
        self.config = opts.config.copy()
        self.conversation = Conversation(opts.audio_store)
        self._out = Outbox(self._new_id, stamp=opts.stamp_event_ids)
        self._input = InputAudio(self.config.input_format)
        self._vad = SpeechDetector()
        self._speech_item_id: str | None = None
        self._track_overflow = False
        self._speech_start = 0
        self._prepared: tuple[str, int] | None = None  # key of the last PrepareTranscript
        self._streamed: OrderedDict[str, str] = OrderedDict()  # transcription deltas sent per item
        # The client `event_id` of the last client event handled (None if it had none): the
        # driver tags the input it hands the live request with it (its errors name it).
        self.input_event_id: str | None = None
        self._ahead: tuple[str, int] | None = None  # key of a RespondAhead not yet settled
        self._active: ResponseRun | None = None
        self._prompt_items: OrderedDict[str, list[str]] = OrderedDict()  # response → audio items
        self._transcribed: set[str] = set()
        self._transcribe_requested: set[str] = set()
        self._playing: ResponseRun | None = None  # track transport: audio still playing out
        self._played_ms = 0.0
        self._idle_deadline: float | None = None
        self._voice_locked = False
        self._started_at: float | None = None
        self._expires_at_epoch = 0
        self._config_changed = False
        self._stored_response: str | None = None  # the open response id the store has
        self._orphan_response: dict[str, Any] | None = None  # restored: a dead process's
        self.last_user_item_id: str | None = None  # of the last committed user audio item
        self.closed = False
        self._apply_turn_detection()

    @classmethod
    def restore(
        cls,
        options: CoreOptions,
        items: Sequence[dict[str, Any]],
        *,
        conversation_id: str | None,
        now: float,
        epoch: float,
        expires_at: float,
        open_response: dict[str, Any] | None = None,
    ) -> RealtimeSessionCore:
        """A started core rebuilt from stored state (`options.config`, item records from
        `records.item_to_record`) after its process went away: no `session.created`, the same
        expiry (`expires_at`, wall seconds) and conversation. Restored items have no audio."""
        core = cls(options)
        if conversation_id:
            core.conversation_id = conversation_id
        for record in items:
            item = item_from_record(record)
            core.conversation.insert(item)
            if any(c.type == "input_audio" for c in item.content):
                core._transcribed.add(item.id)  # its audio is gone: nothing left to transcribe
            if item.role == "assistant" and any(c.type == "output_audio" for c in item.content):
                core._voice_locked = True
        core.conversation.take_changes()  # already stored
        if open_response and open_response.get("id"):
            # Still open in the store until `close_orphaned_responses` ends it for a client: a
            # restore that parks again (no client came) must keep it for the next one.
            core._orphan_response = dict(open_response)
        core._started_at = now - (options.max_duration_s - (expires_at - epoch))
        core._expires_at_epoch = int(expires_at)
        return core

    def release_audio(self) -> None:
        """The session is over in this process: discard its spilled audio (the conversation's
        finalizer would, later)."""
        self.conversation.close()

    # --- properties ----------------------------------------------------------------------

    @property
    def active_response_id(self) -> str | None:
        return self._active.id if self._active is not None else None

    @property
    def speaking(self) -> bool:
        return self._vad.speaking

    @property
    def started(self) -> bool:
        return self._started_at is not None

    def session_object(self) -> dict[str, Any]:
        return self.config.to_wire(session_id=self.session_id, expires_at=self._expires_at_epoch)

    def next_deadline(self) -> float | None:
        """The earliest `now` at which `tick` has something to do (None: nothing pending)."""
        if self._started_at is None or self.closed:
            return None
        deadlines = [self._started_at + self.options.max_duration_s]
        if self._idle_deadline is not None:
            deadlines.append(self._idle_deadline)
        return min(deadlines)

    # --- entry points --------------------------------------------------------------------

    def start(self, now: float, epoch: float) -> CoreOutput:
        """Open the session: `session.created`. `epoch` is wall-clock seconds (for `expires_at`)."""
        self._started_at = now
        self._expires_at_epoch = int(epoch + self.options.max_duration_s)
        self._config_changed = True
        self._out.event("session.created", session=self.session_object())
        return self._out.drain()

    def take_state_changes(self) -> StateChanges | None:
        """What to persist since the last call (item boundaries and config updates only, so
        deltas cost nothing); None when nothing changed. O(1) when nothing did."""
        items = self.conversation.take_changes()
        run = self._active
        open_id = run.id if run is not None and run.active else None
        if items is None and not self._config_changed and open_id == self._stored_response:
            return None
        changes = StateChanges()
        if open_id != self._stored_response:
            self._stored_response = open_id
            changes.open_response_changed = True
            if run is not None and open_id is not None:
                changes.open_response = {"id": open_id, "audio": run.settings.audio}
        if items is not None:
            changes.deletes = items[0]
            changes.upserts = [(item_to_record(item), previous) for item, previous in items[1]]
        if self._config_changed:
            self._config_changed = False
            changes.config = config_record(
                self.config,
                session_id=self.session_id,
                expires_at=self._expires_at_epoch,
                conversation_id=self.conversation_id,
            )
        return changes

    def handle_client_event(self, raw: str | bytes | dict[str, Any], now: float) -> CoreOutput:
        """One client event (raw JSON text or decoded dict)."""
        if self._started_at is None:
            raise RuntimeError("start() the session before feeding client events")
        expired = self.check_expiry(now)
        if self.closed:
            return expired
        event_id: str | None = None
        try:
            data = decode_event(raw)
            audio = append_audio(data)
            if audio is not None:  # the hot path: no model built (it reads the same errors)
                event_id = data.get("event_id")
                self.input_event_id = event_id if isinstance(event_id, str) else None
                self._append(audio)
            else:
                event = parse_client_event(data)
                event_id = self.input_event_id = event.event_id
                self._dispatch(event, now)
        except ProtocolError as err:
            self._out.error(err, event_id if event_id is not None else err.event_id)
        return self._out.drain()

    def on_response_text(self, response_id: str, text: str, now: float | None = None) -> CoreOutput:
        if self._active is not None and self._active.id == response_id:
            self._active.on_text(text)
        return self._out.drain()

    def on_response_audio(self, response_id: str, samples: np.ndarray, rate: int, now: float) -> CoreOutput:
        run = self._active
        if run is not None and run.id == response_id:
            run.on_audio(np.asarray(samples, dtype=np.float32), rate, now)
            if (
                self.options.audio_out_via_track
                and run.audio_started_at is not None
                and self._playing is not run
            ):
                self._playing, self._played_ms = run, 0.0
        return self._out.drain()

    def on_response_done(
        self,
        response_id: str,
        status: Literal["completed", "failed", "cancelled", "incomplete"],
        error: str | None = None,
        *,
        now: float,
        usage: dict[str, Any] | None = None,
    ) -> CoreOutput:
        """The pipeline finished `response_id` ("incomplete": a live pipeline cut it at its
        length limit). Ignored for responses the core already ended."""
        run = self._active
        if run is not None and run.id == response_id:
            final: ResponseStatus = "cancelled" if status == "cancelled" else status
            code = "pipeline_failed"
            if final == "failed" and error and E.CONTEXT_LENGTH_EXCEEDED in error:
                # The prompt does not fit the model even after `truncation` did what it may:
                # the client's request is at fault, so it hears of it as an `error` event too.
                code = E.CONTEXT_LENGTH_EXCEEDED
                message = error[error.index(code) :].removeprefix(f"{code}: ")
                self._out.error(ProtocolError(code, f"Context length exceeded: {message}"))
            self._end_response(
                final, now, reason="client_cancelled", error=error, usage=usage, error_code=code
            )
        return self._out.drain()

    def on_playout(self, response_id: str, played_ms: float, now: float) -> CoreOutput:
        """Track transport: how much of `response_id`'s audio the peer has been sent so far."""
        if self._playing is not None and self._playing.id == response_id:
            self._played_ms = max(self._played_ms, played_ms)
        return self._out.drain()

    def on_playout_finished(self, response_id: str, now: float) -> CoreOutput:
        """Track transport: all audio of `response_id` has been played out."""
        run = self._playing
        if run is not None and run.id == response_id and not run.active:
            self._playing = None
            self._out.event("output_audio_buffer.stopped", response_id=response_id)
            self._arm_idle_timeout(now, remaining_s=0.0)
        return self._out.drain()

    def check_expiry(self, now: float) -> CoreOutput:
        """Past the maximum duration: `error session_expired`, cancel, `Close(1001)`."""
        if self.closed or self._started_at is None:
            return self._out.drain()
        if now - self._started_at >= self.options.max_duration_s:
            minutes = round(self.options.max_duration_s / 60)
            return self.expire(now, f"Your session hit the maximum duration of {minutes} minutes.")
        return self._out.drain()

    def expire(self, now: float, message: str) -> CoreOutput:
        """End the session from the server side (maximum duration, idle TTL): cancel the
        active response, `error session_expired`, `Close(1001)`."""
        if not self.closed:
            if self._active is not None:
                self._cancel_active("client_cancelled", now)
            self._out.error(ProtocolError(E.SESSION_EXPIRED, message))
            self._out.effect(Close(1001, "session expired"))
            self.closed = True
        return self._out.drain()

    def cancel_response(self, now: float) -> CoreOutput:
        """Cancel the active response for the server's own reasons (the client left past
        its disconnect grace): `response.done` cancelled, as if the client had cancelled."""
        if self._active is not None and not self.closed:
            self._cancel_active("client_cancelled", now)
        return self._out.drain()

    def close_orphaned_responses(self, now: float, *, lost_replica: str | None = None) -> CoreOutput:
        """After `restore`: end responses a dead process left in progress (their output item
        was stored in progress) with `response.done` failed, so the client sees them end.
        `lost_replica` (scale-out failover): the replica that died; the error code is then
        `replica_lost`."""
        failure: dict[str, str] = {}
        if lost_replica is not None:
            failure = {
                "error_code": "replica_lost",
                "message": f"The replica serving this response ({lost_replica}) was lost; ask again.",
            }
        orphan, self._orphan_response = self._orphan_response, None
        if orphan is not None:
            self._stored_response = str(orphan["id"])  # cleared in the store with its response.done
        end_orphaned_responses(
            self.conversation,
            lambda audio: ResponseSettings(
                modalities=["audio"] if audio else ["text"],
                output_format=self.config.output_format,
                voice=self.config.voice,
                max_output_tokens=self.config.max_output_tokens,
                frame_ms=self.options.output_frame_ms,
                via_track=self.options.audio_out_via_track,
            ),
            outbox=self._out,
            conversation_id=self.conversation_id,
            now=now,
            open_response=orphan,
            **failure,
        )
        return self._out.drain()

    def tick(self, now: float) -> CoreOutput:
        """Timers: session expiry and the server VAD idle timeout."""
        out = self.check_expiry(now)
        if self.closed:
            return out
        td = self.config.turn_detection
        if (
            self._idle_deadline is not None
            and now >= self._idle_deadline
            and td is not None
            and td.idle_timeout_ms
            and self._active is None
            and not self._vad.speaking
        ):
            self._idle_deadline = None
            item_id = self._new_id("item")
            a, b = self._input.start, self._input.end
            self._out.event(
                "input_audio_buffer.timeout_triggered",
                item_id=item_id,
                audio_start_ms=ms_of(a),
                audio_end_ms=ms_of(b),
            )
            audio = self._input.take(a, b)
            self._commit(item_id, audio, respond=True)
            self._start_response(None, now)
        out.extend(self._out.drain())
        return out

    # --- client events -------------------------------------------------------------------

    def _dispatch(self, event: Any, now: float) -> None:
        if isinstance(event, InputAudioBufferAppend):
            self._append(event.audio)
        elif isinstance(event, SessionUpdate):
            self._session_update(event)
        elif isinstance(event, InputAudioBufferCommit):
            self._manual_commit()
            if self.options.live_responses:
                self._out.effect(LiveControl("commit"))
        elif isinstance(event, InputAudioBufferClear):
            self._input.clear()
            self._vad.reset()
            self._end_speech()
            self._drop_ahead()
            self._out.event("input_audio_buffer.cleared")
            if self.options.live_responses:
                self._out.effect(LiveControl("clear"))
        elif isinstance(event, OutputAudioBufferClear):
            self._clear_output(now)
        elif isinstance(event, ConversationItemCreate):
            self._item_create(event)
        elif isinstance(event, ConversationItemRetrieve):
            item = self.conversation.get(event.item_id)
            wire = item.to_wire(with_audio=True, input_format=self.config.input_format)
            self._out.event("conversation.item.retrieved", item=wire)
        elif isinstance(event, ConversationItemDelete):
            self.conversation.delete(event.item_id)
            self._out.event("conversation.item.deleted", item_id=event.item_id)
        elif isinstance(event, ConversationItemTruncate):
            self.conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
            self._out.event(
                "conversation.item.truncated",
                item_id=event.item_id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        elif isinstance(event, ResponseCreate):
            if self.options.live_responses:
                raise ProtocolError(
                    E.INVALID_EVENT,
                    "This session's model decides when to speak (a full-duplex pipeline): "
                    "response.create is not supported.",
                    param="type",
                )
            self._start_response(event, now)
        elif isinstance(event, ResponseCancel):
            self._response_cancel(event, now)

    def _session_update(self, event: SessionUpdate) -> None:
        limit = self.options.max_instructions_bytes
        check_instructions(event.session.instructions, limit, "session.instructions")
        before = self.config
        self.config = self.config.apply_update(event.session, voice_locked=self._voice_locked)
        self._config_changed = True
        if self.options.live_responses:
            changed = {
                key: getattr(self.config, key)
                for key in _LIVE_CONDITIONING
                if getattr(self.config, key) != getattr(before, key)
            }
            if changed:
                self._out.effect(LiveUpdate(changed))
        self._input.set_format(self.config.input_format)
        self._apply_turn_detection()
        self._out.event("session.updated", session=self.session_object())

    def _apply_turn_detection(self) -> None:
        if self.options.live_responses:
            self.config.turn_detection = None  # the model takes the turns: no server VAD
        td = self.config.turn_detection
        self._input.set_vad(td is not None)
        if td is None:
            self._vad.reset()
            self._end_speech()
            self._idle_deadline = None
        else:
            self._vad.configure(td.threshold, td.effective_silence_ms())

    def _item_create(self, event: ConversationItemCreate) -> None:
        item = item_from_client(
            event.item,
            new_id=self._new_id,
            input_format=self.config.input_format,
            output_format=self.config.output_format,
        )
        budget = self.options.max_conversation_bytes
        if budget and self.conversation.text_bytes + text_bytes(item) > budget:
            raise ProtocolError(
                E.CONVERSATION_TOO_LARGE,
                f"The conversation would hold more than {budget} bytes of text "
                f"(it holds {self.conversation.text_bytes}); delete items first.",
                param="item",
            )
        previous = self.conversation.insert(item, event.previous_item_id)
        self.conversation.retain_audio(self.options.audio_retention_s)
        wire = item.to_wire()
        self._out.event("conversation.item.added", previous_item_id=previous, item=wire)
        self._out.event("conversation.item.done", previous_item_id=previous, item=wire)

    def _clear_output(self, now: float) -> None:
        if not self.options.audio_out_via_track:
            raise ProtocolError(
                E.INVALID_EVENT,
                "output_audio_buffer.clear is only supported for WebRTC sessions.",
                param="type",
            )
        if self._active is not None:
            self._cancel_active("client_cancelled", now)
        self._stop_playout()

    # --- responses -----------------------------------------------------------------------

    def _start_response(
        self,
        event: ResponseCreate | None,
        now: float,
        *,
        transcript_key: tuple[str, int] | None = None,
        live: bool = False,
    ) -> None:
        if self._active is not None:
            raise ProtocolError(
                E.ACTIVE_RESPONSE,
                f"Conversation already has an active response in progress: {self._active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        if event is not None and event.response is not None:
            limit = self.options.max_instructions_bytes
            check_instructions(event.response.instructions, limit, "response.instructions")
        request = self._response_request(event)
        settings = request.settings
        params, stats = self._submit_params(request, request.items)
        response_id = self._new_id("resp")
        run = ResponseRun(
            response_id,
            settings,
            outbox=self._out,
            conversation=self.conversation,
            item_id=self._new_id("item"),
            conversation_id=self.conversation_id,
            prompt=stats,
        )
        self._active = run
        self._idle_deadline = None
        self._prompt_items[response_id] = stats.audio_item_ids
        while len(self._prompt_items) > 16:
            self._prompt_items.popitem(last=False)
        run.start()
        if transcript_key is not None and (
            transcript_key != self._prepared or stats.audio_item_ids != [transcript_key[0]]
        ):
            transcript_key = None  # the prompt's audio is not (only) what was transcribed ahead
        if not live:  # a live response is already being made by the live request
            self._out.effect(StartResponse(response_id, params, transcript_key=transcript_key))

    def _response_request(self, event: ResponseCreate | None) -> ResponseRequest:
        return resolve_response_request(
            event.response if event is not None else None,
            config=self.config,
            conversation=self.conversation,
            new_id=self._new_id,
            frame_ms=self.options.output_frame_ms,
            via_track=self.options.audio_out_via_track,
        )

    def _submit_params(
        self, request: ResponseRequest, items: list[Item]
    ) -> tuple[dict[str, Any], PromptStats]:
        return build_submit_params(
            items,
            instructions=request.instructions,
            modalities=request.settings.modalities,
            max_output_tokens=request.settings.max_output_tokens,
            truncation=self.config.truncation,
        )

    def _params_ahead(self, item_id: str) -> dict[str, Any]:
        """The submit params of the response that server VAD would start if the turn being
        spoken (`item_id`) ended now: the conversation plus that turn as a user audio item (a
        one-sample stand-in: the driver puts the prepared transcript in place of `audio`)."""
        request = self._response_request(None)
        audio = Content(type="input_audio", input_audio=np.zeros(1, np.int16))
        stand_in = Item(item_id, "message", role="user", content=[audio])
        return self._submit_params(request, [*request.items, stand_in])[0]

    def _response_cancel(self, event: ResponseCancel, now: float) -> None:
        if self._active is None or (event.response_id is not None and event.response_id != self._active.id):
            raise ProtocolError(
                E.CANCEL_NOT_ACTIVE,
                "Cancellation failed: no active response found.",
                param="response_id" if event.response_id is not None else None,
            )
        run = self._active
        self._cancel_active("client_cancelled", now)
        if self.options.live_responses:
            self._out.effect(LiveControl("cancel", response_id=run.id))

    def _cancel_active(self, reason: CancelReason, now: float) -> None:
        run = self._active
        assert run is not None
        self._end_response("cancelled", now, reason=reason)
        self._out.effect(CancelResponse(run.id))

    def _end_response(
        self,
        status: ResponseStatus,
        now: float,
        *,
        reason: CancelReason | None = None,
        error: str | None = None,
        usage: dict[str, Any] | None = None,
        error_code: str = "pipeline_failed",
    ) -> None:
        run = self._active
        assert run is not None
        run.finish(status, now=now, reason=reason, error=error, error_code=error_code, reported_usage=usage)
        self._active = None
        if run.audio_started_at is not None:
            self._voice_locked = True
        if self.options.pipeline_transcribes_input:
            for item_id in self._prompt_items.get(run.id, []):
                if item_id in self.conversation and item_id not in self._transcribed:
                    self._request_transcription(self.conversation.get(item_id))
        self.conversation.retain_audio(self.options.audio_retention_s)
        if self.options.audio_out_via_track:
            if run.audio_started_at is None:
                self._arm_idle_timeout(now, remaining_s=0.0)
        else:
            started = run.audio_started_at
            remaining = 0.0 if started is None else max(0.0, run.audio_ms / 1000.0 - (now - started))
            self._arm_idle_timeout(now, remaining_s=remaining)

    def _arm_idle_timeout(self, now: float, *, remaining_s: float) -> None:
        td = self.config.turn_detection
        if td is not None and td.idle_timeout_ms and self._active is None:
            self._idle_deadline = now + remaining_s + td.idle_timeout_ms / 1000.0

    def _stop_playout(self) -> None:
        """Track transport: cut the audio still playing, truncate its item where it stopped."""
        run = self._playing
        if run is None:
            return
        self._playing = None
        self._out.effect(ClearAudioOutput(run.id))
        self._out.event("output_audio_buffer.cleared", response_id=run.id)
        if run.item is not None and run.item.id in self.conversation:
            played = int(min(self._played_ms, run.audio_ms))
            self.conversation.truncate(run.item.id, 0, played)
            self._out.event(
                "conversation.item.truncated", item_id=run.item.id, content_index=0, audio_end_ms=played
            )
