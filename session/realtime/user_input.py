"""The user's side of the session core: input audio, server VAD turns, commits, transcripts.

A mixin of :class:`~session.realtime.core.RealtimeSessionCore` (kept apart so neither file
grows past a readable size); it shares the core's state, declared below for the type checker.
`handle_client_event` routes `input_audio_buffer.append` here without building a model
(`events.append_audio`): at 25 appends a second per session it is the server's hottest path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from media.audio import AudioFormatError, b64decode_audio, float32_to_int16_exact, int16_to_float32
from session.realtime import errors as E
from session.realtime.config import SessionConfig, TurnDetection
from session.realtime.conversation import Content, Conversation, Item
from session.realtime.effects import (
    CoreOutput,
    DropAhead,
    LiveAudio,
    LiveControl,
    PrepareTranscript,
    RespondAhead,
    TranscribeInput,
)
from session.realtime.errors import ProtocolError
from session.realtime.ids import IdFactory
from session.realtime.input_audio import FRAME, SAMPLES_PER_MS, InputAudio, ms_of
from session.realtime.responses import CancelReason, ResponseRun
from session.realtime.server_events import Outbox
from session.realtime.turns import SpeechDetector, SpeechStarted, SpeechStopped

if TYPE_CHECKING:
    from session.realtime.core import CoreOptions
    from session.realtime.events import ResponseCreate

MIN_COMMIT_MS = 100
# With a pipeline that takes its own turns, user audio is committed when the model starts
# speaking, and at the latest every this many ms (items and the buffer stay bounded).
LIVE_COMMIT_MAX_MS = 30_000


STREAMED_ITEMS_MAX = 16  # items whose transcription deltas are remembered until their final


def _word_keys(text: str) -> list[str]:
    return ["".join(ch for ch in w.lower() if ch.isalnum() or ch == "'") for w in text.split()]


def remaining_words(streamed: str, final: str) -> str:
    """What a final transcript adds to the deltas already sent: its words after those the
    deltas said (case and punctuation aside), with a leading space after streamed text; ""
    when the deltas said it all or said something else (the completed event then corrects)."""
    said, words = _word_keys(streamed), final.split()
    if said != _word_keys(" ".join(words[: len(said)])):
        return ""
    rest = " ".join(words[len(said) :])
    return (" " + rest if said else rest) if rest else ""


class UserInput(ABC):
    """Input-side entry points and helpers of the session core (see the module docstring)."""

    options: CoreOptions
    config: SessionConfig
    conversation: Conversation
    closed: bool
    _new_id: IdFactory
    _out: Outbox
    _input: InputAudio
    _vad: SpeechDetector
    _speech_item_id: str | None
    _speech_start: int
    _prepared: tuple[str, int] | None
    _streamed: OrderedDict[str, str]  # item id → transcription deltas sent before its final
    input_event_id: str | None
    _ahead: tuple[str, int] | None
    _active: ResponseRun | None
    _prompt_items: OrderedDict[str, list[str]]
    _transcribed: set[str]
    _transcribe_requested: set[str]
    _idle_deadline: float | None
    _track_overflow: bool  # track audio past the input budget is being dropped
    last_user_item_id: str | None

    # Provided by the core.
    @abstractmethod
    def _cancel_active(self, reason: CancelReason, now: float) -> None: ...

    @abstractmethod
    def _stop_playout(self) -> None: ...

    @abstractmethod
    def _params_ahead(self, item_id: str) -> dict[str, Any]: ...

    @abstractmethod
    def _start_response(
        self,
        event: ResponseCreate | None,
        now: float,
        *,
        transcript_key: tuple[str, int] | None = None,
        live: bool = False,
    ) -> None: ...

    def feed_input_audio(self, samples: np.ndarray, rate: int, now: float) -> CoreOutput:
        """Mic audio from a media track (WebRTC), float32 mono at `rate`. Past the input budget
        (push-to-talk never committed) frames are dropped, with one `error` per overflow."""
        if not self.closed and self._track_over_budget():
            return self._out.drain()
        if not self.closed:
            samples = np.asarray(samples, dtype=np.float32)
            self._input.append_samples(samples, rate)
            self._request_vad()
            if self.options.live_responses:
                self._live_input(samples, rate)
        return self._out.drain()

    def on_live_response_started(self, now: float) -> tuple[str | None, CoreOutput]:
        """A pipeline that takes its own turns began speaking: the user's audio since the last
        commit becomes a user item (as server VAD would commit it), then a response opens whose
        output the live request streams (no StartResponse). Returns its id, or None when the
        session is closed or a response is already active (its output is then ignored)."""
        if self.closed or self._active is not None:
            return None, self._out.drain()
        self._live_commit()
        self._start_response(None, now, live=True)
        return (self._active.id if self._active is not None else None), self._out.drain()

    def on_live_speech_started(self, sample: int, now: float) -> CoreOutput:
        """The live request heard the user start speaking at timeline `sample` (16 kHz): a
        pipeline that detects turns itself (`SpeechStarted`)."""
        if self.closed or self._speech_item_id is not None:
            return self._out.drain()
        self._speech_item_id = self._new_id("item")
        self._speech_start = max(self._input.start, sample)
        self._out.event(
            "input_audio_buffer.speech_started",
            item_id=self._speech_item_id,
            audio_start_ms=ms_of(self._speech_start),
        )
        return self._out.drain()

    def on_live_speech_stopped(self, sample: int, now: float) -> CoreOutput:
        """The live request heard the user stop at timeline `sample` (`SpeechStopped`): the
        audio since the start becomes the user item (the pipeline decides whether to answer)."""
        item_id = self._speech_item_id
        if self.closed or item_id is None:
            return self._out.drain()
        self._speech_item_id = None
        end = max(sample, self._speech_start)
        self._out.event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms_of(end))
        self._input.drop_before(self._speech_start)
        self._commit(item_id, self._input.take(self._speech_start, end), respond=False)
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

    def _live_input(self, samples: np.ndarray, rate: int) -> None:
        self._out.effect(LiveAudio(samples, rate))
        if self._input.duration_ms >= LIVE_COMMIT_MAX_MS:
            self._live_commit()  # a user who talks on and on: bounded items, bounded buffer

    def _live_commit(self) -> None:
        self._input.flush()
        if self._input.duration_ms < MIN_COMMIT_MS:
            return
        audio = self._input.take(self._input.start, self._input.end)
        self._input.clear()
        self._commit(self._new_id("item"), audio, respond=False)

    def feed_vad(
        self, probabilities: Sequence[float], now: float, *, start_sample: int | None = None
    ) -> CoreOutput:
        """Speech probabilities for frames handed out by `DetectSpeech`, in order. Pass the
        effect's `start_sample` so scores that went stale (clear, VAD reconfigured) are dropped."""
        if self.closed or self.config.turn_detection is None:
            return self._out.drain()
        td = self.config.turn_detection
        starts = self._input.claim_scored(len(probabilities), start_sample)
        for frame_start, p in zip(starts, probabilities, strict=False):
            change = self._vad.feed(frame_start, float(p))
            if isinstance(change, SpeechStarted):
                self._on_speech_started(change, td, now)
            elif isinstance(change, SpeechStopped):
                self._on_speech_stopped(change, td, now)
            else:
                self._maybe_prepare_transcript(frame_start + FRAME, td)
                self._maybe_respond_ahead(frame_start + FRAME, td)
        if not self._vad.speaking:
            self._input.drop_before(self._input.first_unscored - td.prefix_padding_ms * SAMPLES_PER_MS)
        return self._out.drain()

    def on_input_transcript(
        self, target_id: str, text: str, *, final: bool = True, now: float | None = None
    ) -> CoreOutput:
        """Transcript of user audio; `target_id` is an item id (TranscribeInput) or a response
        id (the pipeline's `Transcript` of the StartResponse audio: goes to its last audio item)."""
        item_id = target_id
        if target_id in self._prompt_items:
            ids = self._prompt_items[target_id]
            item_id = ids[-1] if ids else ""
        enabled = self.config.transcription is not None
        if not final and item_id == self._speech_item_id and item_id is not None:
            # A live ASR's words while the item is still being spoken (it is added at commit).
            if enabled and text:
                self._transcript_delta(item_id, 0, text)
            return self._out.drain()
        if item_id not in self.conversation or item_id in self._transcribed:
            return self._out.drain()
        item = self.conversation.get(item_id)
        index = next((k for k, c in enumerate(item.content) if c.type == "input_audio"), None)
        if index is None:
            return self._out.drain()
        part = item.content[index]
        if not final:
            if enabled and text:
                self._transcript_delta(item_id, index, text)
            return self._out.drain()
        self._transcribed.add(item_id)
        streamed = self._streamed.pop(item_id, None)
        part.heard = text
        self.conversation.mark_changed(item_id)
        if enabled:
            rest = remaining_words(streamed or "", text)
            if rest:  # what the deltas did not say yet, so the deltas add up to the transcript
                self._out.event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item_id,
                    content_index=index,
                    delta=rest,
                )
            part.transcript = text
            seconds = (part.audio_ms() or part.dropped_ms or 0.0) / 1000.0
            self._out.event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=index,
                transcript=text,
                usage={"type": "duration", "seconds": round(seconds, 3)},
            )
        return self._out.drain()

    def _transcript_delta(self, item_id: str, index: int, text: str) -> None:
        self._out.event(
            "conversation.item.input_audio_transcription.delta",
            item_id=item_id,
            content_index=index,
            delta=text,
        )
        streamed = self._streamed
        streamed[item_id] = streamed.pop(item_id, "") + text
        while len(streamed) > STREAMED_ITEMS_MAX:  # items that were never committed or finished
            streamed.popitem(last=False)

    def on_input_transcript_failed(self, item_id: str, message: str) -> CoreOutput:
        if item_id in self.conversation and item_id not in self._transcribed:
            self._transcribed.add(item_id)
            if self.config.transcription is not None:
                self._out.event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item_id,
                    content_index=0,
                    error={"type": "transcription_error", "code": "transcription_failed", "message": message},
                )
        return self._out.drain()

    def _append(self, audio: str) -> None:
        """`input_audio_buffer.append`: the input budget is checked here, where every append
        arrives, whatever buffers the audio afterwards."""
        try:
            data = b64decode_audio(audio)
            self._check_input_budget(len(data))
            pcm = self._input.append_wire(data)
        except AudioFormatError as exc:
            raise ProtocolError(
                E.INVALID_VALUE, f"Invalid value for 'audio': {exc}.", param="audio"
            ) from None
        self._request_vad()
        if self.options.live_responses and len(pcm):
            self._live_input(int16_to_float32(pcm), self._input.format.rate)

    def _check_input_budget(self, size: int) -> None:
        limit_s = self.options.max_input_audio_s
        if not limit_s:
            return
        fmt = self._input.format
        incoming_ms = size / fmt.bytes_per_sample * 1000 / fmt.rate
        if self._input.buffered_ms + incoming_ms > limit_s * 1000:
            raise ProtocolError(
                E.INPUT_AUDIO_TOO_LARGE,
                f"The input audio buffer would hold more than {limit_s:g} s of uncommitted audio: "
                "commit or clear it (this append was not added).",
                param="audio",
            )

    def _track_over_budget(self) -> bool:
        limit_s = self.options.max_input_audio_s
        over = bool(limit_s) and not self.options.live_responses and self._input.buffered_ms > limit_s * 1000
        if over and not self._track_overflow:
            self._out.error(
                ProtocolError(
                    E.INPUT_AUDIO_TOO_LARGE,
                    f"The input audio buffer holds {limit_s:g} s of uncommitted audio: track audio is "
                    "dropped until it is committed or cleared.",
                )
            )
        self._track_overflow = over
        return over

    def _request_vad(self) -> None:
        frames = self._input.next_frames()
        if frames is not None:
            self._out.effect(frames)

    def _manual_commit(self) -> None:
        self._input.flush()
        if self._input.duration_ms < MIN_COMMIT_MS:
            raise ProtocolError(
                E.COMMIT_EMPTY,
                f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_MS}ms "
                f"of audio, but buffer only has {self._input.duration_ms}ms of audio.",
            )
        item_id = self._speech_item_id or self._new_id("item")
        self._vad.reset()
        self._end_speech()
        audio = self._input.take(self._input.start, self._input.end)
        self._input.clear()
        self._commit(item_id, audio, respond=False)

    def _commit(self, item_id: str, audio: np.ndarray, *, respond: bool) -> Item:
        stored = float32_to_int16_exact(audio)  # PCM16: half the memory of float32
        item = Item(
            item_id, "message", role="user", content=[Content(type="input_audio", input_audio=stored)]
        )
        previous = self.conversation.insert(item)
        self.last_user_item_id = item_id
        self._out.event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        wire = item.to_wire()
        self._out.event("conversation.item.added", previous_item_id=previous, item=wire)
        self._out.event("conversation.item.done", previous_item_id=previous, item=wire)
        if not (respond and self.options.pipeline_transcribes_input):
            self._request_transcription(item)
        self.conversation.retain_audio(self.options.audio_retention_s)
        return item

    def _request_transcription(self, item: Item) -> None:
        if self.config.transcription is None or item.id in self._transcribe_requested:
            return
        if item.id in self._transcribed:
            return
        audio = item.audio_16k  # once: a spilled item's is read back
        if audio is None:
            return
        self._transcribe_requested.add(item.id)
        self._out.effect(TranscribeInput(item.id, audio))

    def _on_speech_started(self, change: SpeechStarted, td: TurnDetection, now: float) -> None:
        self._idle_deadline = None
        self._speech_item_id = self._new_id("item")
        self._speech_start = max(
            self._input.start, change.start_sample - td.prefix_padding_ms * SAMPLES_PER_MS
        )
        self._out.event(
            "input_audio_buffer.speech_started",
            item_id=self._speech_item_id,
            audio_start_ms=ms_of(self._speech_start),
        )
        if self.options.live_transcribes_input:
            partials = self.config.transcription is not None
            params = {"ref": self._speech_item_id, "start": self._speech_start, "partials": partials}
            self._out.effect(LiveControl("speech_started", params))
        if td.interrupt_response:
            if self._active is not None:
                self._cancel_active("turn_detected", now)
            self._stop_playout()

    def _on_speech_stopped(self, change: SpeechStopped, td: TurnDetection, now: float) -> None:
        item_id = self._speech_item_id or self._new_id("item")
        self._end_speech(change.commit_end)
        self._out.event(
            "input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms_of(change.end_sample)
        )
        respond = td.create_response and self._active is None
        if not respond or self._ahead != (item_id, change.end_sample):
            self._drop_ahead()  # else StartResponse below settles it
        self._ahead = None
        audio = self._input.take(self._speech_start, change.commit_end)
        self._commit(item_id, audio, respond=respond)
        if respond:
            self._start_response(None, now, transcript_key=(item_id, change.end_sample))

    def _end_speech(self, end: int | None = None) -> None:
        """The item being spoken ends (committed, cleared): a live ASR stops its deltas. `end`:
        where the turn's audio ended on the timeline, when the VAD ended it (voice after it is
        the next turn's, which the live ASR keeps until that turn is marked)."""
        item_id, self._speech_item_id = self._speech_item_id, None
        if item_id is not None and self.options.live_transcribes_input:
            params: dict[str, object] = {"ref": item_id}
            if end is not None:
                params["end"] = end
            self._out.effect(LiveControl("speech_stopped", params))

    def _maybe_prepare_transcript(self, frame_end: int, td: TurnDetection) -> None:
        """A pause long enough that the turn may end here: transcribe it ahead (once)."""
        pause = self._vad.silence_start
        item_id = self._speech_item_id
        after_ms = min(self.options.prepare_transcript_after_ms, td.effective_silence_ms())
        if (
            pause is None
            or item_id is None
            or after_ms <= 0
            or not (td.create_response and self.options.pipeline_transcribes_input)
            or frame_end - pause < after_ms * SAMPLES_PER_MS
            or self._prepared == (item_id, pause)
        ):
            return
        self._prepared = (item_id, pause)
        audio = self._input.slice(self._speech_start, pause)
        self._out.effect(PrepareTranscript((item_id, pause), audio, start_sample=self._speech_start))

    def _maybe_respond_ahead(self, frame_end: int, td: TurnDetection) -> None:
        """The pause transcribed ahead has lasted `respond_ahead_after_ms`: start the response
        the turn's end would start (`RespondAhead`); the speaker going on drops it."""
        pause = self._vad.silence_start
        item_id = self._speech_item_id
        key = (item_id, pause) if item_id is not None and pause is not None else None
        if self._ahead is not None and self._ahead != key:
            self._drop_ahead()  # speech resumed after the pause the response was started in
        after_ms = min(self.options.respond_ahead_after_ms, td.effective_silence_ms())
        if (
            key is None
            or pause is None
            or after_ms <= 0
            or self._prepared != key
            or self._ahead == key
            or self._active is not None
            or frame_end - pause < after_ms * SAMPLES_PER_MS
        ):
            return
        self._ahead = key
        self._out.effect(RespondAhead(key, self._params_ahead(key[0])))

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._out.effect(DropAhead(self._ahead))
            self._ahead = None
