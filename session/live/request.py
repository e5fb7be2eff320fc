"""A GPT-Live session's live request: its audio and conditioning in, the model's progress out.

One request on the pipeline's ``live`` entry for as long as the session is served here
(docs/CONTRACTS.md, "Live voice requests"): the session's input audio goes in as
``AudioInput`` at the pipeline's input rate (resampled once if that is not 24 kHz), text for
the model as ``Conditioning`` (``Orchestrator.update``), in order with the audio. What comes
back (``ResponseStarted`` / ``TextDelta`` / ``AudioChunk`` / ``ResponseDone``, ``Transcript``,
``Delegate``) goes to a :class:`ProgressSink` (the driver, which hands it to the core).

Bounds: audio queued here and not yet appended is at most ``max_queued_s`` seconds; past it
new audio is dropped and the sink hears ``overflow()`` (the driver turns that into one
``input_audio_overflow`` error a second at most). ``append_input`` itself waits while the
runtime holds 256 unconsumed inputs. A request that fails (a stage raised, a worker died) is
reported (``failed``) and opened again after a backoff, with everything the model has been told
as its first conditioning; other sessions' requests are untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from media.audio import StreamingResampler
from runtime.orchestrator import Orchestrator
from runtime.payloads import (
    AudioChunk,
    AudioInput,
    Conditioning,
    Delegate,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    Transcript,
)
from runtime.progress import RequestStatus

log = logging.getLogger(__name__)

REOPEN_DELAY_S = 0.5
REOPEN_DELAY_MAX_S = 10.0
IN_RATE = 24_000


class ProgressSink(Protocol):
    """Where a live request's progress goes (the driver)."""

    def speech_started(self) -> None: ...

    def model_text(self, text: str) -> None: ...

    def model_audio(self, samples: np.ndarray, rate: int) -> None: ...

    def speech_stopped(self) -> None: ...

    def input_transcript(self, text: str) -> None: ...

    def delegate(self, task: str) -> None: ...

    def failed(self, code: str, message: str) -> None: ...

    def overflow(self) -> None: ...


_Item = np.ndarray | Conditioning


class LivePipe:
    """The live request of one GPT-Live session (module docstring)."""

    def __init__(
        self,
        orch: Orchestrator,
        *,
        entry: str,
        input_rate: int,
        session_id: str,
        sink: ProgressSink,
        conditioning: Callable[[], dict[str, Any]],
        max_queued_s: float = 10.0,
    ) -> None:
        self._orch = orch
        self._entry = entry
        self._input_rate = input_rate
        self._session_id = session_id
        self._sink = sink
        self._conditioning = conditioning
        self._resampler = StreamingResampler(IN_RATE, input_rate) if input_rate != IN_RATE else None
        self.limit_bytes = int(max_queued_s * input_rate) * 4
        self._queue: deque[_Item] = deque()
        self.queued_bytes = 0
        self._wake = asyncio.Event()
        self.request_id: str | None = None
        self.opened = 0
        self.failures = 0
        self.dropped_bytes = 0

    # --- input (event loop, no I/O) ----------------------------------------------------------

    def push(self, samples: np.ndarray) -> None:
        """24 kHz float32 audio of one append."""
        if self._resampler is not None:
            samples = self._resampler.process(samples)
        if not samples.size:
            return
        if self.queued_bytes + samples.nbytes > self.limit_bytes:
            self.dropped_bytes += samples.nbytes
            self._sink.overflow()
            return
        self._queue.append(samples)
        self.queued_bytes += samples.nbytes
        self._wake.set()

    def condition(self, values: dict[str, Any]) -> None:
        """Text for the model, in order with the audio (small, never dropped: the core bounds it)."""
        self._queue.append(Conditioning(dict(values)))
        self._wake.set()

    # --- the request -------------------------------------------------------------------------

    async def run(self) -> None:
        """Open the request, pump input in and read progress; reopen it after a failure;
        cancel it when cancelled (the session ends or leaves this process)."""
        delay = REOPEN_DELAY_S
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            status = await self._serve_once()
            if status is not None and status.status == "completed":
                return
            if loop.time() - began > REOPEN_DELAY_MAX_S:
                delay = REOPEN_DELAY_S
            await asyncio.sleep(delay)
            delay = min(delay * 2, REOPEN_DELAY_MAX_S)

    async def _serve_once(self) -> RequestStatus | None:
        params: dict[str, Any] = {"live": True, "session_id": self._session_id}
        try:
            handle = await self._orch.submit(params, session_key=self._session_id, entry=self._entry)
        except Exception as exc:  # not admitted (the stage is full), or the orchestrator closing
            self.failures += 1
            self._sink.failed("server_error", f"The model is at capacity: {exc}")
            return None
        self.opened += 1
        self.request_id = handle.request_id
        if self.opened > 1:  # a reopened request starts with what the model was told
            self._queue.appendleft(Conditioning(self._conditioning()))
        pump = asyncio.create_task(self._pump(handle.request_id), name=f"{self._session_id}:live-pump")
        status: RequestStatus | None = None
        speaking = False
        try:
            async for out in handle:
                if isinstance(out, RequestStatus):
                    status = out
                    continue
                speaking = self._progress(out, speaking)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            self.request_id = None
            if speaking:
                self._sink.speech_stopped()
            if status is None:  # we were cancelled: stop the model
                await self._orch.cancel(handle.request_id)
        if status is not None and status.status == "failed":
            self.failures += 1
            log.warning("live request of %s failed: %s", self._session_id, status.error)
            self._sink.failed(
                "live_request_failed", f"The model failed on this session's input: {status.error}"
            )
        return status

    def _progress(self, out: object, speaking: bool) -> bool:
        sink = self._sink
        if isinstance(out, AudioChunk):
            sink.model_audio(np.asarray(out.samples, dtype=np.float32).reshape(-1), out.sample_rate)
        elif isinstance(out, TextDelta):
            sink.model_text(out.text)
        elif isinstance(out, ResponseStarted):
            if speaking:
                sink.speech_stopped()
            sink.speech_started()
            return True
        elif isinstance(out, ResponseDone):
            if speaking:
                sink.speech_stopped()
            return False
        elif isinstance(out, Transcript):
            sink.input_transcript(out.text)
        elif isinstance(out, Delegate):
            sink.delegate(out.task)
        return speaking

    async def _pump(self, request_id: str) -> None:
        orch = self._orch
        rate = self._input_rate
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                item = self._queue.popleft()
                if isinstance(item, Conditioning):
                    await orch.update(request_id, item)  # False: ended (the reader sees it)
                    continue
                self.queued_bytes -= item.nbytes
                if not await orch.append_input(request_id, AudioInput(item, rate)):
                    return
