"""A results file: what ran, on what host, every level; written as JSON + Markdown + PNG plots."""

from __future__ import annotations

import json
import os
import platform
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from loadtest.plots import draw_all, relative
from loadtest.report import render

SCHEMA = 1


def host_info() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def new_results(kind: str, name: str, command: str) -> dict[str, Any]:
    return {
        "tool": "omniduplex loadtest",
        "schema": SCHEMA,
        "kind": kind,
        "name": name,
        "command": command,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host_info(),
        "levels": [],
    }


def dumps(results: dict[str, Any]) -> str:
    """Indented JSON, except that each turn and each timeline point takes one line (a 200-session
    run has thousands of turns: indenting their fields would triple the file)."""
    compact: list[str] = []

    def mark(value: Any) -> str:
        compact.append(json.dumps(value, separators=(",", ":")))
        return f"@@{len(compact) - 1}@@"

    levels = []
    for level in results.get("levels", []):
        level = {**level, "turns": [mark(t) for t in level.get("turns", [])]}
        server = level.get("server")
        if isinstance(server, dict) and "timeline" in server:
            level["server"] = {**server, "timeline": [mark(p) for p in server["timeline"]]}
        levels.append(level)
    text = json.dumps({**results, "levels": levels}, indent=1)
    return re.sub(r'"@@(\d+)@@"', lambda m: compact[int(m.group(1))], text) + "\n"


def write_outputs(results: dict[str, Any], out_dir: Path, plots_dir: Path) -> dict[str, Path]:
    """``<out>/<name>.json``, ``<out>/<name>.md`` and ``<plots>/<name>-*.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = str(results["name"])
    json_path = out_dir / f"{name}.json"
    json_path.write_text(dumps(results))
    plots = draw_all(results, plots_dir, name)
    md_path = out_dir / f"{name}.md"
    md_path.write_text(render(results, relative(plots, out_dir)))
    return {"json": json_path, "markdown": md_path, **{p.stem: p for p in plots}}


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a loadtest results file of schema {SCHEMA}")
    return data
