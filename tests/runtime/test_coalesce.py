"""A coalescing edge (`EdgeSpec.coalesce`): a consumer stuck in a long step never stalls its
producer; what arrives meanwhile joins one held chunk, given whole at the consumer's next step.

The consumer here blocks its first step on an event the test sets, so nothing depends on
timing: the test waits for states (the producer done, the producer paused), never for durations.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from runtime.connectors import Handle
from runtime.engine import StepInput, StepOutput
from runtime.payloads import AudioChunk, TextDelta
from runtime.spec import PipelineSpecError, parse_pipeline
from runtime.worker import ChunkRef
from tests.runtime.conftest import running
from tests.runtime.fakes import Relay, events

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

RELEASE = threading.Event()  # the held relay's first step returns once this is set


class HeldRelay(Relay):
    """`fake.relay` whose first step of each request waits for :data:`RELEASE` (a Whisper run
    that takes as long as the test wants)."""

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        for inp in batch:
            if not inp.state.get("held"):
                inp.state["held"] = True
                RELEASE.wait(20)
        return super().step(batch)


def pipeline(edge: str) -> str:
    return f"""
name: coalesce
entry: gen
stages:
  - {{name: gen, engine: fake.gen, options: {{tag: gen}}}}
  - {{name: relay, engine: "tests.runtime.test_coalesce:HeldRelay", options: {{tag: relay}}}}
  - {{name: sink, engine: fake.sink, options: {{tag: sink}}}}
edges:
  - {{from: gen, to: relay, mode: async_chunk, connector: inproc,
     chunk: {{first: 1, steady: 1, left_context: 0}}{edge}}}
  - {{from: relay, to: sink, mode: async_chunk, connector: inproc,
     chunk: {{first: 1, steady: 1, left_context: 0}}}}
"""


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a state (the test's own timeout bounds it)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the state never came")


def relay_steps(request_id: str) -> int:
    return sum(1 for e in events("step", request_id) if e[1] == "relay")


@pytest.fixture(autouse=True)
def _held() -> Any:
    RELEASE.clear()
    yield
    RELEASE.set()  # never leave a worker thread waiting


async def test_a_slow_consumer_on_a_coalescing_edge_does_not_stall_its_producer() -> None:
    n = 100
    async with running(pipeline(", coalesce: true")) as orch:
        handle = await orch.submit({"n": n})
        rid = handle.request_id
        relay = orch.stages["relay"].replicas[0]
        reader = asyncio.create_task(handle.collect())
        # The relay is stuck in its first step; the gen runs to its end all the same.
        await until(lambda: "gen" not in orch._runs[rid].pending)
        taken = orch._runs[rid].edges_by_key[("gen", "relay")].taken  # into the stuck step
        held = relay.held_items(rid, "gen")
        assert held >= 1 and taken + held == n  # everything after the stuck step's input ...
        assert relay.inbox_size(rid) == 1  # ... coalesced into one chunk
        RELEASE.set()
        outputs, status = await reader
    assert status.status == "completed"
    assert [o.text for o in outputs if isinstance(o, TextDelta)] == [str(i) for i in range(n)]
    heard = [s for o in outputs if isinstance(o, AudioChunk) for s in o.samples.tolist()]
    assert heard == [float(i) for i in range(n)]  # every item reached the sink, in order
    assert relay_steps(rid) == 2  # the stuck step, then everything held in one step


async def test_without_coalescing_the_same_consumer_stalls_the_producer_at_its_inbox_limit() -> None:
    async with running(pipeline(""), inbox_limit=8) as orch:
        handle = await orch.submit({"n": 100})
        rid = handle.request_id
        relay = orch.stages["relay"].replicas[0]
        reader = asyncio.create_task(handle.collect())
        await until(lambda: relay.inbox_size(rid) >= 8)
        assert not orch.can_step("gen", rid)  # paused: the chunks the relay holds
        assert "gen" in orch._runs[rid].pending
        RELEASE.set()
        _outputs, status = await reader
    assert status.status == "completed"


async def test_a_coalescing_edge_bounds_what_it_holds_by_its_inbox_limit_in_items() -> None:
    async with running(pipeline(", coalesce: true, inbox_limit: 10")) as orch:
        handle = await orch.submit({"n": 100})
        rid = handle.request_id
        relay = orch.stages["relay"].replicas[0]
        reader = asyncio.create_task(handle.collect())
        await until(lambda: relay.held_items(rid, "gen") >= 10)
        assert not orch.can_step("gen", rid)  # the last resort: a consumer that never steps
        assert relay.inbox_size(rid) == 1
        RELEASE.set()
        outputs, status = await reader
    assert status.status == "completed"
    assert [o.text for o in outputs if isinstance(o, TextDelta)] == [str(i) for i in range(100)]


def test_absorb_keeps_the_order_the_first_context_and_both_releases() -> None:
    def h(key: str) -> Handle:
        return Handle("inproc", "r", key)

    first = ChunkRef([h("a")], context=[h("z")], index=3, source="gen", release=[h("z")])
    first.absorb(ChunkRef([h("b"), h("c")], context=[h("a")], index=4, source="gen", release=[h("a")]))
    first.absorb(ChunkRef([], finished=True, index=5, source="gen", release=[h("b"), h("c")]))
    assert [x.key for x in first.items] == ["a", "b", "c"]
    assert [x.key for x in first.context] == ["z"] and first.index == 3 and first.finished
    assert [x.key for x in first.release] == ["z", "a", "b", "c"]


@pytest.mark.parametrize(
    ("edge", "message"),
    [
        ("mode: full, coalesce: true", "only for mode async_chunk"),
        ("mode: async_chunk, max_ahead: 4, coalesce: true", "not with max_ahead"),
    ],
)
def test_coalesce_is_only_for_an_async_chunk_edge_without_credits(edge: str, message: str) -> None:
    text = f"""
name: bad
stages: [{{name: a, engine: fake.gen}}, {{name: b, engine: fake.sink}}]
edges: [{{from: a, to: b, {edge}}}]
"""
    with pytest.raises(PipelineSpecError, match=message):
        parse_pipeline(text, known_engines={"fake.gen", "fake.sink"})


def test_an_edge_switched_to_full_stops_coalescing() -> None:
    spec = parse_pipeline(pipeline(", coalesce: true"), known_engines={"fake.gen", "fake.sink"})
    assert spec.edges[0].coalesce
    assert not spec.with_edge_modes({"gen->relay": "full"}).edges[0].coalesce
