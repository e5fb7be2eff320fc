"""A voice session's live request: its microphone audio in, the pipeline's progress out.

The session core cuts its 16 kHz input timeline into whole VAD frames (`DetectSpeech`
effects); this object appends them, in order, to one orchestrator request the session keeps
open on the pipeline's `live` entry (`AudioInput`, with `TurnControl("clear")` ahead of audio
that does not continue what came before), and hands the request's `VoiceActivity` progress
back mapped onto the core's timeline. No model runs here: the VAD is a stage of the pipeline,
batched across sessions by its replica pool (docs/CONTRACTS.md, "Live voice requests").

Bounded by bytes: audio pushed and not yet scored (queued here, or appended and waiting in
the stage) is at most `limit_bytes`; past that `push` refuses frames (the driver reports an
`error` and the frames are lost, never queued without end). So a client may stream faster than
real time as long as the pipeline keeps up, and only what it cannot keep up with is dropped.

A failed live request (a stage raised on this session's input, a worker died) is reported
through `on_failed` and replaced by a new one after a short backoff; frames the failed request
had not scored are never scored (the core drops their pending slots when later scores come).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput, TurnControl, VoiceActivity
from runtime.progress import RequestStatus
from session.realtime.effects import DetectSpeech

log = logging.getLogger(__name__)

FRAME = 512  # samples per VAD frame at 16 kHz
FRAME_BYTES = FRAME * 4  # float32
DEFAULT_LIMIT_BYTES = 1 << 20  # ~16 s of 16 kHz float32 audio waiting for the pipeline
_BACKOFF_S = (0.05, 0.2, 1.0, 2.0)  # before reopening after consecutive failures


@dataclass(slots=True)
class _Segment:
    """Frames appended to the request in one go: request frame index → core timeline."""

    request_frame: int
    core_start: int
    frames: int


class LiveInput:
    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        entry: str,
        session_key: str | None,
        params: Callable[[], Mapping[str, Any]],
        on_activity: Callable[[int, list[float]], None],
        on_failed: Callable[[str], None],
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        name: str = "live",
    ) -> None:
        self._orch = orchestrator
        self._entry = entry
        self._session_key = session_key
        self._params = params
        self._on_activity = on_activity
        self._on_failed = on_failed
        self.limit_bytes = limit_bytes
        self._name = name
        self._queue: deque[DetectSpeech] = deque()
        self._queued_bytes = 0  # pushed, not yet appended
        self._inflight_frames = 0  # appended to the request, not yet scored
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.request_id: str | None = None
        self.opened = 0  # live requests opened (1 + reopenings after failures)
        self.failures = 0
        self.dropped_frames = 0

    @property
    def queued_bytes(self) -> int:
        """Audio pushed and not yet scored: what the bound counts."""
        return self._queued_bytes + self._inflight_frames * FRAME_BYTES

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"{self._name}:live")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        rid, self.request_id = self.request_id, None
        if rid is not None:
            await self._orch.cancel(rid)
        self._queue.clear()
        self._queued_bytes = 0

    def push(self, effect: DetectSpeech) -> bool:
        """Queue frames for the live request; False (frames dropped) past the byte bound."""
        size = effect.samples.nbytes
        if self.queued_bytes + size > self.limit_bytes:
            self.dropped_frames += effect.num_frames
            return False
        self._queue.append(effect)
        self._queued_bytes += size
        self._wake.set()
        return True

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                failed = await self._serve_one()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not admitted (stage full), orchestrator closing
                log.warning("%s: live request not opened: %s", self._name, exc)
                self.failures += 1
                self._on_failed(f"live request not opened: {exc}")
                failed = True
            failures = failures + 1 if failed else 0
            # Even a request that ended by itself is reopened only after a pause: an engine
            # that ends every request at once must not make this a busy loop.
            await asyncio.sleep(_BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1] if failed else _BACKOFF_S[0])

    async def _serve_one(self) -> bool:
        """One live request, from submit until it ends; True when it failed."""
        params = dict(self._params())
        handle = await self._orch.submit(params, session_key=self._session_key, entry=self._entry)
        self.request_id = handle.request_id
        self.opened += 1
        segments: deque[_Segment] = deque()
        reader = asyncio.create_task(self._read(handle, segments), name=f"{self._name}:live-read")
        sender = asyncio.create_task(self._send(handle.request_id, segments), name=f"{self._name}:live-send")
        try:
            await asyncio.wait({reader, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():  # the request no longer takes input: it is ending
                await reader
            status = reader.result()
        finally:
            for task in (reader, sender):
                task.cancel()
            await asyncio.gather(reader, sender, return_exceptions=True)
            self.request_id = None
            self._inflight_frames = 0  # what the request held unscored is gone with it
        if status is not None and status.status == "failed":
            self.failures += 1
            self._on_failed(status.error or "live request failed")
            return True
        return False

    async def _send(self, request_id: str, segments: deque[_Segment]) -> None:
        frame = 0  # frames appended to this request so far
        first = True
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            effect = self._queue.popleft()
            self._queued_bytes -= effect.samples.nbytes
            if effect.reset and not first and not await self._orch.append_input(
                request_id, TurnControl("clear")
            ):
                return
            first = False
            segments.append(_Segment(frame, effect.start_sample, effect.num_frames))
            frame += effect.num_frames
            self._inflight_frames += effect.num_frames
            if not await self._orch.append_input(request_id, AudioInput(effect.samples, 16000)):
                return  # the request ended (failed or cancelled): the reader reports it

    async def _read(self, handle: Any, segments: deque[_Segment]) -> RequestStatus | None:
        async for out in handle:
            if isinstance(out, VoiceActivity):
                self._deliver(out, segments)
            elif isinstance(out, RequestStatus):
                return out
        return None

    def _deliver(self, activity: VoiceActivity, segments: deque[_Segment]) -> None:
        """Map probabilities from request frames onto the core's timeline, run by run."""
        frame = activity.start_sample // FRAME
        probs = activity.probs
        while probs and segments:
            seg = segments[0]
            end = seg.request_frame + seg.frames
            if frame >= end:
                segments.popleft()
                continue
            offset = frame - seg.request_frame
            take = min(len(probs), end - frame)
            self._inflight_frames = max(0, self._inflight_frames - take)
            self._on_activity(seg.core_start + offset * FRAME, list(probs[:take]))
            probs = probs[take:]
            frame += take
            if frame >= end:
                segments.popleft()
