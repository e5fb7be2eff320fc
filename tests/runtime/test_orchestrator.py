from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from runtime.orchestrator import Orchestrator
from runtime.payloads import Action, AudioChunk, Conditioning, TextDelta
from runtime.progress import AdmissionError, RequestStatus
from runtime.spec import parse_pipeline
from tests.runtime.conftest import running
from tests.runtime.fakes import events

pytestmark = [pytest.mark.system, pytest.mark.timeout(30)]


def three_stage(chunk: str = "{first: 4, steady: 25, left_context: 25}", *, gen_step: float = 0.0,
                sink_batch: int = 1, sink_step: float = 0.0, gen_conc: int = 16) -> str:
    return f"""
name: three
entry: gen
stages:
  - {{name: gen, engine: fake.gen, options: {{tag: gen, step_s: {gen_step}}},
     budget: {{max_concurrency: {gen_conc}}}}}
  - {{name: relay, engine: fake.relay, options: {{tag: relay}}}}
  - {{name: sink, engine: fake.sink, options: {{tag: sink, step_s: {sink_step}}},
     budget: {{max_batch: {sink_batch}}}}}
edges:
  - {{from: gen, to: relay, mode: async_chunk, connector: inproc}}
  - {{from: relay, to: sink, mode: async_chunk, connector: inproc, chunk: {chunk}}}
"""


def audio(outputs: list[Any]) -> np.ndarray:
    return np.concatenate([o.samples for o in outputs if isinstance(o, AudioChunk)])


def texts(outputs: list[Any]) -> list[str]:
    return [o.text for o in outputs if isinstance(o, TextDelta)]


async def wait_for(predicate: Any, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


def expected_audio(n: int) -> np.ndarray:
    values = np.arange(n, dtype=np.float32)
    previous = np.concatenate([[0.0], values[:-1]]).astype(np.float32)
    return values + 0.5 * previous


async def test_stream_yields_only_client_payloads_then_status() -> None:
    async with running(three_stage()) as orch:
        handle = await orch.submit({"n": 60})
        items = [x async for x in handle]
        status = items[-1]
        assert isinstance(status, RequestStatus) and status.status == "completed" and status.error is None
        outputs = items[:-1]
        assert all(isinstance(o, TextDelta | AudioChunk) for o in outputs)  # no CodecCodes hand-offs
        assert texts(outputs) == [str(i) for i in range(60)]
        np.testing.assert_allclose(audio(outputs), expected_audio(60))
        assert set(status.timings) == {"gen", "relay", "sink"}
        for timing in status.timings.values():
            assert timing.started_ms is not None and timing.first_output_ms is not None
            assert timing.done_ms is not None and timing.steps > 0
        assert status.timings["gen"].first_output_ms <= status.timings["sink"].first_output_ms
        assert status.total_ms >= status.timings["sink"].done_ms - 1e-6
        # chunk policy 4/25/25 as delivered to the sink engine
        chunks = [(e[3], e[4], e[5]) for e in events("chunk", handle.request_id)]
        assert chunks == [(4, 0, False), (25, 4, False), (25, 25, False), (6, 25, True)]
        assert orch.connectors["inproc"].health()["items"] == 0  # everything released on the way
        assert await handle.wait() is status


async def test_async_chunk_and_full_give_same_outputs() -> None:
    async with running(three_stage()) as orch:
        results = {}
        for label, modes in {
            "async": None,
            "full_tail": {"relay->sink": "full"},
            "full_all": {"gen->relay": "full", "relay->sink": "full"},
        }.items():
            outputs, status = await (await orch.submit({"n": 103}, edge_modes=modes)).collect()
            assert status.status == "completed"
            results[label] = (texts(outputs), audio(outputs))
        for label in ("full_tail", "full_all"):
            assert results[label][0] == results["async"][0]
            np.testing.assert_array_equal(results[label][1], results["async"][1])
        np.testing.assert_allclose(results["async"][1], expected_audio(103))


async def test_left_context_matters_for_the_decode() -> None:
    # the same pipeline without left context decodes chunk starts without their history
    async with running(three_stage("{first: 4, steady: 25, left_context: 0}")) as orch:
        outputs, _ = await (await orch.submit({"n": 30})).collect()
        assert not np.allclose(audio(outputs), expected_audio(30))


async def test_async_chunk_prewarms_and_full_starts_at_first_input() -> None:
    async with running(three_stage(gen_step=0.01)) as orch:
        h1 = await orch.submit({"n": 5})
        await h1.wait()
        h2 = await orch.submit({"n": 5}, edge_modes={"relay->sink": "full"})
        await h2.wait()
    for handle, prewarmed in ((h1, True), (h2, False)):
        sink_start = events("start", handle.request_id)
        sink_start_t = next(e[3] for e in sink_start if e[1] == "sink")
        gen_steps = [e[3] for e in events("step", handle.request_id) if e[1] == "gen"]
        if prewarmed:
            assert sink_start_t < gen_steps[-1]  # started at admission, before gen finished
        else:
            assert sink_start_t > gen_steps[-1]  # started only when the full payload arrived


async def test_cancel_mid_stream_stops_every_stage_and_frees_connector_data() -> None:
    async with running(three_stage(gen_step=0.002)) as orch:
        freed: list[int] = []
        connector = orch.connectors["inproc"]
        original = connector.cleanup

        def spy(request_id: str) -> int:
            count = original(request_id)
            freed.append(count)
            return count

        connector.cleanup = spy  # type: ignore[method-assign]
        handle = await orch.submit({"n": 100000})
        seen = 0
        async for out in handle:
            if isinstance(out, AudioChunk):
                seen += 1
                if seen == 2:
                    break
        assert connector.health()["items"] > 0  # left context (25 codec items) is held
        await wait_for(lambda: handle.buffered > 0)  # output queued, unread
        assert await orch.cancel(handle.request_id) is True
        unread, status = await handle.collect()
        assert unread == [] and status.status == "cancelled"  # queued output does not outlive a cancel
        assert sum(freed) >= 25
        # what a step in flight at the cancel produces is freed as soon as that step returns
        await wait_for(lambda: connector.health()["items"] == 0)
        assert connector.health() == {"kind": "inproc", "ok": True, "requests": 0, "items": 0}
        steps_at_cancel = len(events("step", handle.request_id))
        await wait_for(lambda: len(events("finish", handle.request_id)) == 3)
        await asyncio.sleep(0.05)
        assert len(events("step", handle.request_id)) <= steps_at_cancel + 3  # at most the in-flight step
        finishes = {e[1]: e[3] for e in events("finish", handle.request_id)}
        assert finishes == {"gen": True, "relay": True, "sink": True}
        assert await orch.cancel(handle.request_id) is False  # finished now
        assert orch.live_requests == []


async def test_cancel_unknown_or_finished_returns_false() -> None:
    async with running(three_stage()) as orch:
        assert await orch.cancel("nope") is False
        handle = await orch.submit({"n": 3})
        assert (await handle.wait()).status == "completed"
        assert await orch.cancel(handle.request_id) is False
        assert await orch.append_input(handle.request_id, Action("emit", 1)) is False
        assert await orch.update(handle.request_id, Conditioning({"v": 1})) is False


async def test_append_input_changes_a_live_request_output() -> None:
    async with running(three_stage("{first: 1, steady: 1, left_context: 1}")) as orch:
        handle = await orch.submit({"stream": True})
        for value in (7, 8):
            assert await orch.append_input(handle.request_id, Action("emit", value))
        first = await handle.__anext__()
        assert isinstance(first, TextDelta) and first.text == "7"
        assert await orch.append_input(handle.request_id, Action("emit", 42))
        assert await orch.append_input(handle.request_id, Action("end"))
        outputs, status = await handle.collect()
        assert status.status == "completed"
        assert texts([first, *outputs]) == ["7", "8", "42"]
        np.testing.assert_allclose(audio(outputs), [7, 8 + 3.5, 42 + 4])


async def test_update_reaches_every_stage() -> None:
    async with running(three_stage()) as orch:
        handle = await orch.submit({"stream": True})
        assert await orch.update(handle.request_id, Conditioning({"v": 5, "offset": 100}))
        await orch.append_input(handle.request_id, Action("emit", 1))
        got: list[str] = []
        async for out in handle:
            if isinstance(out, TextDelta) and out.text.startswith("update@"):
                got.append(out.text)
            if len(got) == 3:
                break
        assert sorted(got) == ["update@gen:5", "update@relay:5", "update@sink:5"]
        await orch.cancel(handle.request_id)


async def test_engine_exception_fails_only_that_request() -> None:
    async with running(three_stage(gen_step=0.001)) as orch:
        bad = await orch.submit({"n": 50, "fail_at": 10})
        good = await orch.submit({"n": 50})
        bad_status, good_status = await asyncio.gather(bad.wait(), good.wait())
        assert bad_status.status == "failed"
        assert bad_status.error == "stage gen: engine.step failed: ValueError: boom at item 10"
        assert good_status.status == "completed"
        after = await (await orch.submit({"n": 5})).wait()
        assert after.status == "completed"  # the stage keeps serving
        assert {e[1] for e in events("finish", bad.request_id)} == {"gen", "relay", "sink"}
        assert orch.connectors["inproc"].health()["items"] == 0


async def test_batched_engine_isolates_the_failing_request() -> None:
    pipeline = three_stage("{first: 1, steady: 1, left_context: 0}", sink_batch=4, sink_step=0.01)
    async with running(pipeline) as orch:
        handles = [
            await orch.submit({"n": 20, "offset": 1000 * i, "sink_fail_value": 2005 if i == 2 else None})
            for i in range(4)
        ]
        statuses = [await h.wait() for h in handles]
        assert [s.status for s in statuses] == ["completed", "completed", "failed", "completed"]
        assert "poisoned value 2005" in (statuses[2].error or "")
        assert max(e[2] for e in events("batch") if e[1] == "sink") > 1  # it really batched
        snapshot = orch.metrics.snapshot()["stages"]["sink"]
        assert snapshot["batch"]["max"] > 1 and snapshot["requests"]["failed"] == 1


async def test_admission_limit_is_a_clear_error() -> None:
    async with running(three_stage(gen_conc=2)) as orch:
        a = await orch.submit({"stream": True})
        await orch.submit({"stream": True})
        full = r"pipeline three is full: 2 live requests \(max_concurrency 2\)"
        with pytest.raises(AdmissionError, match=full):
            await orch.submit({"stream": True})
        await orch.cancel(a.request_id)
        c = await orch.submit({"n": 1})  # room again
        assert (await c.wait()).status == "completed"


async def test_duplicate_request_id_and_bad_edge_mode_rejected() -> None:
    async with running(three_stage()) as orch:
        await orch.submit({"stream": True}, request_id="r1")
        with pytest.raises(ValueError, match="already live"):
            await orch.submit({"n": 1}, request_id="r1")
        with pytest.raises(ValueError, match="unknown edge"):
            await orch.submit({"n": 1}, edge_modes={"gen->sink": "full"})
        assert orch.live_requests == ["r1"]


async def test_client_stream_backpressure_pauses_the_request() -> None:
    async with running(three_stage(), stream_buffer=8) as orch:
        handle = await orch.submit({"n": 100000})
        await wait_for(lambda: handle.buffered >= 8)
        await asyncio.sleep(0.1)
        steps = len(events("step", handle.request_id))
        await asyncio.sleep(0.1)
        assert len(events("step", handle.request_id)) == steps  # paused, not running ahead
        assert handle.buffered < 8 + 10  # the bound plus what the last steps produced, not 100000
        for _ in range(40):  # the consumer reads again: the request resumes
            await handle.__anext__()
        await wait_for(lambda: len(events("step", handle.request_id)) > steps)
        assert handle.buffered < 8 + 10
        assert await orch.cancel(handle.request_id)


async def test_replica_stickiness_by_session_key() -> None:
    pipeline = """
name: sessions
stages:
  - {name: chat, engine: fake.session, replicas: 2}
"""
    async with running(pipeline) as orch:
        async def turn(key: str) -> tuple[str, int]:
            outputs, status = await (await orch.submit({}, session_key=key)).collect()
            return texts(outputs)[0], status.timings["chat"].replica

        holder = await orch.submit({"stream": True}, session_key="busy")  # SessionCounter finishes at once
        await holder.wait()
        a1 = await turn("alice")
        b1 = await turn("bob")
        a2 = await turn("alice")
        b2 = await turn("bob")
        a3 = await turn("alice")
        assert a1[1] == a2[1] == a3[1] and b1[1] == b2[1]
        # the replica kept each session's state: turn counters continue per session
        turns = [a1[0][:5], a2[0][:5], a3[0][:5], b1[0][:5], b2[0][:5]]
        assert turns == ["turn1", "turn2", "turn3", "turn1", "turn2"]
        assert a1[0].split("@")[1] == a3[0].split("@")[1]  # same worker thread


async def test_new_keys_go_to_the_least_loaded_replica() -> None:
    pipeline = """
name: spread
stages:
  - {name: gen, engine: fake.gen, replicas: 3}
"""
    async with running(pipeline) as orch:
        handles = [await orch.submit({"stream": True}, session_key=f"s{i}") for i in range(3)]
        replicas = [orch.stages["gen"].replica_for(f"s{i}") for i in range(3)]
        assert sorted(replicas) == [0, 1, 2]  # type: ignore[type-var]
        again = await orch.submit({"stream": True}, session_key="s1")
        assert orch.stages["gen"].replica_for("s1") == replicas[1]
        for h in [*handles, again]:
            await orch.cancel(h.request_id)
            assert (await h.wait()).status == "cancelled"


async def test_start_failure_and_metrics_snapshot() -> None:
    bad = "name: bad\nstages:\n  - {name: x, engine: fake.explode}\n"
    orch = Orchestrator.from_spec(parse_pipeline(bad))
    with pytest.raises(RuntimeError, match="cannot load weights"):
        await orch.start()
    with pytest.raises(RuntimeError, match="not running"):
        await orch.submit({})
    async with running(three_stage()) as good:
        await (await good.submit({"n": 10})).wait()
        snap = good.metrics.snapshot()["stages"]
        assert set(snap) == {"gen", "relay", "sink"}
        assert snap["gen"]["steps"] == 10 and snap["gen"]["requests"]["completed"] == 1
        assert snap["sink"]["step_ms"]["p50"] >= 0 and snap["sink"]["queue_depth"] == 0
        health = good.health()
        assert health["live"] == 0 and health["stages"]["gen"][0]["ready"] is True


async def test_append_input_waits_while_the_entry_stage_lags() -> None:
    async with running(three_stage(gen_step=0.05), input_limit=3) as orch:
        handle = await orch.submit({"stream": True})

        async def produce() -> None:
            for value in range(12):
                assert await orch.append_input(handle.request_id, Action("emit", value))
            assert await orch.append_input(handle.request_id, Action("end"))

        producer = asyncio.create_task(produce())
        await asyncio.sleep(0.06)
        assert not producer.done()  # 13 inputs cannot all be queued: the producer waits
        assert len(orch.stages["gen"].replicas[0]._slots[handle.request_id].inputs) <= 3
        outputs, status = await handle.collect()
        await producer
        assert status.status == "completed"
        assert texts(outputs) == [str(v) for v in range(12)]


async def test_cancel_releases_a_waiting_append_input() -> None:
    async with running(three_stage(gen_step=0.05), input_limit=1) as orch:
        handle = await orch.submit({"stream": True})
        await orch.append_input(handle.request_id, Action("emit", 1))
        await orch.append_input(handle.request_id, Action("emit", 2))
        blocked = asyncio.create_task(orch.append_input(handle.request_id, Action("emit", 3)))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await orch.cancel(handle.request_id)
        assert await blocked is False  # the request ended while the producer waited
        assert (await handle.wait()).status == "cancelled"


async def test_workers_budget_runs_steps_of_different_requests_concurrently() -> None:
    pipeline = """
name: parallel
stages:
  - {name: gen, engine: fake.gen, options: {tag: gen, step_s: 0.1}, budget: {workers: 2}}
"""
    async with running(pipeline) as orch:
        handles = [await orch.submit({"n": 1}) for _ in range(2)]
        assert [(await h.wait()).status for h in handles] == ["completed", "completed"]
        first, second = (events("step", h.request_id)[0][3] for h in handles)
        assert abs(first - second) < 0.08  # both 100 ms steps ran at the same time
