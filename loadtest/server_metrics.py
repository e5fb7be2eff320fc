"""The server's side of a run, from its `GET /metrics` (Prometheus text), sampled every second.

A :class:`MetricsSampler` scrapes while the load runs; :func:`server_summary` turns the first
and last scrapes and the samples between them into CPU, RSS, event-loop lag, server-side time
to first audio, errors and admissions *of this run* (counter and histogram differences).

``omniduplex_active_sessions`` counts voice and world sessions together (the per-session CPU
cost uses it); ``omniduplex_active_sessions_by_kind{kind}`` splits them.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from session.store.aio import cancel_and_wait

Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class Scrape:
    at: float  # client monotonic seconds
    samples: dict[tuple[str, Labels], float]
    tree: tuple[float, float] | None = None  # (CPU s, RSS bytes) of the server and its children

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        """Samples of Prometheus text exposition (``*_created`` series skipped).

        A line-level parser, ~20x faster than prometheus-client's: it runs on the load
        generator's event loop once a second, where 20 ms would delay every session's
        timestamps (comments, escapes in label values and exemplars are not needed here)."""
        samples: dict[tuple[str, Labels], float] = {}
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            m = _SAMPLE.match(line)
            if m is None or m.group(1).endswith("_created"):
                continue
            labels = tuple(sorted(_LABEL.findall(m.group(2)))) if m.group(2) else ()
            try:
                samples[(m.group(1), labels)] = float(m.group(3))
            except ValueError:
                continue
        return cls(at, samples)

    def value(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), default)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative histogram buckets ``(le, count)`` of ``name`` (summed over other labels)."""
        acc: dict[float, float] = {}
        for (n, labels), v in self.samples.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                acc[le] = acc.get(le, 0.0) + v
        return sorted(acc.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` (linear within a bucket); None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def bucket_delta(a: Scrape, b: Scrape, name: str) -> list[tuple[float, float]]:
    before = dict(a.buckets(name))
    return [(le, count - before.get(le, 0.0)) for le, count in b.buckets(name)]


def counter_delta(a: Scrape, b: Scrape, name: str, label: str) -> dict[str, int]:
    before = a.by_label(name, label)
    out = {k: round(v - before.get(k, 0.0)) for k, v in b.by_label(name, label).items()}
    return {k: v for k, v in out.items() if v}


@dataclass(slots=True)
class MetricsSampler:
    """Scrape ``{base_url}/metrics`` every ``interval_s`` until stopped. Owns its task."""

    base_url: str
    pid: int | None = None  # also sample this process tree (server + embedded redis-server)
    interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    scrapes: list[Scrape] = field(default_factory=list)
    failures: int = 0
    _task: asyncio.Task[None] | None = None
    _client: httpx.AsyncClient | None = None

    async def scrape(self) -> Scrape | None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=5.0)
        try:
            # scope=all: under `serve --workers N` the summed metrics of every worker
            # (web/deploy/worker_forward.py); a single process ignores the parameter.
            reply = await self._client.get(f"{self.base_url}/metrics", params={"scope": "all"})
            reply.raise_for_status()
        except httpx.HTTPError:
            self.failures += 1
            return None
        scrape = Scrape.parse(reply.text, self.clock())
        if self.pid is not None:
            scrape.tree = process_tree_usage(self.pid)
        self.scrapes.append(scrape)
        return scrape

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def start(self) -> None:
        await self.scrape()
        self._task = asyncio.create_task(self._loop(), name="loadtest:metrics")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self.scrape()
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def process_tree_usage(pid: int) -> tuple[float, float] | None:
    """CPU seconds and RSS bytes of a process and its live descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    cpu = rss = 0.0
    for proc in procs:
        try:
            times, mem = proc.cpu_times(), proc.memory_info()
        except psutil.Error:
            continue
        cpu += times.user + times.system
        rss += mem.rss
    return cpu, rss


def _tree_summary(scrapes: list[Scrape]) -> dict[str, Any] | None:
    trees = [(s.at, s.tree) for s in scrapes if s.tree is not None]
    if len(trees) < 2:
        return None
    (t0, (cpu0, rss0)), (t1, (cpu1, _)) = trees[0], trees[-1]
    peak = max(tree[1] for _, tree in trees)
    return {
        "cpu_mean_percent": round((cpu1 - cpu0) / (t1 - t0) * 100, 1) if t1 > t0 else None,
        "start_rss_mb": round(rss0 / 2**20, 1),
        "peak_rss_mb": round(peak / 2**20, 1),
    }


def peak_by_label(scrapes: list[Scrape], name: str, label: str) -> dict[str, float]:
    """The largest value of each ``label`` of gauge ``name`` over ``scrapes`` (e.g. the peak
    voice and world sessions of ``omniduplex_active_sessions_by_kind``; empty from a server
    that does not export it)."""
    peaks: dict[str, float] = {}
    for scrape in scrapes:
        for key, value in scrape.by_label(name, label).items():
            peaks[key] = max(peaks.get(key, value), value)
    return peaks


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 1)


def server_summary(
    scrapes: list[Scrape], t0: float, *, server_idle_rss_mb: float | None = None
) -> dict[str, Any]:
    """What the server did between the first and the last scrape.

    RSS growth is measured from ``server_idle_rss_mb`` (the server before any load, when a
    sweep runs several levels against one server) or else from this level's first scrape."""
    if len(scrapes) < 2:
        return {"available": False}
    first, last = scrapes[0], scrapes[-1]
    timeline: list[dict[str, float]] = []
    cpu_peaks: list[float] = []
    session_s = 0.0  # ∫ active sessions dt
    for a, b in itertools.pairwise(scrapes):
        dt = b.at - a.at
        if dt <= 0:
            continue
        active = (a.value("omniduplex_active_sessions") + b.value("omniduplex_active_sessions")) / 2
        session_s += active * dt
        cpu = (b.value("process_cpu_seconds_total") - a.value("process_cpu_seconds_total")) / dt * 100.0
        cpu_peaks.append(cpu)
        timeline.append(
            {
                "t": round(b.at - t0, 2),
                "cpu_percent": round(cpu, 1),
                "rss_mb": round(b.value("process_resident_memory_bytes") / 2**20, 1),
                "active_sessions": b.value("omniduplex_active_sessions"),
                "conversation_audio_mb": round(b.value("omniduplex_conversation_audio_bytes") / 2**20, 1),
                "held_audio_mb": round(b.value("omniduplex_held_audio_bytes") / 2**20, 1),
            }
        )
    span = last.at - first.at
    level_start_rss = first.value("process_resident_memory_bytes") / 2**20
    idle_rss = level_start_rss if server_idle_rss_mb is None else server_idle_rss_mb
    peak_rss = max(s.value("process_resident_memory_bytes") for s in scrapes) / 2**20
    cpu_mean = (
        (last.value("process_cpu_seconds_total") - first.value("process_cpu_seconds_total")) / span * 100
    )
    ttfa = bucket_delta(first, last, "omniduplex_time_to_first_audio_seconds")
    lag = bucket_delta(first, last, "omniduplex_event_loop_lag_seconds")
    gc_pause = bucket_delta(first, last, "omniduplex_gc_pause_seconds")
    gc_s = last.value("omniduplex_gc_pause_seconds_sum", generation="2") - first.value(
        "omniduplex_gc_pause_seconds_sum", generation="2"
    )
    return {
        "available": True,
        "idle_rss_mb": round(idle_rss, 1),
        "level_start_rss_mb": round(level_start_rss, 1),
        "peak_rss_mb": round(peak_rss, 1),
        "end_rss_mb": round(last.value("process_resident_memory_bytes") / 2**20, 1),
        "rss_growth_mb": round(peak_rss - idle_rss, 1),
        "cpu_mean_percent": round(cpu_mean, 1),
        "cpu_max_percent": round(max(cpu_peaks, default=0.0), 1),
        # What one session costs the server, robust to other load on the host.
        "cpu_ms_per_session_s": round(cpu_mean / 100 * span / session_s * 1000, 2) if session_s else None,
        "peak_conversation_audio_mb": round(
            max(s.value("omniduplex_conversation_audio_bytes") for s in scrapes) / 2**20, 1
        ),
        "peak_held_audio_mb": round(max(s.value("omniduplex_held_audio_bytes") for s in scrapes) / 2**20, 1),
        "peak_active_sessions": max(s.value("omniduplex_active_sessions") for s in scrapes),
        "peak_active_sessions_by_kind": peak_by_label(scrapes, "omniduplex_active_sessions_by_kind", "kind"),
        "server_ttfa_ms": {
            "p50": _ms(histogram_quantile(0.5, ttfa)),
            "p95": _ms(histogram_quantile(0.95, ttfa)),
        },
        "loop_lag_ms": {"p50": _ms(histogram_quantile(0.5, lag)), "p99": _ms(histogram_quantile(0.99, lag))},
        "gc_pause_ms": {
            "p99": _ms(histogram_quantile(0.99, gc_pause)),
            "collections": round(gc_pause[-1][1]) if gc_pause else 0,
            "full_collections_s": round(gc_s, 3),
        },
        "errors_by_code": counter_delta(first, last, "omniduplex_errors_total", "code"),
        "admissions": counter_delta(first, last, "omniduplex_admissions_total", "outcome"),
        "responses": round(
            last.value("omniduplex_responses_total") - first.value("omniduplex_responses_total")
        ),
        "process_tree": _tree_summary(scrapes),  # server + its redis-server, when we started it
        "timeline": timeline,
    }
