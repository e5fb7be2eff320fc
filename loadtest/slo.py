"""Service-level objectives over a level's results: ``"ttfa_p95_ms<=1500,underruns==0"``.

Voice levels are judged on their turns (``ttfa_*``, ``delta_gap_*``, ``underruns``, ...);
world levels on ``summary["world"]`` (loadtest/world.py ``world_summary``), e.g.
``"fps_min>=14,action_latency_p95_ms<=100,frame_jitter_p99_ms<=35,errors==0"``. A metric the
level did not measure (a world metric on a voice level, no chunk received) fails: an SLO
that cannot be checked is not met.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "<": operator.lt,
    ">": operator.gt,
}
_TERM = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*$")


def _get(level: dict[str, Any], *path: str) -> float | None:
    node: Any = level
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node is None else float(node)


def _refused(level: dict[str, Any]) -> float:
    admissions: dict[str, int] = level["summary"].get("admissions", {})
    return float(sum(n for code, n in admissions.items() if code != "admitted"))


def _unanswered(level: dict[str, Any]) -> float:
    status: dict[str, int] = level["summary"].get("status", {})
    return float(sum(n for s, n in status.items() if s not in ("completed", "cancelled")))


def _world(*path: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda lv: _get(lv, "summary", "world", *path)


def _unapplied(level: dict[str, Any]) -> float | None:
    sent, applied = _world("actions_sent")(level), _world("actions_applied")(level)
    return None if sent is None or applied is None else sent - applied


WORLD_METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    # frames delivered per second per session (after a 1 s warm-up): the slowest, the median
    "fps_min": _world("fps", "min"),
    "fps_p50": _world("fps", "p50"),
    # key press → the first frame generated under it (client clock)
    "action_latency_p50_ms": _world("action_ms", "p50"),
    "action_latency_p95_ms": _world("action_ms", "p95"),
    "action_latency_p99_ms": _world("action_ms", "p99"),
    "server_action_latency_p95_ms": _world("server_action_ms", "p95"),
    # chunk arrival minus the previous chunk's arrival and play time (positive: late)
    "frame_jitter_p99_ms": _world("frame_jitter_ms", "p99"),
    "frame_jitter_abs_p99_ms": _world("frame_jitter_abs_ms", "p99"),
    "late_chunks": _world("late_chunks"),
    "world_frames": _world("frames"),
    "actions_unapplied": _unapplied,
    "actions_applied_late": _world("applied_later_than_declared"),
}

METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "ttfa_p50_ms": lambda lv: _get(lv, "summary", "ttfa_ms", "p50"),
    "ttfa_p95_ms": lambda lv: _get(lv, "summary", "ttfa_ms", "p95"),
    "ttfa_p99_ms": lambda lv: _get(lv, "summary", "ttfa_ms", "p99"),
    "delta_gap_p99_ms": lambda lv: _get(lv, "summary", "delta_gap_ms", "p99"),
    "delta_gap_max_ms": lambda lv: _get(lv, "summary", "delta_gap_ms", "max"),
    "rtf_p50": lambda lv: _get(lv, "summary", "rtf", "p50"),
    "barge_in_stop_p95_ms": lambda lv: _get(lv, "summary", "barge_in_stop_ms", "p95"),
    "underruns": lambda lv: _get(lv, "summary", "underruns"),
    "errors": lambda lv: _get(lv, "summary", "errors"),
    "refused": _refused,
    "unanswered_turns": _unanswered,
    "turns": lambda lv: _get(lv, "summary", "turns"),
    "rss_growth_mb": lambda lv: _get(lv, "server", "rss_growth_mb"),
    "server_cpu_mean_percent": lambda lv: _get(lv, "server", "cpu_mean_percent"),
    "unexpected_closes": lambda lv: _get(lv, "summary", "unexpected_closes"),
    **WORLD_METRICS,
}


@dataclass(frozen=True, slots=True)
class Objective:
    metric: str
    op: str
    limit: float

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.limit:g}"


@dataclass(frozen=True, slots=True)
class Verdict:
    objective: Objective
    actual: float | None
    ok: bool

    def to_json(self) -> dict[str, Any]:
        return {"objective": str(self.objective), "actual": self.actual, "ok": self.ok}


def parse_slo(text: str) -> list[Objective]:
    out: list[Objective] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = _TERM.match(term)
        if m is None or m.group(1) not in METRICS:
            raise ValueError(f"bad objective {term!r}; metrics: {', '.join(METRICS)}")
        out.append(Objective(m.group(1), m.group(2), float(m.group(3))))
    return out


def evaluate(objectives: list[Objective], level: dict[str, Any]) -> list[Verdict]:
    """A metric that could not be measured (no turns answered, no server metrics) fails."""
    verdicts = []
    for obj in objectives:
        actual = METRICS[obj.metric](level)
        ok = actual is not None and _OPS[obj.op](actual, obj.limit)
        verdicts.append(Verdict(obj, actual, ok))
    return verdicts
