"""Named pipeline entries (`entries:` in the YAML, `submit(entry=...)`) and the runtime's
capability query: a session's live request runs only the stages reachable from its entry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.payloads import Action, TextDelta
from runtime.registry import register_engine, unregister_engine
from runtime.spec import PipelineSpecError, parse_pipeline
from tests.runtime import fakes

pytestmark = pytest.mark.unit

PIPELINE = """
name: entries
entry: a
entries: {live: live, transcribe: t}
input_rate: 24000
stages:
  - {name: a, engine: fake.gen}
  - {name: b, engine: fake.relay}
  - {name: live, engine: fake.gen_vad}
  - {name: t, engine: fake.gen}
edges:
  - {from: a, to: b}
"""


class VadGen(fakes.Gen):
    """`fake.gen` that declares it provides voice activity (for the capability query)."""

    provides = frozenset({"voice_activity", "turn_detection"})


@pytest.fixture(autouse=True)
def vad_gen() -> Any:
    register_engine("fake.gen_vad", VadGen)
    yield
    unregister_engine("fake.gen_vad")


async def test_live_entry_runs_only_its_stages(orchestrator: Callable[..., Any]) -> None:
    async with orchestrator(PIPELINE) as orch:
        live = await orch.submit({"stream": True}, session_key="s1", entry="live")
        assert await orch.append_input(live.request_id, Action("emit", 7))
        assert await orch.append_input(live.request_id, Action("end"))
        payloads, status = await live.collect()
        assert status.status == "completed"
        assert [p.text for p in payloads if isinstance(p, TextDelta)] == ["7"]
        assert set(status.timings) == {"live"}  # stages a and b never saw it
        main = await orch.submit({"n": 2})
        _, status = await main.collect()
        assert set(status.timings) == {"a", "b"}


async def test_live_requests_do_not_count_against_pipeline_capacity(
    orchestrator: Callable[..., Any],
) -> None:
    text = PIPELINE.replace("input_rate: 24000", "input_rate: 24000\nmax_concurrency: 1")
    async with orchestrator(text) as orch:
        lives = [await orch.submit({"stream": True}, entry="live") for _ in range(3)]
        main = await orch.submit({"n": 1})  # still admitted: the live requests hold no main slot
        assert (await main.wait()).status == "completed"
        for live in lives:
            assert await orch.cancel(live.request_id)


async def test_unknown_entry_is_refused(orchestrator: Callable[..., Any]) -> None:
    async with orchestrator(PIPELINE) as orch:
        with pytest.raises(ValueError, match="unknown entry 'b'"):
            await orch.submit({}, entry="b")


async def test_capabilities_come_from_the_engines(orchestrator: Callable[..., Any]) -> None:
    async with orchestrator(PIPELINE) as orch:
        caps = orch.capabilities()
        assert caps.live_entry == "live" and caps.transcribe_entry == "t"
        assert caps.input_rate == 24000
        assert caps.voice_activity and caps.turn_detection
        assert not caps.live_responses and not caps.response_transcribes_input


def test_entry_stage_errors(tmp_path: Path) -> None:
    bad = PIPELINE.replace("live: live", "live: nope")
    with pytest.raises(PipelineSpecError, match=r"entries\.live: unknown stage 'nope'"):
        parse_pipeline(bad, known_engines={"fake.gen", "fake.relay", "fake.gen_vad"})
    orphan = PIPELINE.replace("entries: {live: live, transcribe: t}", "entries: {live: live}")
    with pytest.raises(PipelineSpecError, match="stage 't' is unreachable"):
        parse_pipeline(orphan, known_engines={"fake.gen", "fake.relay", "fake.gen_vad"})
