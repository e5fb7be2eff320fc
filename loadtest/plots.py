"""PNG plots of a results file (matplotlib, Agg backend: no display needed).

Every function takes the results dict (see loadtest.results) and a path, and draws only from
saved data, so ``python -m loadtest report results.json`` can redraw them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.stats import ecdf


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(levels: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(lv["label"]) for lv in levels))


def _ttfas(level: dict[str, Any]) -> list[float]:
    return [t["ttfa_ms"] for t in level["turns"] if t.get("ttfa_ms") is not None]


def _by_label(levels: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]], list[int]]]:
    """Each configuration's levels in order of concurrency, with those concurrencies (x)."""
    for label in _labels(levels):
        mine = sorted((lv for lv in levels if lv["label"] == label), key=lambda lv: lv["sessions"])
        yield label, mine, [lv["sessions"] for lv in mine]


def _nan(values: Iterable[float | None]) -> list[float]:
    """Missing values as NaN, which matplotlib leaves out of a line."""
    return [np.nan if v is None else v for v in values]


def _pick(levels: list[dict[str, Any]], limit: int = 6) -> list[dict[str, Any]]:
    """At most ``limit`` levels per label for line plots (smallest, largest, spread between)."""
    out: list[dict[str, Any]] = []
    for label in _labels(levels):
        mine = [lv for lv in levels if lv["label"] == label]
        if len(mine) > limit:
            idx = np.unique(np.linspace(0, len(mine) - 1, limit).round().astype(int))
            mine = [mine[i] for i in idx]
        out += mine
    return out


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finish(
    plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, **grid: Any
) -> None:
    """Label, grid and legend a one-axes figure the same way for every plot, then save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


@dataclass(frozen=True)
class Cdf:
    """A CDF plot: one line per (picked) level, from its raw ``samples`` or from its saved
    percentiles 0..100 (``quantiles``)."""

    xlabel: str
    ylabel: str
    title: str
    samples: Callable[[dict[str, Any]], list[float]] | None = None
    quantiles: Callable[[dict[str, Any]], list[float]] | None = None
    zero_line: bool = False

    def __call__(self, results: dict[str, Any], path: Path) -> None:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for lv in _pick(results["levels"]):
            name = f"{lv['label']} N={lv['sessions']}"
            if self.samples is not None:
                x, y = ecdf(self.samples(lv))
                if x.size:
                    ax.step(x, y, where="post", label=name)
            elif self.quantiles is not None and (q := self.quantiles(lv)):
                ax.plot(q, np.arange(len(q)) / 100.0, label=name)
        if self.zero_line:
            ax.axvline(0.0, color="gray", lw=0.8)
        _finish(plt, fig, ax, path, self.xlabel, self.ylabel, self.title)


Line = tuple[str, list[float | None], str, dict[str, Any]]  # legend, y per level, style, plot options


def _vs_concurrency(
    results: dict[str, Any],
    path: Path,
    lines: Callable[[str, list[dict[str, Any]]], Iterable[Line]],
    ylabel: str,
    title: str,
) -> None:
    """Per configuration, ``lines`` of its levels against the number of sessions (log 2)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, mine, n in _by_label(results["levels"]):
        for legend, y, style, options in lines(label, mine):
            ax.plot(n, _nan(y), style, label=legend, **options)
    ax.set_xscale("log", base=2)
    _finish(plt, fig, ax, path, "concurrent sessions", ylabel, title, which="both")


ttfa_cdf = Cdf(
    "end of speech → first audio (ms)",
    "fraction of turns",
    "Time to first audio (client-measured)",
    samples=_ttfas,
)
delta_gap_cdf = Cdf(
    "interval between output audio deltas (ms)",
    "fraction of intervals",
    "Output delta intervals",
    quantiles=lambda lv: lv["summary"].get("delta_gap_quantiles_ms") or [],
)


def ttfa_vs_concurrency(results: dict[str, Any], path: Path) -> None:
    def lines(label: str, mine: list[dict[str, Any]]) -> Iterator[Line]:
        for q, style in (("p50", "-o"), ("p95", "--s")):
            yield f"{label} {q}", [lv["summary"]["ttfa_ms"].get(q) for lv in mine], style, {}

    title = "Time to first audio against concurrency"
    _vs_concurrency(results, path, lines, "time to first audio (ms)", title)


def compare_bars(results: dict[str, Any], path: Path) -> None:
    """p50 and p95 TTFA side by side for each configuration, grouped by concurrency."""
    plt = _plt()
    labels = _labels(results["levels"])
    levels = sorted({lv["sessions"] for lv in results["levels"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    width = 0.8 / max(1, len(labels))
    x = np.arange(len(levels))
    for ax, q in zip(axes, ("p50", "p95"), strict=True):
        for k, label in enumerate(labels):
            by_n = {lv["sessions"]: lv for lv in results["levels"] if lv["label"] == label}
            vals = [(by_n[n]["summary"]["ttfa_ms"].get(q) or 0.0) if n in by_n else 0.0 for n in levels]
            ax.bar(x + (k - (len(labels) - 1) / 2) * width, vals, width, label=label)
        ax.set_xticks(x, [str(n) for n in levels])
        ax.set_xlabel("concurrent sessions")
        ax.set_title(f"TTFA {q}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    _save(plt, fig, path)


def server_timeline(results: dict[str, Any], path: Path) -> None:
    """Server CPU and RSS over time for the largest level of each configuration."""
    plt = _plt()
    fig, (ax_cpu, ax_rss) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for label in _labels(results["levels"]):
        mine = [lv for lv in results["levels"] if lv["label"] == label and lv["server"].get("available")]
        if not mine:
            continue
        lv = max(mine, key=lambda lv: lv["sessions"])
        tl = lv["server"]["timeline"]
        t = [p["t"] for p in tl]
        name = f"{label} N={lv['sessions']}"
        ax_cpu.plot(t, [p["cpu_percent"] for p in tl], label=name)
        ax_rss.plot(t, [p["rss_mb"] for p in tl], label=name)
        ax2 = ax_cpu.twinx()
        ax2.plot(t, [p["active_sessions"] for p in tl], ":", color="gray")
        ax2.set_ylabel("sessions (dotted)")
    ax_cpu.set_ylabel("server CPU %")
    ax_rss.set_ylabel("server RSS (MB)")
    ax_rss.set_xlabel("seconds since start")
    ax_cpu.legend(fontsize=8)
    ax_cpu.grid(alpha=0.3)
    ax_rss.grid(alpha=0.3)
    _save(plt, fig, path)


def capacity_probes(results: dict[str, Any], path: Path) -> None:
    plt = _plt()
    cap = results.get("capacity") or {}
    probes = sorted(results["levels"], key=lambda lv: lv["sessions"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = [lv["sessions"] for lv in probes]
    p95 = [lv["summary"]["ttfa_ms"].get("p95") or np.nan for lv in probes]
    ok = [bool(lv.get("slo_ok")) for lv in probes]
    ax.plot(n, p95, "-", color="gray", alpha=0.5)
    ax.scatter(n, p95, c=["tab:green" if k else "tab:red" for k in ok], zorder=3)
    limit = cap.get("ttfa_p95_limit_ms")
    if limit:
        ax.axhline(limit, color="tab:red", ls="--", label=f"SLO p95 ≤ {limit:g} ms")
    if cap.get("capacity"):
        ax.axvline(cap["capacity"], color="tab:green", ls=":", label=f"capacity = {cap['capacity']}")
    _finish(plt, fig, ax, path, "concurrent sessions (green: SLO met)", "TTFA p95 (ms)", "Capacity search")


def _world(level: dict[str, Any]) -> dict[str, Any]:
    world: dict[str, Any] = level["summary"].get("world") or {}
    return world


frame_jitter_cdf = Cdf(
    "chunk arrival interval − chunk play time (ms; > 0: late)",
    "fraction of chunks",
    "World sessions: frame-interval jitter",
    quantiles=lambda lv: _world(lv).get("frame_jitter_quantiles_ms") or [],
    zero_line=True,
)
action_latency_cdf = Cdf(
    "key event sent → first chunk it shaped received (ms)",
    "fraction of actions",
    "World sessions: action latency",
    samples=lambda lv: _world(lv).get("action_samples_ms") or [],
)


def fps_vs_concurrency(results: dict[str, Any], path: Path) -> None:
    def lines(label: str, mine: list[dict[str, Any]]) -> Iterator[Line]:
        for q, style in (("min", "--s"), ("mean", "-o")):
            yield f"{label} fps {q}", [(_world(lv).get("fps") or {}).get(q) for lv in mine], style, {}
        yield f"{label} asked", [_world(lv).get("fps_requested") for lv in mine], ":", {"color": "gray"}

    title = "World sessions: delivered fps against concurrency"
    _vs_concurrency(results, path, lines, "frames per second per session", title)


def draw_all(results: dict[str, Any], plots_dir: Path, name: str) -> list[Path]:
    """Every plot that fits the results; returns the files written."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    levels = results["levels"]
    jobs: list[tuple[str, Any]]
    if any(_world(lv) for lv in levels):
        jobs = [("frame-jitter-cdf", frame_jitter_cdf), ("action-latency-cdf", action_latency_cdf)]
        if len({lv["sessions"] for lv in levels}) > 1:
            jobs.append(("fps-vs-concurrency", fps_vs_concurrency))
    else:
        jobs = [("ttfa-cdf", ttfa_cdf), ("delta-gap-cdf", delta_gap_cdf)]
        if len({lv["sessions"] for lv in levels}) > 1:
            jobs.append(("ttfa-vs-concurrency", ttfa_vs_concurrency))
        if len(_labels(levels)) > 1:
            jobs.append(("compare-bars", compare_bars))
    if any(lv["server"].get("available") for lv in levels):
        jobs.append(("server", server_timeline))
    if results.get("kind") == "capacity":
        jobs.append(("capacity", capacity_probes))
    written: list[Path] = []
    for suffix, draw in jobs:
        path = plots_dir / f"{name}-{suffix}.png"
        draw(results, path)
        written.append(path)
    return written


def relative(paths: Iterable[Path], start: Path) -> list[str]:
    import os

    return [os.path.relpath(p, start) for p in paths]
