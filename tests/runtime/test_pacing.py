"""Engines that say when they next have work (`StepOutput.not_before`): the stage steps a
request only when it is due, batches the requests due together, and wakes on its own."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from runtime.payloads import AudioChunk
from runtime.progress import RequestStatus
from tests.runtime.conftest import running

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PACED = """
name: paced
entry: respond
stages:
  - name: respond
    engine: null.audio
    options: {delay_ms: 60, audio_ms: 400, chunk_ms: 40, realtime: true, tick_ms: 10}
    budget: {max_concurrency: 64, max_batch: 64, worker: thread, workers: 1}
edges: []
"""


async def _arrivals(handle: object) -> tuple[list[float], RequestStatus]:
    times: list[float] = []
    async for out in handle:  # type: ignore[attr-defined]
        if isinstance(out, RequestStatus):
            return times, out
        if isinstance(out, AudioChunk):
            times.append(time.monotonic())
    raise AssertionError("no final status")


async def test_paced_requests_are_stepped_only_when_due_and_in_real_time() -> None:
    async with running(PACED) as orch:
        t0 = time.monotonic()
        handles = []
        for _ in range(16):
            handles.append(await orch.submit({}))
            await asyncio.sleep(0.003)
        results = await asyncio.wait_for(asyncio.gather(*(_arrivals(h) for h in handles)), timeout=10)
    for times, status in results:
        assert status.status == "completed", status
        assert len(times) == 10  # 400 ms in 40 ms chunks
        # released in real time: the last chunk 60 + 9 * 40 ms after admission, not before
        assert times[-1] - times[0] >= 0.36 - 0.015
        assert float(np.median(np.diff(times))) == pytest.approx(0.04, abs=0.01)
        timing = status.timings["respond"]
        # one step per release (+ the start and reply), never a poll of a request not due
        assert timing.steps <= 10 + 3, timing
    assert time.monotonic() - t0 < 5


async def test_a_paced_request_alone_wakes_the_idle_scheduler() -> None:
    """Nothing else is running: only the stage's timer can step the request again."""
    async with running(PACED) as orch:
        handle = await orch.submit({})
        times, status = await asyncio.wait_for(_arrivals(handle), timeout=5)
    assert status.status == "completed" and len(times) == 10
    assert status.timings["respond"].steps <= 13


def test_timers_that_fire_early_do_not_strand_a_paced_request() -> None:
    """uvloop (the server's loop) fires timers up to a millisecond early: the scheduler then
    finds the request not yet due and must set a new timer, or it would never step again."""
    import uvloop

    async def alone() -> list[tuple[int, int]]:
        out = []
        async with running(PACED) as orch:
            for _ in range(4):
                handle = await orch.submit({})
                times, status = await asyncio.wait_for(_arrivals(handle), timeout=5)
                out.append((len(times), status.timings["respond"].steps))
        return out

    for chunks, steps in uvloop.run(alone()):
        assert chunks == 10 and steps <= 13 + 10  # an early wake-up costs at most one extra step
