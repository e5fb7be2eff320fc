"""Flow control between stages: inbox limits, a downstream that ends first, per-edge max_ahead."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.payloads import AudioChunk, TextDelta
from tests.runtime.conftest import running
from tests.runtime.fakes import events

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def pipeline(
    *,
    gen_step: float = 0.0,
    relay_step: float = 0.0,
    sink_step: float = 0.0,
    gen_relay: str = "",
    relay_sink: str = "{first: 1, steady: 1, left_context: 0}",
) -> str:
    gen_relay_chunk = f", chunk: {gen_relay}" if gen_relay else ""
    return f"""
name: flow
entry: gen
stages:
  - {{name: gen, engine: fake.gen, options: {{tag: gen, step_s: {gen_step}}}}}
  - {{name: relay, engine: fake.relay, options: {{tag: relay, step_s: {relay_step}}}}}
  - {{name: sink, engine: fake.sink, options: {{tag: sink, step_s: {sink_step}}}}}
edges:
  - {{from: gen, to: relay, mode: async_chunk, connector: inproc{gen_relay_chunk}}}
  - {{from: relay, to: sink, mode: async_chunk, connector: inproc, chunk: {relay_sink}}}
"""


def texts(outputs: list[Any]) -> list[str]:
    return [o.text for o in outputs if isinstance(o, TextDelta)]


@pytest.mark.parametrize("early", ["relay", "sink"])
async def test_upstream_paused_by_the_inbox_resumes_when_its_downstream_finishes(early: str) -> None:
    """The downstream stage ends the request (its own limit) while its inbox holds the upstream
    at inbox_limit: the upstream must be woken and run to its end (its text is client-visible)."""
    slow = {"relay_step": 0.01} if early == "relay" else {"sink_step": 0.01}
    async with running(pipeline(**slow), inbox_limit=1) as orch:
        handle = await orch.submit({"n": 60, "take": {early: 5}})
        outputs, status = await asyncio.wait_for(handle.collect(), timeout=10)
        assert status.status == "completed", status
        assert texts(outputs) == [str(i) for i in range(60)]  # the upstream ran to its end
        heard = sum(len(o.samples) for o in outputs if isinstance(o, AudioChunk))
        assert 5 <= heard < 60  # the sink stopped early
        assert [e[3] for e in events("finish", handle.request_id)].count(True) == 0  # none cancelled
        assert orch.connectors["inproc"].health()["items"] == 0


async def test_items_for_a_finished_downstream_are_freed_at_once() -> None:
    """What an upstream produces after its downstream finished is released immediately, not
    kept in the connector until the request ends."""
    async with running(pipeline(gen_step=0.002, relay_step=0.005), inbox_limit=1) as orch:
        handle = await orch.submit({"n": 400, "take": {"relay": 3}})
        inproc = orch.connectors["inproc"]
        reader = asyncio.create_task(handle.collect())
        samples: list[int] = []
        while not reader.done():
            if any(e[1] == "relay" for e in events("finish", handle.request_id)):
                samples.append(inproc.health()["items"])
            await asyncio.sleep(0.005)
        _outputs, status = await reader
        assert status.status == "completed"
        assert len(samples) > 20  # the gen kept running long after the relay finished
        assert max(samples) <= 2  # instead of up to ~400 dropped hand-offs


def spy_ahead(orch: Any, source: str, target: str) -> list[int]:
    """For each step of ``source``: how many of its items ``target`` had not taken in when that
    step's result came back (not counting what the step produced). Credits only ever come back
    while a step runs, so this is at most what it was when the step was launched."""
    seen: list[int] = []
    original = orch.on_result

    def on_result(stage: str, request_id: str, result: Any) -> None:
        run = orch._runs.get(request_id)
        if stage == source and run is not None and (source, target) in run.edges_by_key:
            edge = run.edges_by_key[(source, target)]
            seen.append(edge.produced - edge.taken)
        original(stage, request_id, result)

    orch.on_result = on_result
    return seen


async def test_max_ahead_keeps_a_fast_upstream_within_its_credits() -> None:
    """gen steps in no time, relay takes 10 ms a step: with max_ahead 3 the gen never has more
    than 3 items the relay has not taken in (it does use them all: it still runs ahead); without
    it, the gen runs far ahead (up to inbox_limit chunks). Outputs are the same."""
    results = {}
    for max_ahead in (3, None):
        spec = pipeline(relay_step=0.01, gen_relay="{first: 1, steady: 1, left_context: 0}")
        if max_ahead is not None:
            spec = spec.replace(
                "connector: inproc, chunk: {first: 1",
                f"connector: inproc, max_ahead: {max_ahead}, chunk: {{first: 1",
                1,
            )
        async with running(spec) as orch:
            ahead = spy_ahead(orch, "gen", "relay")
            outputs, status = await (await orch.submit({"n": 40})).collect()
            assert status.status == "completed"
            results[max_ahead] = ([o.samples.tolist() for o in outputs if isinstance(o, AudioChunk)], ahead)
    limited, free = results[3], results[None]
    assert limited[0] == free[0]
    assert max(limited[1]) == 2  # stepped only with fewer than 3 outstanding, and up to that
    assert max(free[1]) > 10


@pytest.mark.parametrize("edge", ["gen->relay", "relay->sink"])
async def test_max_ahead_with_chunks_full_mode_and_an_early_downstream(edge: str) -> None:
    chunk = "{first: 4, steady: 5, left_context: 2}"
    spec = pipeline(relay_step=0.005, sink_step=0.005, gen_relay=chunk, relay_sink=chunk)
    source, target = edge.split("->")
    spec = spec.replace(
        f"from: {source}, to: {target}, mode: async_chunk, connector: inproc",
        f"from: {source}, to: {target}, mode: async_chunk, connector: inproc, max_ahead: 5",
    )
    async with running(spec) as orch:
        ahead = spy_ahead(orch, source, target)
        outputs, status = await asyncio.wait_for((await orch.submit({"n": 30})).collect(), 10)
        assert status.status == "completed" and texts(outputs) == [str(i) for i in range(30)]
        assert ahead and max(ahead) < 5
        audio = [o for o in outputs if isinstance(o, AudioChunk)]
        assert sum(len(o.samples) for o in audio) == 30
        # the same edge switched to full: no credits, no deadlock
        handle = await orch.submit({"n": 30}, edge_modes={edge: "full"})
        _out, status = await asyncio.wait_for(handle.collect(), 10)
        assert status.status == "completed"
        # the target ends the request early: the source is not held back by credits nobody returns
        handle = await orch.submit({"n": 30, "take": {target: 4}})
        outputs, status = await asyncio.wait_for(handle.collect(), 10)
        assert status.status == "completed" and texts(outputs) == [str(i) for i in range(30)]
        assert orch.connectors["inproc"].health()["items"] == 0


async def test_a_failure_applying_one_result_does_not_stop_the_stage() -> None:
    """A bug in handing one request's result on (here the orchestrator raising once) is logged;
    the replica goes on stepping, and the next request runs to its end."""
    async with running(pipeline()) as orch:
        original, raised = orch.on_result, []
        failed = asyncio.Event()

        def on_result(stage: str, request_id: str, result: Any) -> None:
            if not raised:
                raised.append(request_id)
                failed.set()
                raise RuntimeError("a bug")
            original(stage, request_id, result)

        orch.on_result = on_result
        first = await orch.submit({"n": 3})
        await asyncio.wait_for(failed.wait(), timeout=10)
        assert raised == [first.request_id]
        await orch.cancel(first.request_id)
        outputs, status = await asyncio.wait_for((await orch.submit({"n": 5})).collect(), timeout=10)
        assert status.status == "completed", status
        assert texts(outputs) == [str(i) for i in range(5)]


async def test_an_edge_inbox_limit_lets_the_upstream_run_on_while_a_slow_downstream_catches_up() -> None:
    """relay takes 30 ms a step; the orchestrator's inbox_limit (2) holds gen within two chunks
    of it, but an edge with its own `inbox_limit` lets gen go on (as the VAD scoring a session's
    turns goes on while its live ASR runs Whisper). Outputs are the same."""
    results = {}
    for limit in (None, 100):
        spec = pipeline(relay_step=0.03, gen_relay="{first: 1, steady: 1, left_context: 0}")
        if limit is not None:
            spec = spec.replace(
                "connector: inproc, chunk: {first: 1",
                f"connector: inproc, inbox_limit: {limit}, chunk: {{first: 1",
                1,
            )
        async with running(spec, inbox_limit=2) as orch:
            handle = await orch.submit({"n": 20})
            outputs, status = await handle.collect()
            assert status.status == "completed"
            rid = handle.request_id
            relay_steps = sorted(e[3] for e in events("step", rid) if e[1] == "relay")
            gen_before = sum(1 for e in events("step", rid) if e[1] == "gen" and e[3] < relay_steps[1])
            results[limit] = ([o.samples.tolist() for o in outputs if isinstance(o, AudioChunk)], gen_before)
    assert results[None][0] == results[100][0]
    assert results[None][1] <= 8  # held back by the relay's inbox
    assert results[100][1] == 20  # ran to its end before the relay's second step
