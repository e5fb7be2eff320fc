"""VAD scoring for every session of an event loop, in rounds: one worker-thread hop per round.

Each session's driver scores its 32 ms frames as they arrive. Given a thread hop each, 32
sessions streaming in real time made ~1,000 hops a second, and the hand-offs (futures,
wake-ups, GIL traffic) cost the server more CPU than Silero itself (~0.1 ms a frame). Here a
round takes every request pending, scores them one after another in one worker thread, and
requests that arrive meanwhile form the next round: a few ms of added latency at most.

A driver has at most one request in flight (its VAD worker awaits each), so requests of one
stream never reorder. Nothing here knows the model: a scorer is any `VadScorer`.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class VadScorer(Protocol):
    """Speech probabilities of one audio stream (silero's `VadStream` fits)."""

    def reset(self) -> None: ...

    def speech_probs(self, frames16k: np.ndarray) -> list[float]: ...


@dataclass(slots=True)
class _Request:
    scorer: VadScorer
    samples: np.ndarray
    reset: bool
    future: asyncio.Future[list[float]]


def _score_round(requests: list[_Request]) -> list[list[float] | BaseException]:
    results: list[list[float] | BaseException] = []
    for r in requests:
        try:
            if r.reset:
                r.scorer.reset()
            results.append(r.scorer.speech_probs(r.samples))
        except Exception as exc:  # one stream's failure fails its request only
            results.append(exc)
    return results


class VadBatcher:
    """Scores requests of many streams in rounds (see the module docstring). Its drain task
    runs only while requests are pending; `for_running_loop()` gives the loop's instance."""

    def __init__(self) -> None:
        self._pending: list[_Request] = []
        self._drain: asyncio.Task[None] | None = None

    async def score(self, scorer: VadScorer, samples: np.ndarray, *, reset: bool = False) -> list[float]:
        """One probability per 512-sample frame of `samples`; `reset` the stream first."""
        future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(scorer, samples, reset, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run(), name="vad-batcher")
        return await future

    async def _run(self) -> None:
        batch: list[_Request] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                results = await asyncio.to_thread(_score_round, batch)
                for request, result in zip(batch, results, strict=True):
                    if request.future.done():  # its driver went away meanwhile
                        continue
                    if isinstance(result, BaseException):
                        request.future.set_exception(result)
                    else:
                        request.future.set_result(result)
                batch = []
        finally:
            for request in [*batch, *self._pending]:  # only when cancelled (loop shutdown)
                request.future.cancel()

    @classmethod
    def for_running_loop(cls) -> VadBatcher:
        """The batcher shared by every session on the running event loop."""
        loop = asyncio.get_running_loop()
        batcher = _BY_LOOP.get(loop)
        if batcher is None:
            batcher = _BY_LOOP[loop] = cls()
        return batcher


# One per event loop (tests run several servers, each on its own loop); gone with the loop.
_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, VadBatcher] = weakref.WeakKeyDictionary()
