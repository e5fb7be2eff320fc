"""Memory of the tiny Qwen3-Omni pipeline: RSS over many sequential requests (issue 2 target:
no growth over 200 sequential requests).

    .venv/bin/python -m loadtest.bench_rss --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource

import psutil

from runtime.orchestrator import Orchestrator


async def _run(requests: int, tokens: int, frames: int) -> list[tuple[int, float]]:
    proc = psutil.Process()
    samples: list[tuple[int, float]] = []
    async with Orchestrator.from_pipeline("qwen3-omni-tiny") as orch:
        for i in range(1, requests + 1):
            params = {
                "text": f"request {i}",
                "max_tokens": tokens,
                "min_tokens": tokens,
                "max_frames": frames,
                "min_frames": frames,
                "greedy": True,
                "seed": 0,
            }
            handle = await orch.submit(params)
            status = await handle.wait()
            if status.status != "completed":
                raise SystemExit(f"request {i}: {status.status} {status.error}")
            if i in (1, 10, 20) or i % 50 == 0:
                gc.collect()
                samples.append((i, proc.memory_info().rss / 2**20))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--frames", type=int, default=30)
    args = parser.parse_args(argv)
    samples = asyncio.run(_run(args.requests, args.tokens, args.frames))
    print("| after request | RSS (MiB) |\n|---:|---:|")
    for i, rss in samples:
        print(f"| {i} | {rss:.1f} |")
    base = next(rss for i, rss in samples if i == 20)
    print(
        f"\ngrowth from request 20 to {samples[-1][0]}: {samples[-1][1] - base:+.1f} MiB; "
        f"peak RSS {psutil.Process().memory_info().rss / 2**20:.1f} MiB "
        f"(ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
