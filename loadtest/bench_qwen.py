"""Time to first audio and real-time factor of the tiny Qwen3-Omni pipeline on this CPU.

Every request gets the same fixed reply (thinker ``--tokens`` tokens, talker ``--frames`` codec
frames: min = max, greedy), so runs compare. For each concurrency it submits that many requests at
once and measures, per request, submit → first ``AudioChunk`` out of the orchestrator (TTFA) and
submit → completion; once with the pipeline's async_chunk edges and once with every edge ``full``.

Each level runs ``--waves`` waves with async_chunk edges (``--c1-reps`` at concurrency 1) and its
TTFA median is the median of the waves' medians (at concurrency 1, of the waves' one request
each, as before); ``ttfa_ms_wave_medians`` lists them in order, so the first is what a single
wave gives. One wave of 8 moved by 1.5x between two waves of the same code on a shared 2-core
host, while concurrency 1 always took the median of three. ``full`` runs one wave per level
(``--c1-reps`` at 1): its TTFA is the whole reply, and it only sets the async / full ratio.
The async waves run in rounds, one wave of every level a round, with the floor's samples spread
over the same rounds, each round's right before its c1 wave (:func:`schedule`): levels compared
with each other are measured over the same stretch of the host's time, not one after another.
Five waves a level by default (and five floor samples: one a round), since three let one slow
spell of the host's decide a ratio (docs/benchmarks.md, issue 31 ninth round).

The critical-path floor is the engine time on the path to the first audio chunk, measured in
isolation (engines driven directly, one thread, the orchestrator idle between waves): thinker
start + prefill, the talker prefill and the 4 talker steps of the first chunk (with the thinker
steps they need, interleaved), and code2wav of that chunk.

    .venv/bin/python -m loadtest.bench_qwen --out bench_qwen.json

``--max-ahead N`` (``0``: no credit limit) overrides the thinker→talker edge's ``max_ahead``,
``--inbox-limit`` the orchestrator's inbox limit and ``--num-threads`` torch's intra-op threads,
to compare flow-control settings on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engines.qwen3_omni.stages import Code2WavEngine, TalkerEngine, ThinkerEngine
from loadtest.report import publish
from runtime.engine import EdgeChunk, EngineRequest, StepInput
from runtime.heap_trim import HeapTrimmer
from runtime.orchestrator import DEFAULT_INBOX_LIMIT, Orchestrator
from runtime.payloads import AudioChunk, Payload
from runtime.progress import RequestStatus
from runtime.spec import PipelineSpec, load_pipeline

PIPELINE = "qwen3-omni-tiny"
FULL_EDGES = {"thinker->talker": "full", "talker->code2wav": "full"}
SAMPLE_RATE = 24_000
FRAME_S = 0.08  # 12.5 codec frames per second


@dataclass(slots=True)
class RequestTiming:
    ttfa_ms: float
    total_ms: float
    audio_s: float

    @property
    def rtf(self) -> float:
        return (self.total_ms / 1e3) / self.audio_s if self.audio_s > 0 else float("inf")


def fixed_params(tokens: int, frames: int, index: int) -> dict[str, Any]:
    return {
        "text": f"Please tell me a story about request number {index}.",
        "greedy": True,
        "seed": 0,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "max_frames": frames,
        "min_frames": frames,
    }


async def one_request(
    orch: Orchestrator, params: Mapping[str, Any], modes: Mapping[str, str] | None
) -> RequestTiming:
    t0 = time.perf_counter()
    handle = await orch.submit(params, edge_modes=modes)
    first: float | None = None
    samples = 0
    status: RequestStatus | None = None
    async for out in handle:
        if isinstance(out, AudioChunk):
            if first is None:
                first = time.perf_counter()
            samples += out.samples.size
        elif isinstance(out, RequestStatus):
            status = out
    done = time.perf_counter()
    if status is None or status.status != "completed" or first is None:
        raise RuntimeError(f"request did not complete with audio: {status}")
    return RequestTiming((first - t0) * 1e3, (done - t0) * 1e3, samples / SAMPLE_RATE)


async def wave(
    orch: Orchestrator, concurrency: int, tokens: int, frames: int, modes: Mapping[str, str] | None
) -> list[RequestTiming]:
    return list(
        await asyncio.gather(
            *(one_request(orch, fixed_params(tokens, frames, i), modes) for i in range(concurrency))
        )
    )


class FloorProbe:
    """Engine time to the first audio chunk, engines driven directly on the calling thread
    (no orchestrator): one :meth:`sample` is one request's path, so samples can be taken
    between the waves they are compared with."""

    def __init__(self, tokens: int, frames: int, stage_options: Mapping[str, Any] | None = None) -> None:
        options: dict[str, Any] = {"model": "tiny", "seed": 0}
        if stage_options and "num_threads" in stage_options:
            options["num_threads"] = stage_options["num_threads"]
        self.engines = (ThinkerEngine(options), TalkerEngine(options), Code2WavEngine(options))
        for engine in self.engines:
            engine.load()
        self.tokens, self.frames = tokens, frames
        self.first_chunk = load_pipeline(PIPELINE).edges[1].chunk.first
        self.totals: list[float] = []
        self.parts: dict[str, list[float]] = {"thinker": [], "talker": [], "code2wav": []}
        self._taken = 0
        self.sample(keep=False)  # warm-up

    def sample(self, keep: bool = True) -> None:
        thinker, talker, code2wav = self.engines
        request = EngineRequest(f"floor{self._taken}", fixed_params(self.tokens, self.frames, 0))
        self._taken += 1
        spent = {"thinker": 0.0, "talker": 0.0, "code2wav": 0.0}
        t = time.perf_counter()
        t_state = thinker.start(request)
        k_state = talker.start(request)
        c_state = code2wav.start(request)
        spent["thinker"] += time.perf_counter() - t
        pending: list[Payload] = []
        codes: list[Payload] = []
        while len(codes) < self.first_chunk:
            t = time.perf_counter()
            out = thinker.step([StepInput(state=t_state)])[0]
            spent["thinker"] += time.perf_counter() - t
            pending.extend(out.downstream)
            while len(codes) < self.first_chunk:
                t = time.perf_counter()
                chunks = [EdgeChunk(items=pending)] if pending else []
                pending = []
                k_out = talker.step([StepInput(state=k_state, chunks=chunks)])[0]
                spent["talker"] += time.perf_counter() - t
                codes.extend(k_out.downstream)
                if k_out.wait_for_input:
                    break
        t = time.perf_counter()
        code2wav.step([StepInput(state=c_state, chunks=[EdgeChunk(items=codes[: self.first_chunk])])])
        spent["code2wav"] += time.perf_counter() - t
        if keep:
            self.totals.append(sum(spent.values()) * 1e3)
            for name, seconds in spent.items():
                self.parts[name].append(seconds * 1e3)
        for engine, state in zip(self.engines, (t_state, k_state, c_state), strict=True):
            engine.finish(state, cancelled=True)

    def figures(self) -> dict[str, float]:
        floor = {"floor_ms": statistics.median(self.totals)}
        floor.update({f"{name}_ms": statistics.median(v) for name, v in self.parts.items()})
        return floor


def summarize(timings: Sequence[RequestTiming]) -> dict[str, Any]:
    ttfa = [t.ttfa_ms for t in timings]
    return {
        "ttfa_ms_median": statistics.median(ttfa),
        "ttfa_ms_max": max(ttfa),
        "total_ms_median": statistics.median(t.total_ms for t in timings),
        "rtf": [round(t.rtf, 4) for t in timings],
        "rtf_max": max(t.rtf for t in timings),
        "audio_s": timings[0].audio_s,
        "requests": [asdict(t) for t in timings],
    }


def summarize_waves(waves: Sequence[Sequence[RequestTiming]]) -> dict[str, Any]:
    """One level's figures over its waves: the TTFA median is the median of the waves' medians
    (with one request per wave, the median of all, as :func:`summarize` gives); max, RTF and
    totals over every request of every wave."""
    if not waves or not all(waves):
        raise ValueError("summarize_waves: every wave needs at least one request")
    row = summarize([t for w in waves for t in w])
    wave_medians = [statistics.median(t.ttfa_ms for t in w) for w in waves]
    row["ttfa_ms_median"] = statistics.median(wave_medians)
    row["ttfa_ms_wave_medians"] = wave_medians
    return row


def wave_count(args: argparse.Namespace, concurrency: int, label: str) -> int:
    """Waves at one level: ``--c1-reps`` at concurrency 1, ``--waves`` for async_chunk above it,
    one for ``full`` above it."""
    if concurrency == 1:
        return int(args.c1_reps)
    return int(args.waves) if label == "async" else 1


def schedule(args: argparse.Namespace) -> list[tuple[int, str]]:
    """The order of a run's waves: (concurrency, "async" | "full"), and (0, "floor") for one
    floor sample. Rounds first: in each, one async wave of every level that still needs one
    (levels forward in even rounds, backward in odd ones) and its share of the floor samples,
    so every level and the floor are sampled over the same stretch of the host's time: a host
    whose speed drifts (a neighbour, a slower core for a while) moves them alike instead of
    skewing the ratios between them. A round's floor samples come right before its wave of the
    lowest level (c1, the floor's ratio), so both follow the same activity (another level's
    wave or the previous round's) within seconds, in backward rounds too; at the round's start
    when that level has no wave left. Then the full waves, level by level (their TTFA is the
    whole reply and only sets the async / full ratio)."""
    levels = list(args.concurrency)
    need = {n: wave_count(args, n, "async") for n in levels}
    rounds = max(need.values())
    floors = int(args.floor_reps)
    lowest = min(levels)
    steps: list[tuple[int, str]] = []
    taken = 0
    for r in range(rounds):
        due = -(-(r + 1) * floors // rounds)  # ceil: the samples spread over the rounds
        samples = [(0, "floor")] * (due - taken)
        taken = due
        order = [n for n in (levels if r % 2 == 0 else levels[::-1]) if r < need[n]]
        at = order.index(lowest) if lowest in order else 0
        waves = [(n, "async") for n in order]
        steps.extend(waves[:at] + samples + waves[at:])
    for n in levels:
        steps.extend([(n, "full")] * wave_count(args, n, "full"))
    return steps


def pipeline_spec(args: argparse.Namespace) -> PipelineSpec:
    """The pipeline with the command line's flow-control and thread overrides applied."""
    spec = load_pipeline(PIPELINE)
    if args.max_ahead is not None:
        edges = tuple(
            e.model_copy(update={"max_ahead": args.max_ahead or None}) if e.key == "thinker->talker" else e
            for e in spec.edges
        )
        spec = spec.model_copy(update={"edges": edges})
    if args.num_threads is not None:
        threads = {"num_threads": args.num_threads}
        stages = tuple(s.model_copy(update={"options": {**s.options, **threads}}) for s in spec.stages)
        spec = spec.model_copy(update={"stages": stages})
    return spec


def flow_settings(spec: PipelineSpec, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {
        "max_ahead": {e.key: e.max_ahead for e in spec.edges},
        "inbox_limit": args.inbox_limit,
        "torch_threads": torch.get_num_threads(),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = list(os.getloadavg())
    spec = pipeline_spec(args)
    probe = FloorProbe(args.tokens, args.frames, spec.stages[0].options)
    orch = Orchestrator.from_spec(spec, inbox_limit=args.inbox_limit)
    await orch.start()
    waves: dict[tuple[int, str], list[list[RequestTiming]]] = {}
    try:
        await wave(orch, 1, 8, 12, None)  # warm-up: first-call costs out of the measurement
        for concurrency, label in schedule(args):
            if label == "floor":
                probe.sample()  # the orchestrator is idle between waves
                continue
            modes = FULL_EDGES if label == "full" else None
            timings = await wave(orch, concurrency, args.tokens, args.frames, modes)
            waves.setdefault((concurrency, label), []).append(timings)
            print(f"c{concurrency} {label} wave done", file=sys.stderr, flush=True)
    finally:
        await orch.close()
    floor = probe.figures()
    results: dict[str, Any] = {}
    for concurrency in args.concurrency:
        row: dict[str, Any] = {
            label: summarize_waves(waves[concurrency, label]) for label in ("async", "full")
        }
        row["ttfa_ratio_median"] = row["async"]["ttfa_ms_median"] / row["full"]["ttfa_ms_median"]
        results[f"c{concurrency}"] = row
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report: dict[str, Any] = {
        "pipeline": PIPELINE,
        "reply": {"tokens": args.tokens, "frames": args.frames, "audio_s": args.frames * FRAME_S},
        "floor": floor,
        "results": results,
        "peak_rss_mb": peak_rss_mb,
        "flow": flow_settings(spec, args),
        # Other work on the machine skews every figure: recorded so a reader can judge a run.
        "load_avg_at_start": load_before,
        "load_avg_at_end": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }
    report["targets"] = check_targets(report)
    return report


def check_targets(report: Mapping[str, Any]) -> dict[str, Any]:
    results = report["results"]
    targets: dict[str, Any] = {}
    if "c1" in results:
        c1 = results["c1"]
        targets["ttfa_ratio_c1<=0.10"] = c1["ttfa_ratio_median"] <= 0.10
        targets["async_c1<=1.25x_floor"] = c1["async"]["ttfa_ms_median"] <= 1.25 * report["floor"]["floor_ms"]
    if "c8" in results:
        targets["ttfa_ratio_c8<=0.15"] = results["c8"]["ttfa_ratio_median"] <= 0.15
    if "c4" in results:
        targets["rtf_c4<1_every_request"] = results["c4"]["async"]["rtf_max"] < 1.0
    return targets


def markdown(report: Mapping[str, Any]) -> str:
    floor = report["floor"]
    lines = [
        f"Pipeline `{report['pipeline']}`: fixed reply of {report['reply']['tokens']} tokens and "
        f"{report['reply']['frames']} codec frames ({report['reply']['audio_s']:.1f} s of audio), greedy.",
        "",
        "| concurrency | TTFA async (median / max, ms) | TTFA full (median / max, ms) | ratio | "
        "RTF async (max) | RTF full (max) |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in report["results"].items():
        a, f = row["async"], row["full"]
        lines.append(
            f"| {key[1:]} | {a['ttfa_ms_median']:.1f} / {a['ttfa_ms_max']:.1f} | "
            f"{f['ttfa_ms_median']:.1f} / {f['ttfa_ms_max']:.1f} | {row['ttfa_ratio_median']:.3f} | "
            f"{a['rtf_max']:.3f} | {f['rtf_max']:.3f} |"
        )
    lines += [
        "",
        f"Critical-path floor (isolation): {floor['floor_ms']:.1f} ms = thinker {floor['thinker_ms']:.1f} + "
        f"talker {floor['talker_ms']:.1f} + code2wav {floor['code2wav_ms']:.1f} ms (medians).",
    ]
    waves = "; ".join(
        f"c{key[1:]} " + ", ".join(f"{m:.1f}" for m in row["async"].get("ttfa_ms_wave_medians", []))
        for key, row in report["results"].items()
    )
    lines.append(f"TTFA async median of each wave (ms; the first is what one wave gives): {waves}.")
    if "c1" in report["results"]:
        ratio = report["results"]["c1"]["async"]["ttfa_ms_median"] / floor["floor_ms"]
        lines.append(f"Async TTFA at c1 / floor: {ratio:.2f}×.")
    if "c4" in report["results"]:
        rtfs = ", ".join(f"{r:.3f}" for r in report["results"]["c4"]["async"]["rtf"])
        lines.append(f"RTF per request at c4 (async): {rtfs}.")
    lines.append(f"Peak RSS: {report['peak_rss_mb']:.0f} MB.")
    flow = report.get("flow")
    if flow:
        ahead = ", ".join(f"{k} {v if v is not None else '-'}" for k, v in flow["max_ahead"].items())
        lines.append(
            f"Flow control: max_ahead {ahead}; inbox_limit {flow['inbox_limit']}; "
            f"torch threads {flow['torch_threads']}."
        )
    load = report["load_avg_at_start"]
    lines.append(
        f"{report['cpus']} CPUs; 1-minute load average {load[0]:.1f} at start, "
        f"{report['load_avg_at_end'][0]:.1f} at end."
    )
    lines.append("")
    lines.append(
        "Targets: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in report["targets"].items())
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--c1-reps", type=int, default=5, help="waves at concurrency 1 (median over them)")
    parser.add_argument(
        "--waves",
        type=int,
        default=5,
        help="async_chunk waves at every concurrency above 1 (TTFA: the median of the waves' medians)",
    )
    parser.add_argument("--floor-reps", type=int, default=5)
    parser.add_argument(
        "--max-ahead", type=int, help="override thinker->talker max_ahead (0: no credit limit)"
    )
    parser.add_argument("--inbox-limit", type=int, default=DEFAULT_INBOX_LIMIT)
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads (engine option)")
    parser.add_argument(
        "--malloc-trim-interval-s",
        type=float,
        default=0.0,
        help="run serve's heap trimmer in this process (runtime/heap_trim.py; 0: not): what it costs",
    )
    args = parser.parse_args(argv)
    for flag in ("waves", "c1_reps", "floor_reps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    trimmer = HeapTrimmer(interval_s=args.malloc_trim_interval_s)
    trimmer.start()
    report = asyncio.run(run(args))
    trimmer.stop()
    if trimmer.trims:
        freed = trimmer.free_seen_bytes / 2**20
        print(f"heap trims: {trimmer.trims}, {freed:.0f} MiB free before them", flush=True)
    publish(markdown(report), report, args.out)


if __name__ == "__main__":
    main()
