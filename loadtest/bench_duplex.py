"""duplex-tiny frame loop benchmark: N sessions in one process, each streaming real-time audio.

Runs the ``duplex-tiny`` pipeline in this process (the orchestrator and its stage worker
thread, no HTTP): N sessions each open the live request and append one 80 ms frame of 24 kHz
audio every 80 ms (random start phases, like N microphones), for ``--seconds``. The engine
streams every frame's audio (``stream_silence``) and never inserts silence frames (a long
``idle_grace_ms``), so each user frame has exactly one model frame to time.

Measured per N:
- **frame step**: wall time of each engine step (``MetricsHook.on_step``) that carried a
  session's frame: p50/p99 over the steps, with the batch sizes the stage formed, and the cost
  per session-frame (step time / batch);
- **real time**: whether the frame loop keeps up (p99 step < 80 ms) — the largest N that does;
- **frame in → frame out**: from ``append_input`` of user frame *f* to the arrival of the model
  frame produced by the step that consumed it (the model's acoustic delay adds one frame of
  *model* latency on top, not counted here: it is a property of Moshi's token layout).

With ``--engine-only`` it times ``DuplexEngine.step`` alone on one thread for batches of N
frames (no event loop, no orchestrator): the model's own cost, to tell it from the host's.

    python -m loadtest.bench_duplex --sessions 1 4 8 --seconds 10
    python -m loadtest.bench_duplex --sessions 1 4 8 12 16 24 --seconds 10 --out duplex.json
    python -m loadtest.bench_duplex --engine-only --sessions 1 4 8 16 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest.stats import summarize
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioChunk, AudioInput
from runtime.spec import load_pipeline

FRAME = 1920
RATE = 24000
FRAME_S = FRAME / RATE


@dataclass
class StepLog:
    """A metrics hook: one (batch, ms) per engine step of the duplex stage."""

    steps: list[tuple[int, float]] = field(default_factory=list)

    def on_step(self, stage: str, replica: int, batch: int, step_s: float) -> None:
        self.steps.append((batch, step_s * 1e3))

    def on_request(self, stage: str, seconds: float, outcome: str) -> None:
        pass

    def on_queue(self, stage: str, replica: int, depth: int) -> None:
        pass


async def one_session(orch: Orchestrator, index: int, seconds: float, latencies: list[float]) -> int:
    handle = await orch.submit({"seed": index}, session_key=f"bench-{index}", entry="duplex")
    sent: list[float] = []
    audio = (np.random.default_rng(index).standard_normal(FRAME) * 0.1).astype(np.float32)

    async def read() -> None:
        received = 0
        async for out in handle:
            if isinstance(out, AudioChunk):
                # chunk j comes from the step that consumed user frame j + 1 (acoustic delay 1)
                if received + 1 < len(sent):
                    latencies.append((time.perf_counter() - sent[received + 1]) * 1e3)
                received += 1

    reader = asyncio.create_task(read())
    await asyncio.sleep(random.uniform(0, FRAME_S))
    start = time.perf_counter()
    frames = int(seconds / FRAME_S)
    for f in range(frames):
        await asyncio.sleep(max(0.0, start + f * FRAME_S - time.perf_counter()))
        sent.append(time.perf_counter())
        await orch.append_input(handle.request_id, AudioInput(audio, RATE))
    await orch.append_input(handle.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
    async with asyncio.timeout(60 + seconds):
        await reader
    return frames


async def run(sessions: int, seconds: float, threads: int) -> dict[str, Any]:
    spec = load_pipeline("duplex-tiny")
    stage = spec.stages[0]
    # No silence frames (idle_grace 60 s): every model frame then answers exactly one user
    # frame, which is what the in → out pairing below counts on.
    options = {**stage.options, "stream_silence": True, "threads": threads, "idle_grace_ms": 60_000,
               "max_sessions": max(sessions, int(stage.options.get("max_sessions", 64)))}
    spec = spec.with_stage(stage.engine, options=options)
    log = StepLog()
    orch = Orchestrator.from_spec(spec)
    orch.metrics.add_hook(log)
    await orch.start()
    latencies: list[float] = []
    try:
        frames = await asyncio.gather(*(one_session(orch, i, seconds, latencies) for i in range(sessions)))
    finally:
        await orch.close()
    warm = log.steps[len(log.steps) // 10 :]  # drop the first 10 % (warm-up)
    step_ms = [ms for _, ms in warm]
    per_session = [ms / b for b, ms in warm if b]
    batches = [b for b, _ in warm]
    step = summarize(step_ms)
    return {
        "sessions": sessions, "seconds": seconds, "frames_sent": sum(frames), "steps": len(warm),
        "batch": {
            "mean": round(float(np.mean(batches)), 2) if batches else 0, "max": max(batches, default=0)
        },
        "step_ms": step, "per_session_frame_ms": summarize(per_session),
        "frame_in_to_out_ms": summarize(latencies[len(latencies) // 10 :]),
        "real_time": bool(step["n"]) and (step["p99"] or 0) < FRAME_S * 1e3,
    }


def engine_only(sessions: int, steps: int = 60) -> dict[str, Any]:
    """Step N sessions' frames together `steps` times; the step's wall time."""
    from engines.duplex.stages import DuplexEngine
    from runtime.engine import EngineRequest, StepInput

    options = dict(load_pipeline("duplex-tiny").stages[0].options)
    engine = DuplexEngine({**options, "stream_silence": True, "threads": 1, "max_sessions": sessions})
    engine.load()
    states = [engine.start(EngineRequest(f"r{i}", {"seed": i})) for i in range(sessions)]
    frame = (np.random.default_rng(0).standard_normal(FRAME) * 0.1).astype(np.float32)
    times, cpu = [], []
    for k in range(steps + 5):
        began, began_cpu = time.perf_counter(), time.thread_time()
        engine.step([StepInput(s, inputs=[AudioInput(frame, RATE)]) for s in states])
        if k >= 5:  # warm-up
            times.append((time.perf_counter() - began) * 1e3)
            cpu.append((time.thread_time() - began_cpu) * 1e3)
    return {
        "sessions": sessions, "step_ms": summarize(times), "step_cpu_ms": summarize(cpu),
        "per_session_frame_ms": summarize([t / sessions for t in times]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the stage worker")
    parser.add_argument("--engine-only", action="store_true", help="time DuplexEngine.step alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.engine_only:
        for n in args.sessions:
            r = engine_only(n)
            s, c = r["step_ms"], r["step_cpu_ms"]
            print(f"engine only N={n:3d} | step wall p50={s['p50']} p99={s['p99']} ms | "
                  f"step CPU p50={c['p50']} p99={c['p99']} ms | "
                  f"per session-frame wall p50={r['per_session_frame_ms']['p50']} ms", flush=True)
        return
    results = []
    for n in args.sessions:
        result = asyncio.run(run(n, args.seconds, args.threads))
        results.append(result)
        s, lat = result["step_ms"], result["frame_in_to_out_ms"]
        print(
            f"N={n:3d} steps={result['steps']:5d} batch mean={result['batch']['mean']:5.2f} "
            f"max={result['batch']['max']:3d} | step p50={s['p50']} p99={s['p99']} ms | "
            f"per session-frame p50={result['per_session_frame_ms']['p50']} ms | "
            f"frame in→out p50={lat['p50']} p99={lat['p99']} ms | real time: {result['real_time']}",
            flush=True,
        )
    realtime = [r["sessions"] for r in results if r["real_time"]]
    print(f"largest N with p99 step < 80 ms: {max(realtime) if realtime else 'none'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
