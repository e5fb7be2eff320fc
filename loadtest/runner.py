"""Run one load level: N sessions on a ramp, bounded in time, with the server sampled meanwhile.

The result of a level is plain JSON-ready data (see :func:`level_summary`); reports and plots
read only that, so a saved results file can be re-rendered without re-running the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import numpy as np
import psutil

from loadtest.progress import ProgressBar
from loadtest.server_metrics import MetricsSampler, server_summary
from loadtest.server_process import Target
from loadtest.speech import SpeechBank
from loadtest.stats import summarize
from loadtest.turns import TurnRecord
from loadtest.voice_ws import LiveCounters, SessionResult, VoiceWsSession
from loadtest.workload import Workload
from loadtest.world import WorldSession, WorldSessionResult, world_summary
from runtime.metrics import percentile


class SessionRunner(Protocol):
    async def run(self, end_at: float) -> SessionResult: ...


SessionFactory = Callable[[int, Target, Workload, SpeechBank, LiveCounters], SessionRunner]


def api_key() -> str | None:
    """The key sessions authenticate with (``OMNIDUPLEX_API_KEY``; none for an open server)."""
    return os.environ.get("OMNIDUPLEX_API_KEY") or None


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def voice_ws_session(
    index: int, target: Target, workload: Workload, bank: SpeechBank, counters: LiveCounters
) -> SessionRunner:
    url = target.ws_url + (f"?model={workload.model}" if workload.model else "")
    return VoiceWsSession(index, url, workload, bank, counters, headers=auth_headers())


def voice_rtc_session(
    index: int, target: Target, workload: Workload, bank: SpeechBank, counters: LiveCounters
) -> SessionRunner:
    from loadtest.voice_rtc import VoiceRtcSession  # aiortc: imported only when used

    return VoiceRtcSession(index, target.base_url, workload, bank, counters, api_key=api_key())


def world_session(
    index: int, target: Target, workload: Workload, bank: SpeechBank, counters: LiveCounters
) -> SessionRunner:
    return WorldSession(index, target.ws_url + "/video", workload, counters, headers=auth_headers())


async def warm_world(target: Target, workload: Workload) -> None:
    from loadtest.world import warm_up

    await warm_up(target.ws_url + "/video", workload, auth_headers())


# The runner, reports and plots only see SessionResult/TurnRecord (world sessions add a
# WorldStats, summarised under ``summary["world"]``).
SCENARIOS: dict[str, SessionFactory] = {
    "voice-ws": voice_ws_session,
    "voice-webrtc": voice_rtc_session,
    "world": world_session,
}
# Run once before a level's clock starts (e.g. load the world model's pipeline).
WARM_UPS: dict[str, Callable[[Target, Workload], Awaitable[None]]] = {"world": warm_world}


async def wait_idle(sampler: MetricsSampler, timeout_s: float = 60.0) -> None:
    """Wait until the server reports no open sessions (a previous level has drained)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        scrape = await sampler.scrape()
        if scrape is None or scrape.value("omniduplex_active_sessions") == 0:
            return
        await asyncio.sleep(0.5)


async def watch_lag(lags: list[float], interval_s: float = 0.1) -> None:
    """Until cancelled: how late a periodic timer fires on this (the client's) event loop."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        lags.append(max(0.0, time.monotonic() - before - interval_s))


async def _guarded(index: int, run: Awaitable[SessionResult]) -> SessionResult:
    try:
        return await run
    except Exception as exc:  # a load-generator bug must show in the results, not kill the run
        traceback.print_exc(file=sys.stderr)
        result = SessionResult(index, admission="client_exception")
        result.errors[f"client_exception:{type(exc).__name__}"] = 1
        return result


async def run_level(
    target: Target, workload: Workload, bank: SpeechBank, *, progress: bool = True, settle_s: float = 1.0
) -> dict[str, Any]:
    factory = SCENARIOS[workload.scenario]
    counters = LiveCounters()
    sampler = MetricsSampler(target.base_url, pid=target.pid)
    warm = WARM_UPS.get(workload.scenario)
    if warm is not None:
        await warm(target, workload)
    await wait_idle(sampler)
    sampler.scrapes.clear()
    await asyncio.sleep(settle_s)
    me = psutil.Process()
    cpu_before = me.cpu_times()
    host_before = psutil.cpu_times()
    load_before = os.getloadavg()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    await sampler.start()
    if target.idle_rss_mb is None and sampler.scrapes:
        target.idle_rss_mb = sampler.scrapes[0].value("process_resident_memory_bytes") / 2**20
    t0 = time.monotonic()
    end_at = t0 + workload.total_s
    step = workload.ramp_s / workload.sessions
    bar = ProgressBar(f"{target.label} N={workload.sessions}", workload.total_s, counters, enabled=progress)

    async def start_session(i: int) -> SessionResult:
        await asyncio.sleep(max(0.0, t0 + i * step - time.monotonic()))
        session = factory(i, target, workload, bank, counters)
        return await _guarded(i, session.run(end_at))

    lags: list[float] = []
    watcher = asyncio.create_task(watch_lag(lags), name="loadtest:lag")
    async with bar.running():
        tasks = [asyncio.create_task(start_session(i), name=f"session:{i}") for i in range(workload.sessions)]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in (*tasks, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    wall = time.monotonic() - t0
    await asyncio.sleep(settle_s)  # let the server notice the closes before the last scrape
    await sampler.stop()
    cpu_after = me.cpu_times()
    client_cpu = (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / wall * 100
    summary = level_summary(results)
    summary["client"] = {
        "cpu_percent": round(client_cpu, 1),
        "late_sends": sum(r.late_sends for r in results),
        "max_send_lag_ms": round(max((r.max_send_lag_ms for r in results), default=0.0), 1),
        # The load generator's own event loop: when it lags, its timestamps lag too.
        "loop_lag_ms": summarize(lag * 1000 for lag in lags),
    }
    summary["host"] = host_load(host_before, psutil.cpu_times(), load_before)
    return {
        "label": target.label,
        "server_args": target.server_args,
        "sessions": workload.sessions,
        "workload": workload.to_json(),
        "started_at": started_at,
        "wall_s": round(wall, 2),
        "summary": summary,
        "server": server_summary(sampler.scrapes, t0, server_idle_rss_mb=target.idle_rss_mb),
        "sessions_detail": [
            {
                "index": r.index,
                "admission": r.admission,
                "turns": len(r.turns),
                "errors": r.errors,
                "close": r.close,
                "late_sends": r.late_sends,
                "vad_splits": r.vad_splits,
                **(
                    {"world": r.world.to_json()}
                    if isinstance(r, WorldSessionResult) and r.world is not None
                    else {}
                ),
            }
            for r in results
        ],
        "turns": [t.to_json() for r in results for t in r.turns],
    }


def host_load(before: Any, after: Any, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """How busy the whole host was: the load generator and the server share it with anything
    else running, and a busy host delays both."""
    busy = sum(after) - sum(before) - (after.idle - before.idle) - (after.iowait - before.iowait)
    total = sum(after) - sum(before)
    cpus = psutil.cpu_count() or 1
    return {
        "cpu_percent": round(busy / total * 100 * cpus, 1) if total > 0 else None,  # of one core
        "cpus": cpus,
        "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


def level_summary(results: list[SessionResult]) -> dict[str, Any]:
    turns: list[TurnRecord] = [t for r in results for t in r.turns]
    statuses: dict[str, int] = {}
    for t in turns:
        statuses[str(t.status)] = statuses.get(str(t.status), 0) + 1
    errors: dict[str, int] = {}
    for r in results:
        for source in (r.errors, *(t.errors for t in r.turns)):
            for code, n in source.items():
                errors[code] = errors.get(code, 0) + n
    admissions: dict[str, int] = {}
    for r in results:
        admissions[r.admission] = admissions.get(r.admission, 0) + 1
    answered = [t for t in turns if t.first_audio_at is not None]
    completed = [t for t in turns if t.status == "completed"]
    gaps_ms = np.array([g * 1000.0 for t in turns for g in t.gaps_s], dtype=np.float64)
    barge = [t for t in turns if t.barge_in_at is not None]
    worlds = [r.world for r in results if isinstance(r, WorldSessionResult) and r.world is not None]
    extra: dict[str, Any] = {"world": world_summary(worlds)} if worlds else {}
    return {
        "turns": len(turns),
        "status": statuses,
        "ttfa_ms": summarize(t.ttfa_ms for t in answered),
        "stream_ms": summarize(t.stream_ms for t in completed),
        "rtf": summarize((t.rtf for t in completed), digits=3),
        "audio_ms": summarize(t.audio_ms for t in completed),
        "delta_gap_ms": summarize(gaps_ms.tolist()),
        "delta_gap_quantiles_ms": (
            [round(percentile(gaps_ms, q), 2) for q in range(101)] if gaps_ms.size else []
        ),
        "underruns": sum(t.underruns for t in turns),
        "turns_with_underruns": sum(1 for t in turns if t.underruns),
        "silent_frames": sum(t.silent_frames for t in turns),
        "stall_ms": round(sum(t.playout.stall_s for t in turns) * 1000.0, 1),
        "barge_ins": len(barge),
        "barge_in_stop_ms": summarize(t.barge_in_stop_ms for t in barge),
        "errors_by_code": errors,
        "errors": sum(errors.values()),
        "admissions": admissions,
        "vad_splits": sum(r.vad_splits for r in results),
        "unexpected_closes": sum(1 for r in results if r.close is not None),
        **extra,
    }
