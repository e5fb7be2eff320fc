"""A voice session's live request: its microphone audio in, the pipeline's progress out.

Streaming input is progress of one request (docs/CONTRACTS.md, "Live voice requests"): the
session keeps one request open on the pipeline's `live` entry for as long as it is served here
and appends its audio to it as it arrives. Two kinds of pipeline use it:

- One whose live entry only scores speech (`voice_activity`: the Silero VAD stage, batched
  across sessions by its replica pool). The core cuts its 16 kHz timeline into whole VAD frames
  (`DetectSpeech`); they go in as `AudioInput` (a `TurnControl("clear")` ahead of audio that
  does not continue the audio before) and the `VoiceActivity` that comes back is mapped onto
  the core's timeline for its server VAD (`feed_vad`); an end-of-turn stage's `TurnScore`
  answers the core's `score_turn` (semantic_vad, `on_turn_score`). Responses stay requests of
  their own.
- One that takes its own turns (`turn_detection` / `responses`: a full-duplex model). Every
  append goes in (`LiveAudio` effects, resampled once to the pipeline's input rate);
  `SpeechStarted` / `SpeechStopped` mark the user's turns, `Transcript` transcribes the user's
  audio, `ResponseStarted` opens a response (`on_live_response_started`: the user's audio so far
  becomes a user item, then `response.created`), `TextDelta` / `AudioChunk` are its transcript
  and audio, `ResponseDone` ends it.

Faults: a live request that fails (a stage raised on this session's input, a worker died)
gives the client an `error` (`server_error`) and is opened again after a short backoff; the
session stays usable and other sessions' requests are untouched. Bounds: audio pushed and not
yet taken (queued here, or appended and not yet scored by the VAD stage) is at most
`input_limit_bytes`; past it new audio is dropped and the client gets an `error`
(`input_audio_overflow`, at most one a second). `append_input` itself waits while the runtime
holds 256 unconsumed inputs, so nothing grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from media.audio import StreamingResampler
from runtime.orchestrator import Orchestrator
from runtime.payloads import (
    AudioChunk,
    AudioInput,
    Conditioning,
    ResponseDone,
    ResponseStarted,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    Transcript,
    TurnControl,
    TurnScore,
    VoiceActivity,
)
from runtime.progress import RequestStatus
from session.realtime.core import RealtimeSessionCore
from session.realtime.effects import CoreOutput, DetectSpeech, LiveAudio, LiveControl
from session.voice.turn_feed import TurnModelFeed

log = logging.getLogger(__name__)

# After a failure the live request is opened again after 0.5 s, doubling up to 10 s while it
# keeps failing at once (a full model, a broken engine): a bounded retry, one error each.
REOPEN_DELAY_S = 0.5
REOPEN_DELAY_MAX_S = 10.0
FRAME = 512  # samples per VAD frame at 16 kHz
VAD_RATE = 16_000
TRANSCRIBE_TIMEOUT_S = 10.0  # a `transcribe` the live ASR has not answered by then is given up
OVERFLOW_REPORT_S = 1.0  # input_audio_overflow errors: at most one per this many seconds


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """Where and how a session opens its live request (from `orch.capabilities()`).
    `frames`: the entry scores VAD frames (`DetectSpeech` in, `VoiceActivity` out) rather than
    taking every append at `input_rate` (`LiveAudio`)."""

    entry: str
    input_rate: int
    frames: bool = False
    transcribes: bool = False  # a live ASR stage follows the VAD (`LiveControl`, `transcribe`)
    # The gated edge into an end-of-turn stage (`TurnModelFeed`): open only for semantic_vad.
    turn_gate: tuple[str, str] | None = None


@dataclass(slots=True)
class _Segment:
    """VAD frames appended in one go: request frame index → core timeline sample."""

    request_frame: int
    core_start: int
    frames: int


_Input = np.ndarray | DetectSpeech | LiveControl | Conditioning
SPANS_MAX = 4096  # VAD segments remembered to map core positions onto the request (~2 min)


class LiveRequest:
    """The live request of one session: input pump, progress reader, reopen on failure."""

    def __init__(
        self,
        orch: Orchestrator,
        entry: LiveEntry,
        core: RealtimeSessionCore,
        apply: Callable[[CoreOutput], None],
        now: Callable[[], float],
        *,
        session_key: str | None,
        input_limit_bytes: int = 1 << 20,
    ) -> None:
        self._orch = orch
        self._entry = entry
        self._core = core
        self._apply = apply
        self._now = now
        self._session_key = session_key
        self.limit_bytes = input_limit_bytes
        self._queue: deque[tuple[_Input, str | None]] = deque()  # with the client event it came in
        self._appended_event_id: str | None = None  # of the last input appended to the request
        self._queued_bytes = 0  # audio pushed, not yet appended
        self._unscored = 0  # VAD frames appended, not yet scored
        self._wake = asyncio.Event()
        self._resampler: StreamingResampler | None = None
        self._overflow_reported_at: float | None = None
        self._segments: deque[_Segment] = deque()  # of the current request (VAD frames)
        self._spans: deque[_Segment] = deque(maxlen=SPANS_MAX)  # ... scored or not (positions)
        self._asked: dict[str, asyncio.Future[str]] = {}  # `transcribe` refs awaiting their text
        self._drafts: dict[str, Callable[[str], None]] = {}  # ... and who takes a draft of it
        self._ends: dict[int, str] = {}  # ... by where their stretch ends (`need`)
        self._asks = 0
        self._sent = 0  # input-rate samples handed on or dropped (where a new request starts)
        self._base = 0  # ... when the current request opened
        self.request_id: str | None = None
        self._response_id: str | None = None
        self.opened = 0  # live requests opened (1 + reopens after failures)
        self.failures = 0
        self.dropped_bytes = 0
        self.turn_feed: TurnModelFeed | None = None
        if entry.turn_gate is not None:
            self.turn_feed = TurnModelFeed(orch, entry.turn_gate, self._semantic)

    def _semantic(self) -> bool:
        td = self._core.config.turn_detection
        return td is not None and td.type == "semantic_vad"

    @property
    def queued_bytes(self) -> int:
        """Audio pushed and not yet taken: what the bound counts."""
        return self._queued_bytes + self._unscored * FRAME * 4

    # --- input (event loop, no I/O) ------------------------------------------------------

    def push(self, effect: LiveAudio) -> None:
        """Audio of one append (pipelines that take their own turns)."""
        if self._resampler is None or self._resampler.src_rate != effect.rate:
            self._resampler = StreamingResampler(effect.rate, self._entry.input_rate)
        samples = self._resampler.process(effect.samples)
        if samples.size and self._room(samples.nbytes):
            self._queue_input(samples, samples.nbytes)
        elif samples.size:
            self._sent += samples.size  # the timeline moves on without it

    def push_frames(self, effect: DetectSpeech) -> None:
        """Whole VAD frames of the core's timeline (pipelines that score speech only)."""
        if self._room(effect.samples.nbytes):
            self._queue_input(effect, effect.samples.nbytes)

    def control(self, control: LiveControl) -> None:
        """Turn control, in order with the audio (a few small objects, never dropped)."""
        self._queue_input(control, 0)

    @property
    def transcribes(self) -> bool:
        return self._entry.transcribes

    async def transcribe(
        self, start: int, end: int, *, first: bool = False, draft: Callable[[str], None] | None = None
    ) -> str:
        """The live ASR's final transcript of core timeline [start, end) (audio it already
        holds); "" when the live request ended before it answered, or after 10 s. `first`: a
        decision waits for it (the stage makes it before those that only a response reads);
        `draft` is called with the stage's draft of it, if one comes before the final words."""
        self._asks += 1
        ref = f"t{self._asks}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._asked[ref] = future
        if draft is not None:
            self._drafts[ref] = draft
        self._ends[end] = ref
        params: dict[str, Any] = {"ref": ref, "start": start, "end": end}
        if first:
            params["first"] = True
        self.control(LiveControl("transcribe", params))
        try:
            async with asyncio.timeout(TRANSCRIBE_TIMEOUT_S):
                return await future
        except TimeoutError:  # never left waiting: the response's own ASR transcribes instead
            self.control(LiveControl("transcribe_cancel", {"ref": ref}))  # nor the stage for us
            return ""
        except asyncio.CancelledError:  # given up (`DropTranscript`): the stage need not make it
            self.control(LiveControl("transcribe_cancel", {"ref": ref}))  # (made already: a no-op)
            raise
        finally:
            self._asked.pop(ref, None)
            self._drafts.pop(ref, None)
            if self._ends.get(end) == ref:
                del self._ends[end]

    def need(self, end: int) -> None:
        """A decision waits for the transcript asked of the stretch ending at `end`: the live
        ASR makes it before those whose need it does not know (`transcribe_needed`)."""
        ref = self._ends.get(end)
        if ref is not None:
            self.control(LiveControl("transcribe_needed", {"ref": ref}))

    def _request_sample(self, core_sample: int) -> int:
        """Where core timeline `core_sample` lies on the current request's timeline (a sample
        in a gap maps to the next audio the request got, one past its audio to its end)."""
        for seg in reversed(self._spans):
            if core_sample >= seg.core_start:
                return seg.request_frame * FRAME + min(core_sample - seg.core_start, seg.frames * FRAME)
        return self._spans[0].request_frame * FRAME if self._spans else 0

    def _turn_control(self, control: LiveControl) -> TurnControl:
        params = dict(control.params)
        for key in ("start", "end"):
            if key in params and self._entry.frames:
                params[key] = self._request_sample(int(params[key]))
        return TurnControl(control.kind, response_id=control.response_id, params=params)

    def update(self, values: dict[str, Any]) -> None:
        """`session.update` changes for the model (`orch.update`), in order with the audio."""
        self._queue_input(Conditioning(dict(values)), 0)

    def _queue_input(self, item: _Input, size: int) -> None:
        self._queue.append((item, self._core.input_event_id))
        self._queued_bytes += size
        self._wake.set()

    def _room(self, size: int) -> bool:
        if self.queued_bytes + size <= self.limit_bytes:
            return True
        self.dropped_bytes += size
        now = self._now()
        if self._overflow_reported_at is None or now - self._overflow_reported_at >= OVERFLOW_REPORT_S:
            # Not one per append: a client streaming a file would get hundreds.
            self._overflow_reported_at = now
            self._apply(self._core.live_error(
                "input_audio_overflow",
                f"Input audio is arriving faster than it can be processed: more than {self.limit_bytes} "
                "bytes are waiting; audio is dropped until it catches up. Send audio in real time.",
                server=False,
            ))
        return False

    # --- tasks ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Open the live request, pump input into it and read its progress; reopen it when it
        fails; cancel it when cancelled (the session ends or leaves this process)."""
        delay = REOPEN_DELAY_S
        while True:
            began = self._now()
            status = await self._serve_once()
            if status is not None and status.status == "completed":
                return  # the pipeline ended the conversation itself
            if self._now() - began > REOPEN_DELAY_MAX_S:
                delay = REOPEN_DELAY_S  # it ran a while: a fresh failure, not a failing loop
            await asyncio.sleep(delay)
            delay = min(delay * 2, REOPEN_DELAY_MAX_S)

    async def _serve_once(self) -> RequestStatus | None:
        params: dict[str, Any] = {"live": True, "session_id": self._core.session_id}
        try:
            handle = await self._orch.submit(params, session_key=self._session_key, entry=self._entry.entry)
        except Exception as exc:  # not admitted (the stage is full), or the orchestrator closing
            self.failures += 1
            self._apply(self._core.live_error("server_error", f"Input processing is at capacity: {exc}"))
            return None
        self.opened += 1
        self.request_id = handle.request_id
        self._segments.clear()
        self._spans.clear()
        self._unscored = 0
        self._base = self._sent
        pump = asyncio.create_task(self._pump(handle.request_id), name=f"{self._core.session_id}:live-pump")
        status: RequestStatus | None = None
        try:
            async for out in handle:
                if isinstance(out, RequestStatus):
                    status = out
                else:
                    self._on_progress(out)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            self.request_id = None
            self._unscored = 0  # what the request held unscored is gone with it
            for future in self._asked.values():
                if not future.done():
                    future.set_result("")  # its audio went with the request
            if status is None:  # we were cancelled (the session ends or leaves): stop the model
                await self._orch.cancel(handle.request_id)
            ended = "failed" if status is not None and status.status == "failed" else "cancelled"
            self._end_response(ended, None if status is None else status.error)
        if status is not None and status.status == "failed":
            self.failures += 1
            log.warning("live request of %s failed: %s", self._core.session_id, status.error)
            message = f"Input processing failed: {status.error}"
            # The error names the client event whose input reached the request last: where the
            # stage raised on this session's input, the one that caused it or just before it.
            cause = self._appended_event_id
            self._apply(self._core.live_error("live_request_failed", message, event_id=cause))
        return status

    async def _pump(self, request_id: str) -> None:
        frame = 0  # VAD frames appended to this request
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                item, event_id = self._queue.popleft()
                if event_id is not None:
                    self._appended_event_id = event_id
                payload: AudioInput | TurnControl
                if self.turn_feed is not None:
                    self.turn_feed.sync(request_id)
                if isinstance(item, Conditioning):
                    await self._orch.update(request_id, item)  # False: ended (the reader sees it)
                    continue
                if isinstance(item, LiveControl):
                    payload = self._turn_control(item)
                elif isinstance(item, DetectSpeech):
                    self._queued_bytes -= item.samples.nbytes
                    clear = TurnControl("clear")
                    if item.reset and frame and not await self._orch.append_input(request_id, clear):
                        return
                    segment = _Segment(frame, item.start_sample, item.num_frames)
                    self._segments.append(segment)
                    self._spans.append(segment)
                    frame += item.num_frames
                    self._unscored += item.num_frames
                    payload = AudioInput(item.samples, VAD_RATE)
                else:
                    self._queued_bytes -= item.nbytes
                    self._sent += item.size
                    payload = AudioInput(item, self._entry.input_rate)
                if not await self._orch.append_input(request_id, payload):
                    return

    # --- progress → core -----------------------------------------------------------------

    def _on_progress(self, out: object) -> None:
        core, now = self._core, self._now()
        if isinstance(out, VoiceActivity):
            self._voice_activity(out)
        elif isinstance(out, TurnScore):  # the end-of-turn stage's answer (semantic_vad)
            self._apply(core.on_turn_score(out.ref, out.probability, now))
        elif isinstance(out, SpeechStarted | SpeechStopped):
            sample = round(self._base * VAD_RATE / self._entry.input_rate) + out.audio_ms * (VAD_RATE // 1000)
            if isinstance(out, SpeechStarted):
                self._apply(core.on_live_speech_started(sample, now))
            else:
                self._apply(core.on_live_speech_stopped(sample, now))
        elif isinstance(out, Transcript) and out.ref is not None:
            future = self._asked.get(out.ref)
            if future is not None and not out.final:  # a draft: the final words follow
                take = self._drafts.pop(out.ref, None)
                if take is not None:
                    take(out.text)
            elif future is not None:
                if not future.done():
                    future.set_result(out.text)
            else:  # the words of the item being spoken, while it is spoken
                self._apply(core.on_input_transcript(out.ref, out.text, final=out.final, now=now))
        elif isinstance(out, Transcript):
            item_id = core.last_user_item_id
            if item_id is not None:
                self._apply(core.on_input_transcript(item_id, out.text, final=out.final, now=now))
        elif isinstance(out, ResponseStarted):
            self._end_response("completed", None)  # a start without a done: close the last one
            self._response_id, result = core.on_live_response_started(now)
            self._apply(result)
        elif self._response_id is None:
            return  # output outside a response (or of one the client cancelled) is not sent
        elif isinstance(out, AudioChunk):
            self._apply(core.on_response_audio(self._response_id, out.samples, out.sample_rate, now))
        elif isinstance(out, TextDelta):
            self._apply(core.on_response_text(self._response_id, out.text, now))
        elif isinstance(out, ResponseDone):
            self._end_response(out.status, out.error)

    def _voice_activity(self, activity: VoiceActivity) -> None:
        """Map probabilities from request frames onto the core's timeline, run by run."""
        frame = activity.start_sample // FRAME
        probs = activity.probs
        segments = self._segments
        while probs and segments:
            seg = segments[0]
            end = seg.request_frame + seg.frames
            if frame >= end:
                segments.popleft()
                continue
            offset = frame - seg.request_frame
            take = min(len(probs), end - frame)
            self._unscored = max(0, self._unscored - take)
            self._apply(
                self._core.feed_vad(probs[:take], self._now(), start_sample=seg.core_start + offset * FRAME)
            )
            probs = probs[take:]
            frame += take
            if frame >= end:
                segments.popleft()

    def _end_response(self, status: str, error: str | None) -> None:
        rid, self._response_id = self._response_id, None
        if rid is not None:
            final = _STATUSES.get(status, "failed")
            self._apply(self._core.on_response_done(rid, final, error, now=self._now()))


_STATUSES: dict[str, Literal["completed", "failed", "cancelled", "incomplete"]] = {
    "completed": "completed", "failed": "failed", "cancelled": "cancelled", "incomplete": "incomplete",
}
