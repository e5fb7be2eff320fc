"""Scenario ``live``: N GPT-Live sessions (``/v1/live/sessions``) streaming in real time.

Each session connects, sends ``session.start`` and then one 100 ms append of 24 kHz PCM16 every
100 ms (deadline-paced, start phases spread over ``--ramp``), as LiveKit's ``GPTLiveModel``
does, for ``--duration`` seconds; it reads the continuous output stream meanwhile. Measured per
level, after a warm-up:

* **frame latency in → out**: from the send of the append that completed input frame *f* (80
  ms of the model's clock) to the arrival of the model frame the step on *f* produced. The
  server runs a copy of ``duplex-tiny`` that streams every model frame (``stream_silence``) and
  never steps on silence while input flows (long ``idle_grace_ms``), so the *k*-th model frame a
  session receives is the one stepped on input frame *k + acoustic_delay*; silence the session
  inserts itself (all zeros, only when the model falls 200 ms behind) is told apart and counted;
* **real time**: model audio received per second of input (a level keeps up at ≥ 0.95 with
  no errors), and the sessions whose own p99 frame latency stays within ``--live-p99-ms``;
* **sessions in real time per core**: N over the server process's CPU use (cores: CPU seconds
  per wall second), for the levels that keep up;
* errors (``error`` events, refused connections).

Against ``--url`` (a server already running) the mapping holds only if it runs such a pipeline.

    python -m loadtest run --scenario live --sessions 1,4,8 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from websockets.asyncio.client import connect

from loadtest.commands import server_target
from loadtest.server_process import ConfigSpec, Target, server_cpu_s
from loadtest.stats import summarize
from runtime.spec import PIPELINES_DIR

PATH = "/v1/live/sessions"
RATE = 24_000
APPEND = RATE // 10  # samples per 100 ms append
MODEL_FRAME = 1920  # samples per model frame (80 ms)
WARMUP_S = 2.0


def add_live_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPT-Live sessions (--scenario live)")
    g.add_argument("--live-p99-ms", type=float, default=250.0, help="frame latency objective (p99, ms)")
    g.add_argument("--live-acoustic-delay", type=int, default=1, help="model frames before its first audio")


def streaming_pipeline(directory: Path) -> Path:
    """duplex-tiny, streaming every model frame and stepping on input only (see the docstring)."""
    spec = yaml.safe_load((PIPELINES_DIR / "duplex-tiny.yaml").read_text())
    spec["name"] = "duplex-tiny-stream"
    options = spec["stages"][0]["options"]
    options.update({"stream_silence": True, "idle_grace_ms": 5000})
    path = directory / "duplex-tiny-stream.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@dataclass(slots=True)
class LiveStats:
    latency_ms: list[float] = field(default_factory=list)
    model_s: float = 0.0
    input_s: float = 0.0
    filled_s: float = 0.0
    errors: list[str] = field(default_factory=list)


async def _session(
    target: Target, seed: int, start_at: float, until: float, warm_until: float, delay: int, key: str | None
) -> LiveStats:
    stats = LiveStats()
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rng = np.random.default_rng(seed)
    chunks = [
        base64.b64encode((rng.standard_normal(APPEND) * 3000).astype("<i2").tobytes()).decode()
        for _ in range(8)
    ]
    sent_at: list[float] = []  # wall time each append was sent
    try:
        async with connect(
            "ws" + target.base_url.removeprefix("http") + PATH, additional_headers=headers, max_size=None
        ) as ws:
            start = {
                "type": "session.start",
                "session": {"model": "gpt-live-1", "delegation": {"type": "client"}},
            }
            await ws.send(json.dumps(start))
            first = json.loads(await ws.recv())
            if first.get("type") != "session.started":
                stats.errors.append(str(first)[:200])
                return stats

            async def send() -> None:
                t0 = time.monotonic()
                i = 0
                while time.monotonic() < until:
                    await ws.send(json.dumps({"type": "session.input_audio.append", "audio": chunks[i % 8]}))
                    sent_at.append(time.monotonic())
                    i += 1
                    await asyncio.sleep(max(0.0, t0 + i / 10 - time.monotonic()))
                await ws.send(json.dumps({"type": "session.close"}))

            sender = asyncio.create_task(send())
            frames = 0
            async for raw in ws:
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "error":
                    stats.errors.append(event["error"].get("code", "?"))
                elif kind == "session.output_audio.delta":
                    now = time.monotonic()
                    pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")
                    if not pcm.any():  # silence the session inserted: the model fell behind
                        stats.filled_s += pcm.size / RATE
                        continue
                    # the k-th model frame was stepped on input frame k + delay, complete once the
                    # append holding its last sample was sent
                    last_sample = (frames + delay + 1) * MODEL_FRAME - 1
                    append = last_sample // APPEND
                    if append < len(sent_at) and sent_at[append] >= warm_until:
                        stats.latency_ms.append((now - sent_at[append]) * 1e3)
                        stats.model_s += pcm.size / RATE
                    frames += 1
                elif kind == "session.closed":
                    break
            await sender
            stats.input_s = sum(1 for t in sent_at if t >= warm_until) * APPEND / RATE
    except Exception as exc:
        stats.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    return stats


async def run_level(
    target: Target, n: int, ramp_s: float, duration_s: float, p99_ms: float, delay: int, key: str | None
) -> dict[str, Any]:
    now = time.monotonic()
    starts = [now + ramp_s * i / max(1, n) for i in range(n)]
    warm_until = now + ramp_s + WARMUP_S
    until = warm_until + duration_s
    cpu0 = server_cpu_s(target.pid) if target.pid else None
    wall0 = time.monotonic()
    runs = [_session(target, i, starts[i], until, warm_until, delay, key) for i in range(n)]
    sessions = await asyncio.gather(*runs)
    wall = time.monotonic() - wall0
    cores = (server_cpu_s(target.pid) - cpu0) / wall if target.pid and cpu0 is not None else None
    latency = [v for s in sessions for v in s.latency_ms]
    model_s = sum(s.model_s for s in sessions)
    input_s = sum(s.input_s for s in sessions)
    within = [s for s in sessions if s.latency_ms and np.percentile(s.latency_ms, 99) <= p99_ms]
    realtime = model_s / input_s if input_s else None
    errors = sum(len(s.errors) for s in sessions)
    keeps_up = bool(realtime is not None and realtime >= 0.95 and errors == 0)
    return {
        "sessions": n,
        "frame_latency_ms": summarize(latency),
        "realtime_ratio": None if realtime is None else round(realtime, 3),
        "sessions_within_p99": len(within),
        "keeps_up": keeps_up,
        "server_cores": None if cores is None else round(cores, 3),
        "sessions_per_core": round(n / cores, 1) if cores and keeps_up else None,
        "filled_s": round(sum(s.filled_s for s in sessions), 2),
        "error_count": errors,
        "errors": sorted({e for s in sessions for e in s.errors})[:10],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def _one_line(level: dict[str, Any]) -> str:
    lat = level["frame_latency_ms"]
    return (
        f"[live] N={level['sessions']:>3}: frame latency p50 {lat.get('p50')} p99 {lat.get('p99')} ms, "
        f"real time {level['realtime_ratio']}, "
        f"within p99 {level['sessions_within_p99']}/{level['sessions']}, "
        f"server {level['server_cores']} cores, {level['sessions_per_core']} sessions/core, "
        f"filled {level['filled_s']} s, errors {level['error_count']}, load {level['load_avg_1m']}"
    )


async def run_live_scenario(
    args: argparse.Namespace, results: dict[str, Any], log: Callable[[str], None]
) -> int:
    levels = (
        list(args.sessions)
        if not isinstance(args.sessions, str)
        else [int(n) for n in args.sessions.split(",")]
    )
    with tempfile.TemporaryDirectory(prefix="omniduplex-live-") as tmp:
        config: ConfigSpec | None = None
        if not args.url:
            extra = shlex.split(args.server_args) if args.server_args else []
            pipeline = ["--pipeline", str(streaming_pipeline(Path(tmp)))] if "--pipeline" not in extra else []
            config = ConfigSpec(
                args.label or "duplex-tiny-stream", [*pipeline, "--max-sessions", "256", *extra]
            )
        async with server_target(args.url, config, args.server_logs, nice=args.nice) as target:
            key = os.environ.get("OMNIDUPLEX_LOADTEST_KEY")
            delay = args.live_acoustic_delay
            await run_level(target, 1, 0.0, 1.0, args.live_p99_ms, delay, key)  # warm: the model loads
            out = []
            for n in levels:
                level = await run_level(target, n, args.ramp, args.duration, args.live_p99_ms, delay, key)
                log(_one_line(level))
                out.append(level)
    results["live"] = {
        "server_args": config.args if config else None,
        "p99_ms_objective": args.live_p99_ms,
        "levels": out,
    }
    md = Path(args.out) / f"{results['name']}-live.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render_live(results))
    log(f"live report: {md}")
    return 0 if all(lv["error_count"] == 0 for lv in out) else 1


def render_live(results: dict[str, Any]) -> str:
    live = results.get("live", {})
    lines = [f"# {results['name']}", "", f"`{results.get('command', '')}`", ""]
    lines += [
        "| N | frame latency p50 / p99 (ms) | real time | within p99 ≤ objective | server cores "
        "| sessions / core | filled (s) | errors | load 1m |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in live.get("levels", []):
        lat = lv["frame_latency_ms"]
        cells = [
            str(lv["sessions"]),
            f"{lat.get('p50')} / {lat.get('p99')}",
            str(lv["realtime_ratio"]),
            f"{lv['sessions_within_p99']}/{lv['sessions']}",
            str(lv["server_cores"]),
            str(lv["sessions_per_core"] or "—"),
            str(lv["filled_s"]),
            str(lv["error_count"]),
            str(lv["load_avg_1m"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["add_live_args", "run_live_scenario"]
