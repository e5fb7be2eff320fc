"""The subcommands: ``run`` (levels against one server), ``compare`` (two configurations, the
same workload, ratios) and ``capacity`` (the largest N that meets an SLO)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from loadtest.runner import run_level
from loadtest.server_process import ConfigSpec, ServerProcess, Target, wait_ready
from loadtest.slo import Objective, evaluate
from loadtest.speech import SpeechBank, build_speech_bank
from loadtest.workload import Workload


def speech_bank(w: Workload, cache_dir: Path) -> SpeechBank:
    return build_speech_bank(w.speech, append_ms=w.append_ms, speech_ms=w.speech_ms, cache_dir=cache_dir)


@contextlib.asynccontextmanager
async def server_target(
    url: str | None, config: ConfigSpec | None, log_dir: Path, *, nice: int = 0
) -> AsyncIterator[Target]:
    """An external server (``url``), or one started from ``config`` for the block."""
    if config is not None:
        print(f"starting server [{config.label}]: {' '.join(config.args)}", file=sys.stderr)
        async with ServerProcess(config, log_dir=log_dir, nice=nice) as target:
            yield target
        return
    base = (url or "http://127.0.0.1:8000").rstrip("/")
    base = "http" + base.removeprefix("ws") if base.startswith("ws") else base
    await wait_ready(base, 30.0)
    yield Target(base, "server")


async def run_levels(
    target: Target,
    workload: Workload,
    levels: list[int],
    bank: SpeechBank,
    *,
    objectives: list[Objective],
    progress: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    out = []
    for n in levels:
        level = await run_level(target, workload.at(n), bank, progress=progress)
        if objectives:
            level["slo"] = [v.to_json() for v in evaluate(objectives, level)]
            level["slo_ok"] = all(v["ok"] for v in level["slo"])
        log(one_line(level))
        out.append(level)
    return out


def one_line(level: dict[str, Any]) -> str:
    s, sv = level["summary"], level["server"]
    w = s.get("world")
    if w:
        fps, jit, act = w["fps"], w["frame_jitter_ms"], w["action_ms"]
        return (
            f"[{level['label']}] N={level['sessions']}: fps min {fps['min']} mean {fps['mean']}"
            f" (asked {w['fps_requested']}), jitter p99 {jit['p99']} ms, late chunks {w['late_chunks']},"
            f" action p50 {act['p50']} p95 {act['p95']} ms, errors {s['errors']}"
        )
    ttfa, gap = s["ttfa_ms"], s["delta_gap_ms"]
    verdict = "" if "slo_ok" not in level else (" SLO ok" if level["slo_ok"] else " SLO FAILED")
    cpu = (
        f" server cpu {sv['cpu_mean_percent']}% rss +{sv['rss_growth_mb']} MB" if sv.get("available") else ""
    )
    return (
        f"[{level['label']}] N={level['sessions']}: {s['turns']} turns,"
        f" TTFA p50 {ttfa['p50']} p95 {ttfa['p95']} ms,"
        f" gap p99 {gap['p99']} ms, underruns {s['underruns']}, errors {s['errors']}{cpu}{verdict}"
    )


def comparison(levels: list[dict[str, Any]], baseline: str, other: str) -> dict[str, Any]:
    def pick(label: str) -> dict[int, dict[str, Any]]:
        return {lv["sessions"]: lv for lv in levels if lv["label"] == label}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or a == 0 else round(b / a, 3)

    a_levels, b_levels = pick(baseline), pick(other)
    rows = []
    for n in sorted(set(a_levels) & set(b_levels)):
        a, b = a_levels[n], b_levels[n]
        sa, sb = a["summary"], b["summary"]
        rows.append(
            {
                "sessions": n,
                "ratios": {
                    "ttfa_p50": ratio(sa["ttfa_ms"]["p50"], sb["ttfa_ms"]["p50"]),
                    "ttfa_p95": ratio(sa["ttfa_ms"]["p95"], sb["ttfa_ms"]["p95"]),
                    "stream_p50": ratio(sa["stream_ms"]["p50"], sb["stream_ms"]["p50"]),
                    "rtf_p50": ratio(sa["rtf"]["p50"], sb["rtf"]["p50"]),
                    "server_cpu": ratio(
                        a["server"].get("cpu_mean_percent"), b["server"].get("cpu_mean_percent")
                    ),
                },
            }
        )
    return {"baseline": baseline, "other": other, "rows": rows}


async def find_capacity(
    target: Target,
    workload: Workload,
    bank: SpeechBank,
    *,
    objectives: list[Objective],
    start: int,
    max_n: int,
    resolution: int,
    progress: bool,
    log: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Double N from ``start`` until the SLO fails (or ``max_n``), then bisect to ``resolution``."""
    levels: list[dict[str, Any]] = []

    async def probe(n: int) -> bool:
        [level] = await run_levels(
            target, workload, [n], bank, objectives=objectives, progress=progress, log=log
        )
        levels.append(level)
        return bool(level["slo_ok"])

    best, worst = 0, None
    n = start
    while n <= max_n:
        if await probe(n):
            best = n
            if n == max_n:
                break
            n = min(max_n, n * 2)
        else:
            worst = n
            break
    while worst is not None and worst - best > resolution:
        mid = (best + worst) // 2
        if mid in (best, worst):
            break
        if await probe(mid):
            best = mid
        else:
            worst = mid
    ttfa_limit = next((o.limit for o in objectives if o.metric == "ttfa_p95_ms"), None)
    return levels, {
        "capacity": best,
        "first_failure": worst,
        "slo": ", ".join(str(o) for o in objectives),
        "ttfa_p95_limit_ms": ttfa_limit,
        "probed": [lv["sessions"] for lv in levels],
        "reached_max": worst is None,
    }
