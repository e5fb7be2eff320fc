"""`VadBatcher`: VAD requests of many streams scored in rounds, one thread hop per round."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import session.vad_batcher as vb
from session.vad_batcher import VadBatcher


class CountingScorer:
    """Probability = frame index within the stream (so order is visible); records threads."""

    def __init__(self, fail: bool = False) -> None:
        self.seen = 0
        self.resets = 0
        self.fail = fail
        self.threads: set[int] = set()

    def reset(self) -> None:
        self.resets += 1
        self.seen = 0

    def speech_probs(self, frames16k: np.ndarray) -> list[float]:
        self.threads.add(threading.get_ident())
        if self.fail:
            raise RuntimeError("model failed")
        n = len(frames16k) // 512
        out = [float(self.seen + k) for k in range(n)]
        self.seen += n
        return out


def frames(n: int) -> np.ndarray:
    return np.zeros(512 * n, dtype=np.float32)


async def test_requests_of_many_streams_share_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds: list[int] = []
    real = vb._score_round

    def counted(requests: list[Any]) -> list[Any]:
        rounds.append(len(requests))
        return real(requests)

    monkeypatch.setattr(vb, "_score_round", counted)
    batcher = VadBatcher()
    scorers = [CountingScorer() for _ in range(32)]

    async def stream(scorer: CountingScorer) -> list[float]:
        out: list[float] = []
        for _ in range(5):  # like a driver: one request in flight per stream
            out += await batcher.score(scorer, frames(1))
        return out

    results = await asyncio.gather(*(stream(s) for s in scorers))
    assert all(r == [0.0, 1.0, 2.0, 3.0, 4.0] for r in results)
    assert sum(rounds) == 32 * 5
    assert len(rounds) <= 2 * 5  # rounds, not one hop per request
    assert all(threading.get_ident() not in s.threads for s in scorers)  # off the event loop


async def test_reset_and_failures_stay_with_their_stream() -> None:
    batcher = VadBatcher()
    good, bad = CountingScorer(), CountingScorer(fail=True)
    assert await batcher.score(good, frames(2)) == [0.0, 1.0]
    ok, failed = await asyncio.gather(
        batcher.score(good, frames(1), reset=True),
        batcher.score(bad, frames(1)),
        return_exceptions=True,
    )
    assert ok == [0.0] and good.resets == 1
    assert isinstance(failed, RuntimeError)
    assert await batcher.score(good, frames(1)) == [1.0]


async def test_a_cancelled_waiter_does_not_disturb_the_round() -> None:
    batcher = VadBatcher()
    a, b = CountingScorer(), CountingScorer()
    task_a = asyncio.create_task(batcher.score(a, frames(1)))
    task_b = asyncio.create_task(batcher.score(b, frames(1)))
    await asyncio.sleep(0)
    task_a.cancel()
    assert await task_b == [0.0]
    with pytest.raises(asyncio.CancelledError):
        await task_a


async def test_one_batcher_per_event_loop() -> None:
    assert VadBatcher.for_running_loop() is VadBatcher.for_running_loop()

    def other_loop() -> VadBatcher:
        async def get() -> VadBatcher:
            return VadBatcher.for_running_loop()

        return asyncio.run(get())

    assert await asyncio.to_thread(other_loop) is not VadBatcher.for_running_loop()
