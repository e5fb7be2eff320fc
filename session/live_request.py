"""A voice session's live request on a pipeline that takes its own turns (a full-duplex model).

The session keeps one request open on the pipeline's live entry for as long as it is served
here and appends every piece of microphone audio to it (`LiveAudio` effects of the core,
resampled once to the pipeline's input rate). What the pipeline streams back is mapped onto
the core: `ResponseStarted` opens a response (`on_live_response_started`: the user's audio so
far becomes a user item, then `response.created`), `TextDelta` / `AudioChunk` are its
transcript and audio, `ResponseDone` ends it. A live request that fails gives the client one
`error` (`server_error`) and is opened again; the session stays usable.

Bounds: audio waiting for `append_input` (which itself waits while the runtime holds 256
unconsumed inputs) is kept up to `input_limit_bytes`; past it new audio is dropped and the
client gets one `error` (`input_audio_overflow`) per overflow episode.
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
from runtime.payloads import AudioChunk, AudioInput, ResponseDone, ResponseStarted, TextDelta
from runtime.progress import AdmissionError, RequestStatus
from session.realtime.core import RealtimeSessionCore
from session.realtime.effects import CoreOutput, LiveAudio

log = logging.getLogger(__name__)

# After a failure the live request is opened again after 0.5 s, doubling up to 10 s while it
# keeps failing at once (a full model, a broken engine): a bounded retry, one error each.
REOPEN_DELAY_S = 0.5
REOPEN_DELAY_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """Where and how a session opens its live request (from `orch.capabilities()`)."""

    entry: str
    input_rate: int


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
        self._limit = input_limit_bytes
        self._queue: deque[np.ndarray] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._resampler: StreamingResampler | None = None
        self._overflowing = False
        self._request_id: str | None = None
        self._response_id: str | None = None
        self.opened = 0  # live requests opened (1 + reopens after failures)
        self.dropped_bytes = 0

    # --- input (event loop, no I/O) ------------------------------------------------------

    def push(self, effect: LiveAudio) -> None:
        if self._resampler is None or self._resampler.src_rate != effect.rate:
            self._resampler = StreamingResampler(effect.rate, self._entry.input_rate)
        samples = self._resampler.process(effect.samples)
        if not samples.size:
            return
        if self._queued_bytes + samples.nbytes > self._limit:
            self.dropped_bytes += samples.nbytes
            if not self._overflowing:
                self._overflowing = True
                self._apply(self._core.live_error(
                    "input_audio_overflow",
                    f"Input audio is arriving faster than the model takes it: more than {self._limit} "
                    "bytes are waiting; audio is dropped until it catches up. Send audio in real time.",
                    server=False,
                ))
            return
        self._overflowing = False
        self._queue.append(samples)
        self._queued_bytes += samples.nbytes
        self._wake.set()

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
        except AdmissionError as exc:
            self._apply(self._core.live_error("server_error", f"The model is at capacity: {exc}"))
            return None
        self.opened += 1
        self._request_id = handle.request_id
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
            self._request_id = None
            if status is None:  # we were cancelled (the session ends or leaves): stop the model
                await self._orch.cancel(handle.request_id)
            ended = "failed" if status is not None and status.status == "failed" else "cancelled"
            self._end_response(ended, None if status is None else status.error)
        if status is not None and status.status == "failed":
            log.warning("live request of %s failed: %s", self._core.session_id, status.error)
            self._apply(self._core.live_error("server_error", f"The model failed: {status.error}"))
        return status

    async def _pump(self, request_id: str) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                samples = self._queue.popleft()
                self._queued_bytes -= samples.nbytes
                if not await self._orch.append_input(request_id, AudioInput(samples, self._entry.input_rate)):
                    return

    # --- progress → core -----------------------------------------------------------------

    def _on_progress(self, out: object) -> None:
        core, now = self._core, self._now()
        if isinstance(out, ResponseStarted):
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

    def _end_response(self, status: str, error: str | None) -> None:
        rid, self._response_id = self._response_id, None
        if rid is not None:
            final = _STATUSES.get(status, "failed")
            self._apply(self._core.on_response_done(rid, final, error, now=self._now()))


_STATUSES: dict[str, Literal["completed", "failed", "cancelled", "incomplete"]] = {
    "completed": "completed", "failed": "failed", "cancelled": "cancelled", "incomplete": "incomplete",
}
