"""A replica's step cycle costs one loop iteration: the worker hands a call's outcome to the
loop as a callback of its own, which applies the results and submits the next call; no task
wakes up in between (on a loop busy with hundreds of sessions every such hand-off lasts tens
of milliseconds, and a paced stage's audio fell behind real time by their sum)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from runtime.worker import CallResult, Outcome, WorkCall, submit_on
from tests.runtime.conftest import running

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PIPELINE = """
name: cycle
entry: gen
stages:
  - {name: gen, engine: fake.gen, options: {tag: gen}}
edges: []
"""


async def test_results_are_applied_in_the_workers_callback_and_the_next_call_goes_out_there() -> None:
    async with running(PIPELINE) as orch:
        original = orch.on_result
        seen: list[tuple[asyncio.Task[Any] | None, int]] = []

        def on_result(stage: str, request_id: str, result: Any) -> None:
            seen.append((asyncio.current_task(), threading.get_ident()))
            original(stage, request_id, result)

        orch.on_result = on_result  # type: ignore[method-assign]
        handle = await orch.submit({"n": 20})
        outputs, status = await asyncio.wait_for(handle.collect(), timeout=10)
        assert status.status == "completed", status
        assert [o.text for o in outputs] == [str(i) for i in range(20)]
        assert len(seen) == 20
        # on the loop's thread, outside any task: straight from the worker's callback
        assert {task for task, _ in seen} == {None}
        assert {thread for _, thread in seen} == {threading.get_ident()}


async def test_submit_on_hands_the_result_or_the_error_to_the_loop() -> None:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1)
    got: asyncio.Queue[tuple[Outcome, int]] = asyncio.Queue()

    def done(outcome: Outcome) -> None:
        got.put_nowait((outcome, threading.get_ident()))

    def ok(call: WorkCall) -> CallResult:
        return CallResult(batch=7)

    def fails(call: WorkCall) -> CallResult:
        raise ValueError("engine bug")

    try:
        submit_on(executor, ok, WorkCall(), done)
        outcome, thread = await asyncio.wait_for(got.get(), timeout=5)
        assert isinstance(outcome, CallResult) and outcome.batch == 7
        assert thread == threading.get_ident()  # the loop's thread, not the executor's

        submit_on(executor, fails, WorkCall(), done)
        outcome, thread = await asyncio.wait_for(got.get(), timeout=5)
        assert isinstance(outcome, ValueError) and str(outcome) == "engine bug"
        assert thread == threading.get_ident()
    finally:
        executor.shutdown(wait=True)

    # a worker that is closing: the call never runs, and done() says so instead of hanging
    submit_on(executor, ok, WorkCall(), done)
    outcome, _ = await asyncio.wait_for(got.get(), timeout=5)
    assert isinstance(outcome, RuntimeError)
    assert loop.is_running()


async def test_a_call_in_flight_when_the_stage_closes_is_dropped_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The step running when the pipeline closes ends afterwards: its requests are gone by
    then, so its results are released, not handed to the closed orchestrator, and nothing is
    logged as an error."""
    slow = PIPELINE.replace("options: {tag: gen}", "options: {tag: gen, step_s: 0.2}")
    after_close: list[str] = []
    async with running(slow) as orch:
        original = orch.on_result
        closing = False

        def on_result(stage: str, request_id: str, result: Any) -> None:
            if closing:
                after_close.append(request_id)
            original(stage, request_id, result)

        orch.on_result = on_result  # type: ignore[method-assign]
        await orch.submit({"n": 5})
        await asyncio.sleep(0.05)  # its first step is running on the worker thread
        closing = True
    await asyncio.sleep(0.3)  # the step has ended by now: its outcome had nobody to go to
    assert after_close == []
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
