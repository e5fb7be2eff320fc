"""Gated edges (`gated: true`, `Orchestrator.open_edge`): a branch only some requests need gets
nothing of a request that has not opened it (no items, no step), and what the upstream handed
the closed edge is freed at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runtime.payloads import Action, AudioChunk, TextDelta
from runtime.registry import register_engine, unregister_engine
from tests.runtime import fakes

pytestmark = pytest.mark.unit

PIPELINE = """
name: gated
entry: g
entries: {live: g}
stages:
  - {name: g, engine: fake.gen}
  - {name: always, engine: fake.sink, options: {tag: always}}
  - {name: turns, engine: fake.turn_sink, options: {tag: turns}}
edges:
  - {from: g, to: always}
  - {from: g, to: turns, gated: true}
"""


class TurnSink(fakes.Sink):
    """`fake.sink` that declares it provides end-of-turn scores (for the capability query)."""

    provides = frozenset({"end_of_turn"})


@pytest.fixture(autouse=True)
def turn_sink() -> Any:
    register_engine("fake.turn_sink", TurnSink)
    yield
    unregister_engine("fake.turn_sink")


def seen(tag: str, request_id: str) -> int:
    """Items the stage `tag` got in its steps for the request."""
    return sum(e[3] for e in fakes.events("chunk") if e[1] == tag and e[2] == request_id)


async def test_a_closed_gate_hands_nothing_over_and_an_open_one_everything(
    orchestrator: Callable[..., Any],
) -> None:
    async with orchestrator(PIPELINE) as orch:
        assert orch.capabilities().end_of_turn_gate == ("g", "turns")
        handle = await orch.submit({"stream": True}, entry="g")
        rid = handle.request_id
        it = aiter(handle)

        async def emitted(value: int) -> None:
            """`value` went through g (and so past the gate's decision) and reached `always`."""
            assert await orch.append_input(rid, Action("emit", value))
            got: set[str] = set()
            while got != {"text", "audio"}:
                out = await anext(it)
                if isinstance(out, TextDelta) and out.text == str(value):
                    got.add("text")
                elif isinstance(out, AudioChunk) and int(out.samples[-1]) >= value:
                    got.add("audio")

        await emitted(1)
        await emitted(2)
        assert seen("turns", rid) == 0 and seen("always", rid) == 2
        assert not [e for e in fakes.events("step", rid) if e[1] == "turns"]  # never stepped
        assert orch.open_edge(rid, "g", "turns")
        await emitted(3)
        await emitted(4)
        assert orch.open_edge(rid, "g", "turns", False)
        await emitted(5)
        assert orch.open_edge(rid, "g", "turns")
        assert await orch.append_input(rid, Action("emit", 6))
        assert await orch.append_input(rid, Action("end"))
        async for _ in it:
            pass
        assert handle.status is not None and handle.status.status == "completed"
        chunks = [e for e in fakes.events("chunk") if e[1] == "turns" and e[2] == rid and e[3]]
        assert seen("turns", rid) == 3 and seen("always", rid) == 6  # 3, 4 and 6
        assert len(chunks) == 3
        assert orch.connectors["inproc"].health()["items"] == 0  # the dropped ones were freed


async def test_open_edge_refuses_an_edge_that_is_not_gated(orchestrator: Callable[..., Any]) -> None:
    async with orchestrator(PIPELINE) as orch:
        handle = await orch.submit({"stream": True}, entry="g")
        with pytest.raises(ValueError, match="no gated edge g->always"):
            orch.open_edge(handle.request_id, "g", "always")
        assert await orch.cancel(handle.request_id)
        assert orch.open_edge(handle.request_id, "g", "turns") is False  # not live


async def test_no_gate_no_capability(orchestrator: Callable[..., Any]) -> None:
    async with orchestrator(PIPELINE.replace(", gated: true", "")) as orch:
        assert orch.capabilities().end_of_turn_gate is None
