"""The sans-I/O OpenAI Realtime (GA) session core.

Every entry point takes the current monotonic time (`now`, seconds) and returns a
`CoreOutput`: server events (dicts, each with a unique `event_id`, in send order) and
effects for the driver. The core opens no sockets, starts no tasks and reads no clock. See
"session realtime core API" in docs/CONTRACTS.md for the driver's side.

The core holds the session (its config, conversation, expiry) and routes each entry point to
the part that owns it: the user's audio (:class:`~session.realtime.user_audio.UserAudio`), the
transcripts (:class:`~session.realtime.transcripts.Transcripts`), the responses
(:class:`~session.realtime.response_control.ResponseControl`), and the turn-taking of its
pipeline's kind (:class:`~session.realtime.turn_vad.VadTurns`: server VAD or the client's
commits; :class:`~session.realtime.turn_live.LiveTurns`: a pipeline that takes its own turns).
A new feature is a new part, not new state here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from session.realtime import errors as E
from session.realtime.config import SessionConfig
from session.realtime.conversation import Conversation, text_bytes
from session.realtime.core_state import (
    MIN_COMMIT_MS,
    CoreOptions,
    CoreState,
    IdleTimeout,
    check_instructions,
)
from session.realtime.effects import Close, CoreOutput
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
from session.realtime.prompt import item_from_client
from session.realtime.records import StateChanges, config_record, item_from_record, item_to_record
from session.realtime.response_control import ResponseControl
from session.realtime.server_events import Outbox
from session.realtime.transcripts import Transcripts
from session.realtime.turn_live import LiveTurns, TurnTaking
from session.realtime.turn_vad import VadTurns
from session.realtime.user_audio import UserAudio

__all__ = ["MIN_COMMIT_MS", "CoreOptions", "RealtimeSessionCore", "check_instructions"]


class RealtimeSessionCore:
    def __init__(self, options: CoreOptions | None = None) -> None:
        self.options = opts = options or CoreOptions()
        new_id = opts.new_id
        self.session_id = opts.session_id or new_id("sess")
        self.state = state = CoreState(
            options=opts,
            config=opts.config.copy(),
            conversation=Conversation(opts.audio_store),
            conversation_id=new_id("conv"),
            out=Outbox(new_id, stamp=opts.stamp_event_ids),
            new_id=new_id,
        )
        self._out = state.out
        self.transcripts = Transcripts(state)
        self.idle = IdleTimeout(state)
        track_limit_s = 0.0 if opts.live_responses else opts.max_input_audio_s
        self.user = UserAudio(state, self.transcripts, track_limit_s=track_limit_s)
        self.responses = ResponseControl(state, self.transcripts, self.idle)
        kind = LiveTurns if opts.live_responses else VadTurns
        self.turns: TurnTaking = kind(state, self.user, self.responses, self.idle)
        # The client `event_id` of the last client event handled (None if it had none): the
        # driver tags the input it hands the live request with it (its errors name it).
        self.input_event_id: str | None = None
        self._started_at: float | None = None
        self._expires_at_epoch = 0
        self._config_changed = False
        self.closed = False
        self.turns.configure()

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
            core.state.conversation_id = conversation_id
        for record in items:
            item = item_from_record(record)
            core.conversation.insert(item)
            if any(c.type == "input_audio" for c in item.content):
                core.transcripts.transcribed.add(item.id)  # its audio is gone: nothing left to transcribe
            if item.role == "assistant" and any(c.type == "output_audio" for c in item.content):
                core.responses.voice_locked = True
        core.conversation.take_changes()  # already stored
        if open_response and open_response.get("id"):
            # Still open in the store until `close_orphaned_responses` ends it for a client: a
            # restore that parks again (no client came) must keep it for the next one.
            core.responses.orphan_response = dict(open_response)
        core._started_at = now - (options.max_duration_s - (expires_at - epoch))
        core._expires_at_epoch = int(expires_at)
        return core

    def release_audio(self) -> None:
        """The session is over in this process: discard its spilled audio (the conversation's
        finalizer would, later)."""
        self.conversation.close()

    # --- properties ----------------------------------------------------------------------

    @property
    def config(self) -> SessionConfig:
        return self.state.config

    @config.setter
    def config(self, config: SessionConfig) -> None:
        self.state.config = config

    @property
    def conversation(self) -> Conversation:
        return self.state.conversation

    @property
    def conversation_id(self) -> str:
        return self.state.conversation_id

    @property
    def last_user_item_id(self) -> str | None:
        """The last committed user audio item."""
        return self.user.last_user_item_id

    @property
    def active_response_id(self) -> str | None:
        run = self.responses.active
        return run.id if run is not None else None

    @property
    def speaking(self) -> bool:
        return self.turns.speaking

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
        if self.idle.deadline is not None:
            deadlines.append(self.idle.deadline)
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
        responses = self.responses
        open_id = responses.open_id
        if items is None and not self._config_changed and open_id == responses.stored_response:
            return None
        changes = StateChanges()
        if open_id != responses.stored_response:
            responses.stored_response = open_id
            changes.open_response_changed = True
            run = responses.active
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

    def feed_input_audio(self, samples: np.ndarray, rate: int, now: float) -> CoreOutput:
        """Mic audio from a media track (WebRTC), float32 mono at `rate`. Past the input budget
        (push-to-talk never committed) frames are dropped, with one `error` per overflow."""
        if not self.closed:
            samples = np.asarray(samples, dtype=np.float32)
            if self.user.feed_track(samples, rate):
                self.user.request_vad()
                self.turns.on_audio(samples, None, rate)
        return self._out.drain()

    def feed_vad(
        self, probabilities: Sequence[float], now: float, *, start_sample: int | None = None
    ) -> CoreOutput:
        """Speech probabilities for frames handed out by `DetectSpeech`, in order. Pass the
        effect's `start_sample` so scores that went stale (clear, VAD reconfigured) are dropped."""
        if not self.closed:
            self.turns.feed_vad(probabilities, now, start_sample)
        return self._out.drain()

    def on_live_response_started(self, now: float) -> tuple[str | None, CoreOutput]:
        """A pipeline that takes its own turns began speaking (:class:`LiveTurns`). Returns the
        response's id, or None when the session is closed or a response is already active (its
        output is then ignored)."""
        if self.closed or self.responses.active is not None:
            return None, self._out.drain()
        self.turns.on_live_response_started(now)
        return self.active_response_id, self._out.drain()

    def on_live_speech_started(self, sample: int, now: float) -> CoreOutput:
        """The live request heard the user start speaking at timeline `sample` (16 kHz): a
        pipeline that detects turns itself (`SpeechStarted`)."""
        if not self.closed:
            self.turns.on_live_speech_started(sample, now)
        return self._out.drain()

    def on_live_speech_stopped(self, sample: int, now: float) -> CoreOutput:
        """The live request heard the user stop at timeline `sample` (`SpeechStopped`)."""
        if not self.closed:
            self.turns.on_live_speech_stopped(sample, now)
        return self._out.drain()

    def on_turn_score(self, ref: str, probability: float, now: float) -> CoreOutput:
        """The end-of-turn model's answer to a `score_turn` (semantic_vad): a turn it calls
        finished ends now, at the pause it scored (:class:`VadTurns`)."""
        if not self.closed:
            self.turns.on_turn_score(ref, probability, now)
        return self._out.drain()

    def on_turn_transcript(self, key: tuple[str, int], text: str | None, now: float) -> CoreOutput:
        """The transcript of a pause made ahead (`PrepareTranscript` `key`; None: none came):
        semantic_vad's second cue (:class:`VadTurns`)."""
        if not self.closed:
            self.turns.on_turn_transcript(key, text, now)
        return self._out.drain()

    def live_error(
        self, code: str, message: str, *, server: bool = True, event_id: str | None = None
    ) -> CoreOutput:
        """An `error` event about the live request (it failed: `server_error`; or the client
        outran it: `invalid_request_error`), naming the client `event_id` of the input that
        caused it where known. The session stays usable."""
        err = ProtocolError(code, message, type=E.SERVER_ERROR if server else E.INVALID_REQUEST)
        self._out.error(err, event_id)
        return self._out.drain()

    def on_input_transcript(
        self, target_id: str, text: str, *, final: bool = True, now: float | None = None
    ) -> CoreOutput:
        """Transcript of user audio; `target_id` is an item id (TranscribeInput) or a response
        id (the pipeline's `Transcript` of the StartResponse audio: goes to its last audio item)."""
        item_id = self.responses.audio_item_of(target_id)
        self.transcripts.on_transcript(item_id, text, final=final, speaking=self.turns.speech_item_id)
        return self._out.drain()

    def on_input_transcript_failed(self, item_id: str, message: str) -> CoreOutput:
        self.transcripts.failed(item_id, message)
        return self._out.drain()

    def on_response_text(self, response_id: str, text: str, now: float | None = None) -> CoreOutput:
        self.responses.on_text(response_id, text)
        return self._out.drain()

    def on_response_audio(self, response_id: str, samples: np.ndarray, rate: int, now: float) -> CoreOutput:
        self.responses.on_audio(response_id, samples, rate, now)
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
        self.responses.on_done(response_id, status, error, now=now, usage=usage)
        return self._out.drain()

    def on_playout(self, response_id: str, played_ms: float, now: float) -> CoreOutput:
        """Track transport: how much of `response_id`'s audio the peer has been sent so far."""
        self.responses.on_playout(response_id, played_ms)
        return self._out.drain()

    def on_playout_finished(self, response_id: str, now: float) -> CoreOutput:
        """Track transport: all audio of `response_id` has been played out."""
        self.responses.on_playout_finished(response_id, now)
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
            if self.responses.active is not None:
                self.responses.cancel_active("client_cancelled", now)
            self._out.error(ProtocolError(E.SESSION_EXPIRED, message))
            self._out.effect(Close(1001, "session expired"))
            self.closed = True
        return self._out.drain()

    def cancel_response(self, now: float) -> CoreOutput:
        """Cancel the active response for the server's own reasons (the client left past
        its disconnect grace): `response.done` cancelled, as if the client had cancelled."""
        if self.responses.active is not None and not self.closed:
            self.responses.cancel_active("client_cancelled", now)
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
        self.responses.close_orphaned(now, failure)
        return self._out.drain()

    def tick(self, now: float) -> CoreOutput:
        """Timers: session expiry and the server VAD idle timeout."""
        out = self.check_expiry(now)
        if self.closed:
            return out
        self.turns.tick(now)
        out.extend(self._out.drain())
        return out

    # --- client events -------------------------------------------------------------------

    def _append(self, audio: str) -> None:
        pcm = self.user.append(audio)
        self.user.request_vad()
        self.turns.on_audio(None, pcm, self.user.input.format.rate)

    def _dispatch(self, event: Any, now: float) -> None:
        conversation = self.conversation
        if isinstance(event, InputAudioBufferAppend):
            self._append(event.audio)
        elif isinstance(event, SessionUpdate):
            self._session_update(event)
        elif isinstance(event, InputAudioBufferCommit):
            self.user.check_commit()
            item_id = self.turns.take_speech_item() or self.state.new_id("item")
            self.user.commit_buffer(item_id)
            self.turns.committed()
        elif isinstance(event, InputAudioBufferClear):
            self.user.input.clear()
            self.turns.on_clear()
            self._out.event("input_audio_buffer.cleared")
            self.turns.cleared()
        elif isinstance(event, OutputAudioBufferClear):
            self._clear_output(now)
        elif isinstance(event, ConversationItemCreate):
            self._item_create(event)
        elif isinstance(event, ConversationItemRetrieve):
            item = conversation.get(event.item_id)
            wire = item.to_wire(with_audio=True, input_format=self.config.input_format)
            self._out.event("conversation.item.retrieved", item=wire)
        elif isinstance(event, ConversationItemDelete):
            conversation.delete(event.item_id)
            self._out.event("conversation.item.deleted", item_id=event.item_id)
        elif isinstance(event, ConversationItemTruncate):
            conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
            self._out.event(
                "conversation.item.truncated",
                item_id=event.item_id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        elif isinstance(event, ResponseCreate):
            self.turns.check_response_create()
            self.responses.start(event, now)
        elif isinstance(event, ResponseCancel):
            self.turns.cancelled(self.responses.cancel_requested(event, now))

    def _session_update(self, event: SessionUpdate) -> None:
        limit = self.options.max_instructions_bytes
        check_instructions(event.session.instructions, limit, "session.instructions")
        before = self.config
        self.config = before.apply_update(event.session, voice_locked=self.responses.voice_locked)
        self._config_changed = True
        self.turns.config_changed(before)
        self.user.input.set_format(self.config.input_format)
        self.turns.configure()
        self._out.event("session.updated", session=self.session_object())

    def _item_create(self, event: ConversationItemCreate) -> None:
        item = item_from_client(
            event.item,
            new_id=self.state.new_id,
            input_format=self.config.input_format,
            output_format=self.config.output_format,
        )
        conversation = self.conversation
        budget = self.options.max_conversation_bytes
        if budget and conversation.text_bytes + text_bytes(item) > budget:
            raise ProtocolError(
                E.CONVERSATION_TOO_LARGE,
                f"The conversation would hold more than {budget} bytes of text "
                f"(it holds {conversation.text_bytes}); delete items first.",
                param="item",
            )
        previous = conversation.insert(item, event.previous_item_id)
        conversation.retain_audio(self.options.audio_retention_s)
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
        if self.responses.active is not None:
            self.responses.cancel_active("client_cancelled", now)
        self.responses.stop_playout()
