"""``budget.gather_ms``: a woken stage scheduler waits that long for more requests' input, so
inputs that arrive close together are stepped in one call (the VAD stage's frames of many
sessions), a request alone is not held, turn control is not held (a build waiting out its window
is brought forward), and the spec refuses a negative window."""

from __future__ import annotations

import asyncio

import pytest

from runtime.payloads import Action, TurnControl
from runtime.spec import PipelineSpecError, parse_pipeline
from tests.runtime import fakes
from tests.runtime.conftest import running
from tests.runtime.test_orchestrator import wait_for

pytestmark = pytest.mark.unit

PIPELINE = """
name: gather
entry: gen
stages:
  - {{name: gen, engine: fake.gen, options: {{tag: gen}}, budget: {{max_concurrency: 16}}}}
  - {{name: sink, engine: fake.sink, options: {{tag: sink}},
     budget: {{max_concurrency: 16, max_batch: 16, gather_ms: {gather_ms}}}}}
edges:
  - {{from: gen, to: sink, mode: async_chunk, connector: inproc}}
"""


def sink_batches() -> list[int]:
    return [e[2] for e in fakes.events("batch") if e[1] == "sink"]


async def _chunks(count: int) -> None:
    await wait_for(lambda: len(fakes.events("chunk")) >= count, within_s=10)


async def test_inputs_within_the_window_are_stepped_together() -> None:
    async with running(PIPELINE.format(gather_ms=500)) as orch:
        handles = [await orch.submit({"stream": True}) for _ in range(4)]
        for h in handles:  # each gen step hands one item to the sink, milliseconds apart
            assert await orch.append_input(h.request_id, Action("emit", 1))
        await _chunks(4)
        assert sink_batches() == [4]
        for h in handles:  # the next round: again one step for all four
            assert await orch.append_input(h.request_id, Action("emit", 2))
        await _chunks(8)
        assert sink_batches() == [4, 4]
        for h in handles:
            await orch.cancel(h.request_id)


async def test_without_a_window_the_first_input_is_stepped_at_once() -> None:
    async with running(PIPELINE.format(gather_ms=0)) as orch:
        first = await orch.submit({"stream": True})
        assert await orch.append_input(first.request_id, Action("emit", 1))
        await _chunks(1)
        assert sink_batches() == [1]
        await orch.cancel(first.request_id)


async def test_a_request_alone_is_not_held_for_the_window() -> None:
    """Nothing to gather with one request: stepped at once, not after the (60 s) window."""
    async with running(PIPELINE.format(gather_ms=60_000)) as orch:
        alone = await orch.submit({"stream": True})
        assert await orch.append_input(alone.request_id, Action("emit", 1))
        await _chunks(1)  # within 10 s
        assert sink_batches() == [1]
        await orch.cancel(alone.request_id)


ENTRY_GATHERS = """
name: gather-entry
entry: gen
stages:
  - {name: gen, engine: fake.gen, options: {tag: gen},
     budget: {max_concurrency: 16, max_batch: 16, gather_ms: 60000}}
"""


def gen_steps() -> int:
    return sum(1 for e in fakes.events("step") if e[1] == "gen")


async def test_turn_control_is_stepped_without_the_window() -> None:
    """Data waits out the (60 s) window for the other requests' input; turn control (a pause to
    score or transcribe, which a decision waits on) is stepped at once, and takes the waiting
    data with it."""
    async with running(ENTRY_GATHERS) as orch:
        a, b = [await orch.submit({"stream": True}) for _ in range(2)]
        await wait_for(lambda: gen_steps() >= 2, within_s=10)  # each request's first step
        before = gen_steps()
        assert await orch.append_input(a.request_id, Action("emit", 1))
        await asyncio.sleep(0.3)
        assert gen_steps() == before  # held for b's input
        assert await orch.append_input(b.request_id, TurnControl("score_turn", params={"ref": "r"}))
        await wait_for(lambda: gen_steps() >= before + 2, within_s=10)  # both, well before 60 s
        assert await orch.append_input(a.request_id, Action("emit", 2))
        await asyncio.sleep(0.3)
        assert gen_steps() == before + 2  # data waits for the window again
        for h in (a, b):
            await orch.cancel(h.request_id)


def test_a_negative_window_is_refused_with_its_field() -> None:
    with pytest.raises(PipelineSpecError, match=r"stages\[1\]\.budget\.gather_ms: must be >= 0"):
        parse_pipeline(PIPELINE.format(gather_ms=-5), source="test.yaml")
    assert parse_pipeline(PIPELINE.format(gather_ms=10)).stages[1].budget.gather_ms == 10
