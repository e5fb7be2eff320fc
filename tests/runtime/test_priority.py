"""Critical-path-first scheduling (runtime/priority.py): the policy alone, then through the
orchestrator (same outputs as per-stage scheduling, upstream calls really held)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.payloads import AudioChunk, TextDelta
from runtime.priority import CriticalPath, GatedWorker, Ticket
from runtime.spec import parse_pipeline
from runtime.worker import CallResult, Done, WorkCall, Worker, WorkItem
from tests.runtime.conftest import running

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CHAIN = """
name: chain
entry: gen
entries: {{transcribe: side}}
scheduling: {scheduling}
stages:
  - {{name: gen, engine: fake.gen, options: {{tag: gen, step_s: {gen_step}}}}}
  - {{name: relay, engine: fake.relay, options: {{tag: relay}}}}
  - {{name: sink, engine: fake.sink, options: {{tag: sink, step_s: {sink_step}}}}}
  - {{name: side, engine: fake.sink, options: {{tag: side}}}}
edges:
  - {{from: gen, to: relay, mode: async_chunk, connector: inproc}}
  - {{from: relay, to: sink, mode: async_chunk, connector: inproc,
     chunk: {{first: 4, steady: 8, left_context: 2}}}}
"""


def chain(scheduling: str = "critical_path", gen_step: float = 0.0, sink_step: float = 0.0) -> str:
    return CHAIN.format(scheduling=scheduling, gen_step=gen_step, sink_step=sink_step)


def policy() -> CriticalPath:
    return CriticalPath.of(parse_pipeline(chain()))


def call(stage: str, *requests: str) -> Ticket:
    return Ticket(stage, frozenset(requests))


def test_stage_graph_distances_come_from_the_spec() -> None:
    p = policy()
    assert p.downstream == {
        "gen": frozenset({"relay", "sink"}),
        "relay": frozenset({"sink"}),
        "sink": frozenset(),
        "side": frozenset(),
    }
    assert p.sinks == frozenset({"sink", "side"})


def test_an_upstream_call_waits_while_a_downstream_call_of_a_waiting_request_runs() -> None:
    p = policy()
    p.opened("r1")
    decoding = call("sink", "r1")
    assert p.ready(decoding)
    ahead, frame = call("gen", "r1"), call("relay", "r1")
    assert not p.ready(ahead)  # the gen would only run ahead of the sink's first chunk
    assert not p.ready(frame)
    assert p.parked == [ahead, frame]
    assert p.held == 2
    assert p.done(decoding) == [ahead, frame]  # in the order they came, both running now
    assert ahead.running and frame.running and p.parked == []


def test_a_downstream_call_never_waits_for_upstream_or_unrelated_stages() -> None:
    p = policy()
    p.opened("r1")
    p.opened("r2")
    assert p.ready(call("gen", "r1"))
    assert p.ready(call("relay", "r1"))
    assert p.ready(call("sink", "r2"))  # downstream of both running calls: not held
    assert p.ready(call("side", "r1"))  # no path between side and sink
    assert p.parked == []


def test_calls_of_requests_past_their_first_output_are_neither_held_nor_holding() -> None:
    p = policy()
    p.opened("r1")
    p.opened("r2")
    streaming = call("sink", "r1")
    assert p.ready(streaming)
    parked = call("gen", "r1")
    assert not p.ready(parked)
    assert p.output("relay", "r1") == []  # not a sink: the request still waits
    assert p.output("sink", "r1") == [parked]  # first output: what it held starts
    assert p.ready(call("gen", "r1"))  # steady streaming keeps the stages' overlap
    first = call("sink", "r2")
    assert p.ready(first)
    assert p.ready(call("gen", "r1"))  # only r1 in it: not critical, never held
    assert not p.ready(call("gen", "r1", "r2"))  # a batch with a waiting request is critical


def test_a_request_that_ends_releases_what_it_held() -> None:
    p = policy()
    p.opened("r1")
    p.opened("r2")
    assert p.ready(call("sink", "r1"))
    held = call("relay", "r2")
    assert not p.ready(held)
    assert p.closed("r1") == [held]  # cancelled: its sink call holds nothing any more
    assert p.closed("r1") == []
    assert p.waiting == {"r2"}


def test_a_closing_stage_drops_its_parked_calls() -> None:
    p = policy()
    p.opened("r1")
    assert p.ready(call("sink", "r1"))
    held = call("gen", "r1")
    assert not p.ready(held)
    assert p.drop("gen") == [held]
    assert p.parked == []


def _outputs(outputs: list[Any]) -> tuple[list[str], list[list[float]]]:
    texts = [o.text for o in outputs if isinstance(o, TextDelta)]
    audio = [o.samples.tolist() for o in outputs if isinstance(o, AudioChunk)]
    return texts, audio


async def _run(scheduling: str) -> tuple[list[tuple[list[str], list[list[float]]]], int]:
    # A slow sink: the gen is always ready again while a request's first chunk is decoded.
    async with running(chain(scheduling, gen_step=0.002, sink_step=0.03)) as orch:
        handles = [await orch.submit({"n": 40, "offset": 100 * i}) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(h.collect() for h in handles)), timeout=20)
        held = orch._critical.held if orch._critical is not None else 0
    outputs = []
    for outs, status in results:
        assert status.status == "completed", status
        outputs.append(_outputs(outs))
    return outputs, held


async def test_the_orchestrator_holds_upstream_calls_and_outputs_stay_the_same() -> None:
    per_stage, none_held = await _run("per_stage")
    critical, held = await _run("critical_path")
    assert none_held == 0
    assert held > 0  # upstream calls really waited for the sink's first chunks
    assert critical == per_stage
    for i, (texts, audio) in enumerate(critical):
        assert texts == [str(100 * i + k) for k in range(40)]
        assert sum(len(a) for a in audio) == 40


class _Recorder(Worker):
    """A worker that runs nothing: it records each call and keeps its done callback."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.pending: list[Done] = []

    async def open(self) -> None:
        pass

    def submit(self, call: WorkCall, done: Done) -> None:
        self.log.append(f"{self.name} runs {[i.request_id for i in call.items]}")
        self.pending.append(done)

    async def close(self) -> None:
        pass


def test_the_gated_worker_parks_calls_and_hands_them_over_after_the_replica_saw_the_result() -> None:
    p = policy()
    p.opened("r1")
    log: list[str] = []
    sink, gen = _Recorder("sink", log), _Recorder("gen", log)
    gated_sink, gated_gen = GatedWorker(sink, p, "sink"), GatedWorker(gen, p, "gen")
    gated_sink.submit(WorkCall(items=[WorkItem("r1")]), lambda _: log.append("sink result applied"))
    gated_gen.submit(WorkCall(items=[WorkItem("r1")]), lambda _: None)
    assert log == ["sink runs ['r1']"]  # the gen's call is parked, not handed to its worker
    sink.pending.pop()(CallResult())
    # the replica's callback (it may submit its next call) comes first, then the parked call
    assert log == ["sink runs ['r1']", "sink result applied", "gen runs ['r1']"]


async def test_a_parked_call_starts_after_the_downstream_calls_that_a_result_schedules() -> None:
    """The relay's frame ends and hands the sink its first chunk; the replica builds the sink's
    call in a callback of its own (Replica.wake). The gen's call parked behind the frame must not
    start before that call (it would run beside it), only after it ended."""
    p = policy()
    p.opened("r1")
    log: list[str] = []
    loop = asyncio.get_running_loop()
    workers = {name: _Recorder(name, log) for name in ("gen", "relay", "sink")}
    gated = {name: GatedWorker(w, p, name) for name, w in workers.items()}

    def frame_applied(_: object) -> None:
        log.append("relay result applied")
        loop.call_soon(gated["sink"].submit, WorkCall(items=[WorkItem("r1")]), lambda _: None)

    gated["relay"].submit(WorkCall(items=[WorkItem("r1")]), frame_applied)
    gated["gen"].submit(WorkCall(items=[WorkItem("r1")]), lambda _: None)
    assert log == ["relay runs ['r1']"]
    workers["relay"].pending.pop()(CallResult())
    for _ in range(3):
        await asyncio.sleep(0)
    assert log == ["relay runs ['r1']", "relay result applied", "sink runs ['r1']"]  # gen still parked
    workers["sink"].pending.pop()(CallResult())
    await asyncio.sleep(0)
    assert log[-1] == "gen runs ['r1']"


async def test_a_first_output_admits_nothing_before_the_sink_submitted_its_next_call() -> None:
    """The sink's call gives r1 its first output and the sink submits its next call (r2's first
    chunk) from the same result callback: the gen's call of r2, parked, keeps waiting for it."""
    p = policy()
    p.opened("r1")
    p.opened("r2")
    log: list[str] = []
    sink, gen = _Recorder("sink", log), _Recorder("gen", log)
    gated_sink, gated_gen = GatedWorker(sink, p, "sink"), GatedWorker(gen, p, "gen")

    def first_output(_: object) -> None:
        p.output("sink", "r1")  # what the orchestrator does on the sink's first audio of r1
        gated_sink.submit(WorkCall(items=[WorkItem("r2")]), lambda _: None)

    gated_sink.submit(WorkCall(items=[WorkItem("r1")]), first_output)
    gated_gen.submit(WorkCall(items=[WorkItem("r1"), WorkItem("r2")]), lambda _: None)
    sink.pending.pop()(CallResult())
    await asyncio.sleep(0)
    assert log == ["sink runs ['r1']", "sink runs ['r2']"]  # the gen's call still parked
    sink.pending.pop()(CallResult())
    await asyncio.sleep(0)
    assert log[-1] == "gen runs ['r1', 'r2']"
