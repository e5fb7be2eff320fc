"""The vLLM stage engine through the orchestrator, with a real vLLM engine process (``.venv-vllm``)
serving a tiny random ``Qwen3ForCausalLM`` saved at test time.

One engine process serves the whole module (it takes ~30 s to start on two cores); the fault
test kills its engine core last and checks that the stage restarts it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from engines.vllm.client import VllmUnavailable, vllm_python
from engines.vllm.stages import VllmEngine
from runtime.orchestrator import Orchestrator
from runtime.payloads import TextDelta
from runtime.registry import register_engine
from runtime.spec import parse_pipeline
from tests.tiny_lm import save_tiny_qwen3

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

PIPELINE = """
name: tiny-vllm
entry: lm
stages:
  - name: lm
    engine: test.vllm
    options: {{model: "{model}", max_tokens: 8, poll_ms: 5}}
    budget: {{max_concurrency: 16, max_batch: 16, worker: thread, workers: 1, kv_bytes: 1073741824}}
edges: []
"""


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    """The vLLM interpreter; its absence fails every test here (never a skip) but not collection.

    ``make test`` builds ``.venv-vllm``; a bare checkout gets the message that says how.
    """
    try:
        return Path(vllm_python())
    except VllmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def orch(vllm_venv: Path, tiny_qwen3: Path) -> AsyncIterator[Orchestrator]:
    register_engine("test.vllm", VllmEngine)
    spec = parse_pipeline(PIPELINE.format(model=tiny_qwen3), source="test")
    async with Orchestrator.from_spec(spec) as orch:
        yield orch


def engine_of(orch: Orchestrator) -> VllmEngine:
    engine = orch.stages["lm"].replicas[0].worker.host.engine  # type: ignore[attr-defined]
    assert isinstance(engine, VllmEngine)
    return engine


async def generate(orch: Orchestrator, params: dict, **kw: object) -> tuple[str, object]:
    handle = await orch.submit(params, **kw)  # type: ignore[arg-type]
    outputs, status = await handle.collect()
    return "".join(p.text for p in outputs if isinstance(p, TextDelta)), status


@pytest.mark.asyncio(loop_scope="module")
async def test_streams_greedy_tokens_matching_transformers(orch: Orchestrator, tiny_qwen3: Path) -> None:
    import torch
    import transformers

    engine = engine_of(orch)
    prompt = engine.tokenizer("The quick brown fox")["input_ids"]
    params = {"prompt_token_ids": prompt, "ignore_eos": True, "max_tokens": 8}
    results = await asyncio.gather(*(generate(orch, dict(params)) for _ in range(8)))
    assert all(status.status == "completed" for _, status in results), [s.error for _, s in results]  # type: ignore[attr-defined]
    texts = {text for text, _ in results}
    assert len(texts) == 1  # eight requests batched together, the same greedy continuation
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected_ids = out[0, len(prompt) :].tolist()
    assert len(expected_ids) == 8
    assert texts.pop() == engine.tokenizer.decode(expected_ids, skip_special_tokens=True)
    batches = orch.metrics.snapshot()["stages"]["lm"]["batch"]
    assert batches["max"] > 1  # the stage stepped several requests at once


@pytest.mark.asyncio(loop_scope="module")
async def test_prefix_cache_prefills_only_the_new_turn(orch: Orchestrator) -> None:
    engine = engine_of(orch)
    turn1 = engine.tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 10))["input_ids"]
    turn2 = turn1 + engine.tokenizer(" You said hello there.")["input_ids"]
    before = dict(orch.metrics.snapshot()["stages"]["lm"]["counters"])
    _, status = await generate(orch, {"prompt_token_ids": turn1, "max_tokens": 2}, session_key="s")
    assert status.status == "completed"  # type: ignore[attr-defined]
    mid = dict(orch.metrics.snapshot()["stages"]["lm"]["counters"])
    _, status = await generate(orch, {"prompt_token_ids": turn2, "max_tokens": 2}, session_key="s")
    assert status.status == "completed"  # type: ignore[attr-defined]
    after = orch.metrics.snapshot()["stages"]["lm"]["counters"]
    assert mid["prompt"] - before.get("prompt", 0) == len(turn1)
    assert after["prompt"] - mid["prompt"] == len(turn2)
    cached2 = after["prompt_cached"] - mid["prompt_cached"]
    block = 32  # whole KV blocks are shared: all of turn 1's full blocks
    assert cached2 == len(turn1) // block * block and cached2 > 0
    # prefilled: the new turn plus at most the partial block turn 1 ended in
    assert len(turn2) - cached2 < len(turn2) - len(turn1) + block


@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_stops_generation_within_a_step(orch: Orchestrator) -> None:
    engine = engine_of(orch)
    prompt = engine.tokenizer("The quick brown fox")["input_ids"]
    handle = await orch.submit({"prompt_token_ids": prompt, "ignore_eos": True, "max_tokens": 400})
    seen = 0
    async for out in handle:
        if isinstance(out, TextDelta):
            seen += 1
            if seen == 2:
                t0 = time.monotonic()
                assert await orch.cancel(handle.request_id)
        elif getattr(out, "status", None):
            assert out.status == "cancelled"  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 2.0
    # the engine process goes on serving
    _, status = await generate(orch, {"prompt_token_ids": prompt, "max_tokens": 3})
    assert status.status == "completed"  # type: ignore[attr-defined]


@pytest.mark.asyncio(loop_scope="module")
async def test_prompt_longer_than_context_fails_with_context_length_exceeded(orch: Orchestrator) -> None:
    _, status = await generate(orch, {"prompt_token_ids": [5] * 600, "max_tokens": 2})
    assert status.status == "failed"  # type: ignore[attr-defined]
    assert "context_length_exceeded" in (status.error or "")  # type: ignore[attr-defined]
    _, status = await generate(orch, {"prompt_token_ids": [5] * 10, "max_tokens": 2})
    assert status.status == "completed"  # type: ignore[attr-defined]


def _engine_core_pid(engine: VllmEngine) -> int:
    process = engine.process
    assert process is not None
    for pid in process.core_pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except FileNotFoundError:
            continue
        if b"EngineCore" in title:
            return pid
    raise AssertionError(f"no EngineCore among {process.core_pids}")


@pytest.mark.asyncio(loop_scope="module")
async def test_kill_engine_core_fails_in_flight_then_restarts(orch: Orchestrator) -> None:
    engine = engine_of(orch)
    prompt = engine.tokenizer("The quick brown fox")["input_ids"]
    params = {"prompt_token_ids": prompt, "ignore_eos": True, "max_tokens": 400}
    handles = [await orch.submit(dict(params), session_key=f"k{i}") for i in range(3)]
    for handle in handles:  # every request is generating
        async for out in handle:
            if isinstance(out, TextDelta):
                break
    old_pid = engine.process.pid  # type: ignore[union-attr]
    os.kill(_engine_core_pid(engine), signal.SIGKILL)
    statuses = await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handles)), 60)
    for status in statuses:
        assert status.status == "failed"
        assert "vLLM engine core died" in (status.error or "") or "killed by signal" in (status.error or "")
        assert "restarts its vLLM engine" in (status.error or "")
    deadline = time.monotonic() + 300
    while True:  # a new request waits for the new engine process, then succeeds
        text, status = await generate(orch, {"prompt_token_ids": prompt, "max_tokens": 4, "ignore_eos": True})
        if status.status == "completed":  # type: ignore[attr-defined]
            break
        assert time.monotonic() < deadline, status.error  # type: ignore[attr-defined]
    assert text
    assert engine.restarts == 1 and engine.process is not None and engine.process.pid != old_pid
