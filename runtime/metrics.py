"""Per-stage metrics as plain data, plus hooks for exporters (Prometheus lives in web/).

Updated on the event loop only (by replica schedulers), so no locks. ``snapshot()`` returns
dicts of numbers; a hook object gets each observation as it happens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np


class MetricsHook(Protocol):
    def on_step(self, stage: str, replica: int, batch: int, step_s: float) -> None: ...

    def on_request(self, stage: str, seconds: float, outcome: str) -> None: ...

    def on_queue(self, stage: str, replica: int, depth: int) -> None: ...


def percentile(values: Iterable[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (``q`` in 0..100) of ``values``; 0.0 for no values.

    One meaning for every percentile this project reports (stage metrics, load tests,
    benchmarks): linear interpolation between the two nearest ranks, numpy's default
    (``method="linear"``). So p50 is the median (``statistics.median``), p0 the minimum and
    p100 the maximum. (``media/`` calls ``np.percentile`` itself, the same definition, as it
    imports nothing of ours; ``loadtest.server_metrics.histogram_quantile`` estimates from
    Prometheus buckets, which is another thing.)"""
    data = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return 0.0
    return float(np.percentile(data, q))


class StageMetrics:
    def __init__(self, stage: str, replicas: int, window: int = 1024) -> None:
        self.stage = stage
        self.steps = 0
        self.items = 0
        self.batch_counts: dict[int, int] = {}
        self.batch_max = 0
        self.step_s: deque[float] = deque(maxlen=window)
        self.step_s_total = 0.0
        self.time_in_stage_s: deque[float] = deque(maxlen=window)
        self.queue_depth = [0] * replicas
        self.live = [0] * replicas
        self.outcomes: dict[str, int] = {"completed": 0, "failed": 0, "cancelled": 0}
        self.counters: dict[str, int] = {}  # engine counters (StepOutput.counters), summed

    def add_counters(self, counters: dict[str, int]) -> None:
        for name, value in counters.items():
            self.counters[name] = self.counters.get(name, 0) + int(value)

    def record_step(self, batch: int, step_s: float) -> None:
        self.steps += 1
        self.items += batch
        self.batch_counts[batch] = self.batch_counts.get(batch, 0) + 1
        self.batch_max = max(self.batch_max, batch)
        self.step_s.append(step_s)
        self.step_s_total += step_s

    def record_request(self, seconds: float, outcome: str) -> None:
        self.time_in_stage_s.append(seconds)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        steps = list(self.step_s)
        stay = list(self.time_in_stage_s)
        return {
            "steps": self.steps,
            "queue_depth": sum(self.queue_depth),
            "queue_depth_per_replica": list(self.queue_depth),
            "live_requests": sum(self.live),
            "live_per_replica": list(self.live),
            "batch": {
                "mean": self.items / self.steps if self.steps else 0.0,
                "max": self.batch_max,
                "counts": dict(sorted(self.batch_counts.items())),
            },
            "step_ms": {
                "p50": percentile(steps, 50) * 1e3,
                "p99": percentile(steps, 99) * 1e3,
                "mean": (self.step_s_total / self.steps * 1e3) if self.steps else 0.0,
            },
            "time_in_stage_ms": {"p50": percentile(stay, 50) * 1e3, "p99": percentile(stay, 99) * 1e3},
            "requests": dict(self.outcomes),
            "counters": dict(self.counters),
        }


class RuntimeMetrics:
    def __init__(self) -> None:
        self.stages: dict[str, StageMetrics] = {}
        self.hooks: list[MetricsHook] = []

    def add_stage(self, stage: str, replicas: int) -> StageMetrics:
        self.stages[stage] = StageMetrics(stage, replicas)
        return self.stages[stage]

    def add_replica(self, stage: str) -> int:
        """One more replica of ``stage`` (a stage host joining): its index."""
        metrics = self.stages[stage]
        metrics.queue_depth.append(0)
        metrics.live.append(0)
        return len(metrics.queue_depth) - 1

    def add_hook(self, hook: MetricsHook) -> None:
        self.hooks.append(hook)

    def step(self, stage: str, replica: int, batch: int, step_s: float) -> None:
        self.stages[stage].record_step(batch, step_s)
        for hook in self.hooks:
            hook.on_step(stage, replica, batch, step_s)

    def request(self, stage: str, seconds: float, outcome: str) -> None:
        self.stages[stage].record_request(seconds, outcome)
        for hook in self.hooks:
            hook.on_request(stage, seconds, outcome)

    def counters(self, stage: str, counters: dict[str, int]) -> None:
        """Engine counters of one step (read by exporters at scrape time)."""
        self.stages[stage].add_counters(counters)

    def queue(self, stage: str, replica: int, depth: int, live: int) -> None:
        metrics = self.stages[stage]
        changed = metrics.queue_depth[replica] != depth
        metrics.queue_depth[replica] = depth
        metrics.live[replica] = live
        if changed:
            for hook in self.hooks:
                hook.on_queue(stage, replica, depth)

    def snapshot(self) -> dict[str, Any]:
        return {"stages": {name: m.snapshot() for name, m in self.stages.items()}}
