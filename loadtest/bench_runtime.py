"""Orchestration overhead per chunk hop, with engines that do no compute.

Pipeline: source -> relay -> relay -> sink, every edge async_chunk 1/1/0 over the in-process
connector, thread workers. The source stamps each item with ``time.perf_counter()`` as its
step returns it; each downstream engine measures, when its step sees the item, how long the
hand-over took (worker thread -> event loop -> orchestrator -> edge -> replica -> worker thread),
then re-stamps and passes it on. That interval is the orchestration cost of one hop.

Two regimes: *paced* (the source emits one item every ``--interval-ms``, so hops do not queue
behind each other: pure per-hop latency) and *flood* (the source emits as fast as it can:
latency includes queueing, and the run gives the amortised cost per item-hop).

    .venv/bin/python -m loadtest.bench_runtime            # prints a Markdown table
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.metrics import percentile
from runtime.orchestrator import Orchestrator
from runtime.payloads import Action
from runtime.registry import register_engine
from runtime.spec import parse_pipeline

_lock = threading.Lock()
HOPS: list[float] = []


class BenchSource(Engine):
    def start(self, request: EngineRequest) -> Any:
        return {"left": int(request.params["items"]), "interval": float(request.params.get("interval_s", 0))}

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = []
        for inp in batch:
            state = inp.state
            if state["interval"]:
                time.sleep(state["interval"])
            state["left"] -= 1
            outputs.append(
                StepOutput(downstream=[Action("tick", time.perf_counter())], done=state["left"] <= 0)
            )
        return outputs


class BenchRelay(Engine):
    batchable = True

    def start(self, request: EngineRequest) -> Any:
        return None

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        now = time.perf_counter()
        outputs = []
        hops = []
        for inp in batch:
            out = StepOutput(done=inp.upstream_finished, wait_for_input=not inp.upstream_finished)
            for chunk in inp.chunks:
                for item in chunk.items:
                    assert isinstance(item, Action)
                    hops.append(now - float(item.value))
                    out.downstream.append(Action("tick", time.perf_counter()))
            outputs.append(out)
        with _lock:
            HOPS.extend(hops)
        return outputs


PIPELINE = """
name: bench-hops
entry: source
stages:
  - {name: source, engine: bench.source, budget: {max_concurrency: 64}}
  - {name: relay1, engine: bench.relay, budget: {max_concurrency: 64, max_batch: 64}}
  - {name: relay2, engine: bench.relay, budget: {max_concurrency: 64, max_batch: 64}}
  - {name: sink, engine: bench.relay, budget: {max_concurrency: 64, max_batch: 64}}
edges:
  - {from: source, to: relay1, mode: async_chunk, connector: inproc, chunk: {first: 1, steady: 1}}
  - {from: relay1, to: relay2, mode: async_chunk, connector: inproc, chunk: {first: 1, steady: 1}}
  - {from: relay2, to: sink, mode: async_chunk, connector: inproc, chunk: {first: 1, steady: 1}}
"""
HOPS_PER_ITEM = 3


async def run_case(orch: Orchestrator, concurrency: int, items: int, interval_s: float) -> dict[str, float]:
    with _lock:
        HOPS.clear()
    started = time.perf_counter()
    handles = [
        await orch.submit({"items": items, "interval_s": interval_s}) for _ in range(concurrency)
    ]
    statuses = await asyncio.gather(*(h.wait() for h in handles))
    elapsed = time.perf_counter() - started
    assert all(s.status == "completed" for s in statuses), [s.error for s in statuses]
    with _lock:
        hops = [h * 1e3 for h in HOPS]
    assert len(hops) == concurrency * items * HOPS_PER_ITEM, len(hops)
    return {
        "hops": len(hops),
        "median": percentile(hops, 50),
        "p99": percentile(hops, 99),
        "mean": statistics.fmean(hops),
        "throughput": len(hops) / elapsed,
    }


async def main_async(args: argparse.Namespace) -> list[tuple[str, int, dict[str, float]]]:
    register_engine("bench.source", BenchSource)
    register_engine("bench.relay", BenchRelay)
    rows = []
    async with Orchestrator(parse_pipeline(PIPELINE, source="bench_runtime.py"), stream_buffer=256) as orch:
        await run_case(orch, 1, 50, 0.0)  # warm-up: threads, caches
        for concurrency in args.concurrency:
            paced = await run_case(orch, concurrency, args.items, args.interval_ms / 1e3)
            rows.append((f"paced {args.interval_ms:g} ms", concurrency, paced))
        for concurrency in args.concurrency:
            flood = await run_case(orch, concurrency, args.items, 0.0)
            rows.append(("flood", concurrency, flood))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=200, help="items per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--interval-ms", type=float, default=2.0, help="source pacing in the paced regime")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print("| source | concurrency | item-hops | median ms/hop | p99 ms/hop | mean ms/hop | item-hops/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, concurrency, r in rows:
        print(
            f"| {label} | {concurrency} | {r['hops']:.0f} | {r['median']:.3f} | {r['p99']:.3f} | "
            f"{r['mean']:.3f} | {r['throughput']:.0f} |"
        )
    paced_c1 = next(r for label, c, r in rows if label.startswith("paced") and c == 1)
    verdict = "meets" if paced_c1["median"] <= 0.5 else "MISSES"
    median = paced_c1["median"]
    print(f"\nmedian per hop at concurrency 1 (paced): {median:.3f} ms, {verdict} the 0.5 ms target")


if __name__ == "__main__":
    main()
