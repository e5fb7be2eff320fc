"""Plot ``loadtest.bench_qwen`` reports against each other: TTFA and RTF per concurrency.

    .venv/bin/python -m loadtest.plot_qwen before=/tmp/before.json after=/tmp/after.json \\
        --out docs/plots/qwen3-omni-tiny-batching.png

Each ``LABEL=PATH`` is one report (``bench_qwen --out``). Left: async TTFA median (max as the
error bar's top) per concurrency, with each report's critical-path floor and the 1.5 × c1 line;
right: the worst request's RTF (async), with real time (1.0) marked.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _levels(report: dict[str, Any]) -> list[int]:
    return sorted(int(key[1:]) for key in report["results"])


def plot(reports: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttfa_ax, rtf_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for label, report in reports.items():
        levels = _levels(report)
        rows = [report["results"][f"c{n}"]["async"] for n in levels]
        medians = [r["ttfa_ms_median"] for r in rows]
        above = [r["ttfa_ms_max"] - r["ttfa_ms_median"] for r in rows]
        line = ttfa_ax.errorbar(
            levels, medians, yerr=[[0] * len(rows), above], marker="o", capsize=3, label=label
        )
        color = line[0].get_color()
        ttfa_ax.axhline(
            report["floor"]["floor_ms"], color=color, linestyle=":", linewidth=1, label=f"{label}: floor"
        )
        if 1 in levels:
            ttfa_ax.axhline(
                1.5 * medians[0], color=color, linestyle="--", linewidth=1, label=f"{label}: 1.5 × c1"
            )
        rtf_ax.plot(levels, [r["rtf_max"] for r in rows], marker="o", color=color, label=label)
    rtf_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="real time")
    for ax, ylabel, title in (
        (ttfa_ax, "TTFA, ms (median; bar to max)", "Time to first audio (async_chunk)"),
        (rtf_ax, "RTF of the slowest request", "Real-time factor (async_chunk)"),
    ):
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xticks(sorted({n for r in reports.values() for n in _levels(r)}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", help="LABEL=PATH of a bench_qwen JSON report")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    reports: dict[str, dict[str, Any]] = {}
    for spec in args.reports:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"expected LABEL=PATH, got {spec!r}")
        reports[label] = json.loads(Path(path).read_text())
    plot(reports, args.out)


if __name__ == "__main__":
    main()
