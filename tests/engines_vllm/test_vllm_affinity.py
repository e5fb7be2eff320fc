"""KV affinity with the vLLM engine: two replicas (two engine processes); each session's later
turns go to the replica whose engine holds its prefix, and are served from that prefix cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.vllm.stages import VllmEngine
from runtime.orchestrator import Orchestrator
from runtime.registry import register_engine
from runtime.spec import parse_pipeline
from tests.tiny_lm import save_tiny_qwen3

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

PIPELINE = """
name: tiny-vllm-2
entry: lm
stages:
  - name: lm
    engine: test.vllm2
    options: {{model: "{model}", max_tokens: 2, poll_ms: 5}}
    budget: {{max_concurrency: 8, max_batch: 8, worker: thread, workers: 1}}
    replicas: 2
edges: []
"""


async def test_sessions_stay_on_the_replica_holding_their_prefix(tmp_path: Path) -> None:
    model = save_tiny_qwen3(tmp_path / "tiny_qwen3")
    register_engine("test.vllm2", VllmEngine)
    spec = parse_pipeline(PIPELINE.format(model=model), source="test")
    async with Orchestrator.from_spec(spec) as orch:
        engine = orch.stages["lm"].replicas[0].worker.host.engine  # type: ignore[attr-defined]
        words = {"a": "The quick brown fox jumps over the lazy dog.", "b": "You said hello there."}
        turn1 = {k: engine.tokenizer(" ".join([w] * 12))["input_ids"] for k, w in words.items()}

        async def turn(session: str, ids: list[int]) -> tuple[int, int]:
            """(replica, cached prompt tokens) of one turn."""
            handle = await orch.submit({"prompt_token_ids": ids}, session_key=session)
            before = orch.metrics.snapshot()["stages"]["lm"]["counters"].get("prompt_cached", 0)
            status = await handle.wait()
            assert status.status == "completed", status.error
            after = orch.metrics.snapshot()["stages"]["lm"]["counters"]["prompt_cached"]
            return status.timings["lm"].replica, after - before

        firsts = await asyncio.gather(turn("a", turn1["a"]), turn("b", turn1["b"]))
        replicas = {"a": firsts[0][0], "b": firsts[1][0]}
        assert set(replicas.values()) == {0, 1}  # the two sessions went to different replicas
        for session in ("a", "b"):
            ids = turn1[session] + engine.tokenizer(" and one more thing")["input_ids"]
            replica, cached = await turn(session, ids)
            assert replica == replicas[session]
            assert cached == len(turn1[session]) // 32 * 32 > 0  # its prefix, from that engine's cache
