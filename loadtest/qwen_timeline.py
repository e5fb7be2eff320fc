"""Where a wave's time to first audio goes, call by call, at one request against several.

Issue 31's rounds each profiled a c8 wave against a c1 wave with throwaway scripts. This is that
profile as a tool: the tiny Qwen3-Omni pipeline runs waves of each level, interleaved (levels
forward, then backward), and every engine step of a wave up to its last request's first audio is
recorded from the orchestrator's own step metrics (:class:`~runtime.metrics.MetricsHook`: the
stage, the rows stepped and ``engine.step``'s wall time, observed on the event loop when its
results are applied). Waves of one level take the same path (critical-path scheduling runs one
call at a time until every request has its first audio), so the n-th calls of its waves are the
same call: :func:`median_path` gives each its median gap and duration, and :func:`compare`
sets the levels' paths side by side.

    .venv/bin/python -m loadtest.qwen_timeline --levels 1 8 --waves 6

A call's gap before it is the hand-off from the previous call plus anything the worker ran
before ``engine.step`` (the ``engine.start`` of requests joining in that call). The recording
(:class:`WaveTimeline`) is sans-I/O: it takes the hook's observations and a clock.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.bench_qwen import PIPELINE, wave
from runtime.orchestrator import Orchestrator
from runtime.spec import load_pipeline


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step of a wave: ms from the wave's start to the step's start and end."""

    stage: str
    rows: int
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(slots=True)
class WaveTimeline:
    """A :class:`~runtime.metrics.MetricsHook` that keeps the steps since :meth:`begin`. A step
    is observed when its results are applied; it started ``step_s`` before that."""

    clock: Callable[[], float] = time.perf_counter
    steps: list[StepRecord] = field(default_factory=list)
    _t0: float | None = None

    def begin(self) -> None:
        self.steps = []
        self._t0 = self.clock()

    def on_step(self, stage: str, replica: int, batch: int, step_s: float) -> None:
        if self._t0 is None:
            return  # between waves: not part of any
        end_ms = (self.clock() - self._t0) * 1e3
        self.steps.append(StepRecord(stage, batch, end_ms - step_s * 1e3, end_ms))

    def on_request(self, stage: str, seconds: float, outcome: str) -> None:
        pass

    def on_queue(self, stage: str, replica: int, depth: int) -> None:
        pass

    def until(self, ms: float) -> list[StepRecord]:
        """The steps that started before ``ms`` (a wave's last first audio): its path."""
        return [s for s in self.steps if s.start_ms < ms]


@dataclass(frozen=True, slots=True)
class PathCall:
    """The n-th call of a level's waves: median gap before it and median duration (ms)."""

    stage: str
    rows: int
    gap_ms: float
    duration_ms: float


def median_path(waves: Sequence[Sequence[StepRecord]]) -> list[PathCall]:
    """Per call index, the median over ``waves`` of the gap before the call and its duration.
    Up to the shortest wave's calls; a call whose stage or rows differ between waves ends the
    path there (the waves did not take the same path beyond it)."""
    if not waves:
        return []
    path: list[PathCall] = []
    for i in range(min(len(w) for w in waves)):
        calls = [w[i] for w in waves]
        if len({(c.stage, c.rows) for c in calls}) != 1:
            break
        gaps = [w[i].start_ms - (w[i - 1].end_ms if i else 0.0) for w in waves]
        path.append(
            PathCall(
                calls[0].stage,
                calls[0].rows,
                statistics.median(gaps),
                statistics.median(c.duration_ms for c in calls),
            )
        )
    return path


def compare(levels: dict[int, list[PathCall]]) -> list[str]:
    """A markdown table: one row per call index, each level's ``stage rows: gap + duration``,
    and the path's totals (gaps, calls) last."""
    keys = sorted(levels)
    lines = [
        "| call | " + " | ".join(f"c{n}: stage rows, gap + ms" for n in keys) + " |",
        "|---:|" + "---|" * len(keys),
    ]
    for i in range(max((len(p) for p in levels.values()), default=0)):
        cells = []
        for n in keys:
            path = levels[n]
            if i < len(path):
                c = path[i]
                cells.append(f"{c.stage} {c.rows}, {c.gap_ms:.1f} + {c.duration_ms:.1f}")
            else:
                cells.append("")
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    totals = []
    for n in keys:
        gaps = sum(c.gap_ms for c in levels[n])
        calls = sum(c.duration_ms for c in levels[n])
        totals.append(f"gaps {gaps:.1f} + calls {calls:.1f} = {gaps + calls:.1f}")
    lines.append("| total | " + " | ".join(totals) + " |")
    return lines


async def run(args: argparse.Namespace) -> None:
    orch = Orchestrator.from_spec(load_pipeline(PIPELINE))
    timeline = WaveTimeline()
    orch.metrics.add_hook(timeline)
    await orch.start()
    medians: dict[int, list[float]] = {n: [] for n in args.levels}
    paths: dict[int, list[list[StepRecord]]] = {n: [] for n in args.levels}
    try:
        await wave(orch, 1, 8, 12, None)  # warm-up: first-call costs out of the measurement
        for r in range(args.waves):
            for n in args.levels if r % 2 == 0 else args.levels[::-1]:
                timeline.begin()
                timings = await wave(orch, n, args.tokens, args.frames, None)
                ttfa = sorted(t.ttfa_ms for t in timings)
                medians[n].append(statistics.median(ttfa))
                paths[n].append(timeline.until(ttfa[-1]))
    finally:
        await orch.close()
    for n in args.levels:
        waves = ", ".join(f"{m:.1f}" for m in medians[n])
        print(f"c{n}: TTFA median {statistics.median(medians[n]):.1f} ms (waves {waves})")
    print("\n".join(compare({n: median_path(paths[n]) for n in args.levels})))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--waves", type=int, default=6, help="waves per level, interleaved")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--frames", type=int, default=40)
    args = parser.parse_args(argv)
    if args.waves < 1 or min(args.levels) < 1:
        parser.error("--waves and every level must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
