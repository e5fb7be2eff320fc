from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from runtime.payloads import AudioChunk, TextDelta
from runtime.process_worker import ProcessWorker
from runtime.shm import SHM_DIR
from tests.runtime.conftest import running

# Layer: stages run in worker processes.
pytestmark = [pytest.mark.system, pytest.mark.timeout(60)]

PROCESS_PIPELINE = """
name: proc
entry: gen
stages:
  - {name: gen, engine: fake.gen, options: {tag: gen}}
  - {name: relay, engine: fake.relay, options: {tag: relay}, budget: {worker: process}}
  - {name: sink, engine: fake.sink, options: {tag: sink, step_s: SINK_STEP}, budget: {worker: process}}
edges:
  - {from: gen, to: relay, mode: async_chunk, connector: shm}
  - {from: relay, to: sink, mode: async_chunk, connector: shm,
     chunk: {first: 4, steady: 25, left_context: 25}}
"""


async def wait_for(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def segments(prefix: str) -> list[str]:
    return [p.name for p in Path(SHM_DIR).iterdir() if p.name.startswith(prefix)]


def expected_audio(n: int) -> np.ndarray:
    values = np.arange(n, dtype=np.float32)
    return values + 0.5 * np.concatenate([[0.0], values[:-1]]).astype(np.float32)


async def test_stages_in_worker_processes_over_shared_memory() -> None:
    async with running(PROCESS_PIPELINE.replace("SINK_STEP", "0.0")) as orch:
        shm = orch.connectors["shm"]
        prefix = shm.health()["prefix"]
        workers = [orch.stages[name].replicas[0].worker for name in ("relay", "sink")]
        assert all(isinstance(w, ProcessWorker) and w.pid not in (None, os.getpid()) for w in workers)
        handles = [await orch.submit({"n": 60 + i}) for i in range(3)]
        for i, handle in enumerate(handles):
            outputs, status = await handle.collect()
            assert status.status == "completed", status.error
            assert [o.text for o in outputs if isinstance(o, TextDelta)] == [str(v) for v in range(60 + i)]
            samples = np.concatenate([o.samples for o in outputs if isinstance(o, AudioChunk)])
            np.testing.assert_allclose(samples, expected_audio(60 + i))
        assert shm.health()["items"] == 0  # every hand-over released
        assert segments(prefix) == []
    assert segments(prefix) == []


async def test_killed_worker_process_fails_in_flight_requests_and_restarts() -> None:
    async with running(PROCESS_PIPELINE.replace("SINK_STEP", "0.02")) as orch:
        prefix = orch.connectors["shm"].health()["prefix"]
        replica = orch.stages["sink"].replicas[0]
        worker = replica.worker
        assert isinstance(worker, ProcessWorker)
        old_pid = worker.pid
        assert old_pid is not None
        victims = [await orch.submit({"n": 5000}) for _ in range(2)]
        first = await victims[0].__anext__()  # streaming is under way
        assert first is not None
        await asyncio.sleep(0.05)
        os.kill(old_pid, signal.SIGKILL)
        statuses = [await v.wait() for v in victims]
        for status in statuses:
            assert status.status == "failed"
            assert status.error == "stage sink worker process died (exit code -9)"
        # freed at failure; what steps in flight then produce is freed as soon as they return
        shm = orch.connectors["shm"]
        await wait_for(lambda: shm.health()["items"] == 0)
        # the replica comes back with a fresh process and serves again
        outputs, status = await (await orch.submit({"n": 30})).collect()
        assert status.status == "completed", status.error
        assert worker.pid not in (None, old_pid) and replica.restarts == 1
        np.testing.assert_allclose(
            np.concatenate([o.samples for o in outputs if isinstance(o, AudioChunk)]), expected_audio(30)
        )
        assert segments(prefix) == []  # the dead child's segments were swept
    assert segments(prefix) == []


async def test_idle_worker_death_fails_its_started_requests_and_restarts() -> None:
    async with running(PROCESS_PIPELINE.replace("SINK_STEP", "0.0")) as orch:
        replica = orch.stages["relay"].replicas[0]
        worker = replica.worker
        assert isinstance(worker, ProcessWorker)
        waiting = await orch.submit({"stream": True})  # relay is pre-warmed, then idle
        await asyncio.sleep(0.05)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        status = await waiting.wait()
        assert status.status == "failed"
        assert status.error == "stage relay worker process died (exit code -9)"
        status = await (await orch.submit({"n": 3})).wait()
        assert status.status == "completed" and replica.restarts == 1
