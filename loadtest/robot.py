"""Scenario ``robot``: N simulated robots on ``/v1/realtime/robot/openpi``, each a synchronous
openpi-style control loop at a fixed observation rate (10 Hz, 50 Hz).

Each robot connects, reads the metadata frame, then every ``1/rate`` seconds sends one
observation (images, state, prompt, as the metadata asks; packed once beforehand) and waits
for its action chunk, as ``openpi_client.WebsocketClientPolicy.infer`` does; a reply later
than the next tick makes the next observation go at once (a *late* tick). Measured after a
warm-up, per level (client monotonic clock):

* **infer latency**: observation sent → its reply received (p50/p99, ms), and the server's
  own ``server_timing.infer_ms`` (p50/p99);
* **chunks/s** answered (and **actions/s** = chunks × horizon), against the offered N × rate;
* late ticks and errors.

A run measures N = the ``--sessions`` levels at each rate, then the largest N whose p99 stays
within ``--robot-p99-ms`` (doubling, then bisecting), for each server configuration: by
default two servers in one run, the policy batched (``robot-pi0-tiny``, ``max_batch: 32``) and
not (``robot-pi0-tiny-b1``, ``max_batch: 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from loadtest.commands import server_target
from loadtest.server_process import ConfigSpec, Target
from loadtest.stats import summarize
from session.robot.wire import pack, unpack

PATH = "/v1/realtime/robot/openpi"
WARMUP_S = 1.0
CONFIGS = {"batched": "robot-pi0-tiny", "unbatched": "robot-pi0-tiny-b1"}


def add_robot_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("robot sessions (--scenario robot)")
    g.add_argument("--robot-rates", default="10,50", help="observation rates (Hz) to measure")
    g.add_argument(
        "--robot-p99-ms", type=float, default=100.0, help="the latency objective of the capacity search"
    )
    g.add_argument("--robot-max", type=int, default=128, help="largest N the capacity search probes")
    g.add_argument("--robot-no-capacity", action="store_true", help="measure the levels only")
    g.add_argument(
        "--robot-configs",
        default="batched,unbatched",
        help="server configurations: batched (robot-pi0-tiny), unbatched (robot-pi0-tiny-b1)",
    )
    g.add_argument("--api-key", default=None, help="Bearer key for the robots (a server with keys)")


@dataclass(slots=True)
class RobotStats:
    latency_s: list[float] = field(default_factory=list)
    infer_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    late: int = 0
    ticks: int = 0
    errors: list[str] = field(default_factory=list)
    horizon: int = 0


def _frames(meta: dict[str, Any], seed: int, count: int = 4) -> list[bytes]:
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        obs: dict[str, Any] = {
            key: rng.integers(0, 256, meta["image_shape"], dtype=np.uint8) for key in meta["image_keys"]
        }
        obs[meta["state_key"]] = rng.standard_normal(meta["state_dim"]).astype(np.float32)
        obs[meta["prompt_key"]] = "pick up the red block"
        frames.append(pack(obs))
    return frames


async def _robot(
    url: str,
    headers: dict[str, str],
    rate: float,
    phase: float,
    until: float,
    seed: int,
    stats: RobotStats,
    measure_from: float,
) -> None:
    try:
        async with connect(url, additional_headers=headers, max_size=None, compression=None) as ws:
            first = await ws.recv()
            if isinstance(first, str):
                stats.errors.append(first[:80])
                return
            meta = unpack(first)
            stats.horizon = int(meta["action_horizon"])
            frames = _frames(meta, seed)
            period = 1.0 / rate
            tick = time.monotonic() + phase
            i = 0
            while tick < until:
                delay = tick - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = time.monotonic()
                await ws.send(frames[i % len(frames)])
                reply = await ws.recv()
                got = time.monotonic()
                i += 1
                if isinstance(reply, str):
                    stats.errors.append(reply[:80])
                    return
                answer = unpack(reply)
                if "actions" not in answer:
                    stats.errors.append(str(answer.get("code", "no actions")))
                    tick += period
                    continue
                if sent >= measure_from:
                    stats.ticks += 1
                    stats.latency_s.append(got - sent)
                    stats.infer_ms.append(float(answer["server_timing"]["infer_ms"]))
                    stats.chunks += 1
                tick += period
                if tick < got:
                    if sent >= measure_from:
                        stats.late += 1
                    tick = got
    except Exception as exc:
        stats.errors.append(f"{type(exc).__name__}: {exc}"[:120])


async def run_level(
    target: Target, n: int, rate: float, duration_s: float, api_key: str | None
) -> dict[str, Any]:
    url = target.base_url.replace("http", "ws", 1) + PATH
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    measure_from = start + 1.0 / rate + WARMUP_S
    until = measure_from + duration_s
    stats = [RobotStats() for _ in range(n)]
    await asyncio.gather(
        *(_robot(url, headers, rate, (i / n) / rate, until, i, stats[i], measure_from) for i in range(n))
    )
    latency = [x * 1000.0 for s in stats for x in s.latency_s]
    infer = [x for s in stats for x in s.infer_ms]
    chunks = sum(s.chunks for s in stats)
    ticks = sum(s.ticks for s in stats)
    horizon = max((s.horizon for s in stats), default=0)
    lat = summarize(latency)
    return {
        "robots": n,
        "rate_hz": rate,
        "duration_s": duration_s,
        "latency_ms": lat,
        "server_infer_ms": summarize(infer),
        "chunks_per_s": chunks / duration_s,
        "actions_per_s": chunks * horizon / duration_s,
        "offered_per_s": n * rate,
        "late_fraction": (sum(s.late for s in stats) / ticks) if ticks else None,
        "errors": [e for s in stats for e in s.errors][:10],
        "error_count": sum(len(s.errors) for s in stats),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # the host's, at the level's end (shared host)
    }


def _ok(level: dict[str, Any], p99_ms: float) -> bool:
    p99 = level["latency_ms"].get("p99")
    return level["error_count"] == 0 and p99 is not None and p99 <= p99_ms


async def capacity(
    measure: Callable[[int], Any], p99_ms: float, max_n: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """The largest N whose p99 meets ``p99_ms``: doubling from 1, then bisecting."""
    probes: dict[int, dict[str, Any]] = {}

    async def ok(n: int) -> bool:
        if n not in probes:
            probes[n] = await measure(n)
            log(f"    capacity probe N={n}: p99 {probes[n]['latency_ms'].get('p99')} ms")
        return _ok(probes[n], p99_ms)

    good, bad = 0, None
    n = 1
    while n <= max_n:
        if await ok(n):
            good = n
            n *= 2
        else:
            bad = n
            break
    if bad is not None:
        lo, hi = good, bad
        while hi - lo > max(1, lo // 8):
            mid = (lo + hi) // 2
            if await ok(mid):
                lo = mid
            else:
                hi = mid
        good = lo
    return {
        "largest_n": good,
        "p99_ms_objective": p99_ms,
        "probes": {str(k): v for k, v in sorted(probes.items())},
    }


def _one_line(label: str, level: dict[str, Any]) -> str:
    lat, srv = level["latency_ms"], level["server_infer_ms"]
    return (
        f"[{label}] N={level['robots']:>3} @ {level['rate_hz']:g} Hz: latency p50 {lat.get('p50')} "
        f"p99 {lat.get('p99')} ms (server infer p50 {srv.get('p50')} p99 {srv.get('p99')}), "
        f"{level['chunks_per_s']:.1f}/{level['offered_per_s']:.0f} chunks/s, late {level['late_fraction']}, "
        f"errors {level['error_count']}, load {level['load_avg_1m']}"
    )


async def run_robot_scenario(
    args: argparse.Namespace, results: dict[str, Any], log: Callable[[str], None]
) -> int:
    rates = [float(r) for r in str(args.robot_rates).split(",") if r.strip()]
    levels = (
        [int(n) for n in str(args.sessions).split(",")]
        if isinstance(args.sessions, str)
        else list(args.sessions)
    )
    base = (
        shlex.split(args.server_args) if args.server_args else ["--pipeline", "null", "--max-sessions", "512"]
    )
    configs: list[tuple[str, ConfigSpec | None]] = []
    if args.url:
        configs.append((args.label or "server", None))
    else:
        for name in str(args.robot_configs).split(","):
            pipeline = CONFIGS[name.strip()]
            configs.append((name.strip(), ConfigSpec(name.strip(), [*base, "--robot-pipeline", pipeline])))
    out: list[dict[str, Any]] = []
    for label, config in configs:
        async with server_target(args.url, config, args.server_logs, nice=args.nice) as target:
            entry: dict[str, Any] = {
                "label": label,
                "server_args": config.args if config else None,
                "levels": [],
                "capacity": {},
            }
            await run_level(target, 1, 10.0, 1.0, args.api_key)  # warm: the policy loads on first use
            for rate in rates:
                for n in levels:
                    level = await run_level(target, n, rate, args.duration, args.api_key)
                    log(_one_line(label, level))
                    entry["levels"].append(level)
                if not args.robot_no_capacity:

                    async def measure(n: int, rate: float = rate) -> dict[str, Any]:
                        return await run_level(target, n, rate, args.duration, args.api_key)

                    found = await capacity(measure, args.robot_p99_ms, args.robot_max, log)
                    objective = f"p99 <= {args.robot_p99_ms:g} ms"
                    log(f"[{label}] @ {rate:g} Hz: largest N with {objective}: {found['largest_n']}")
                    entry["capacity"][f"{rate:g}"] = found
            out.append(entry)
    results["robot"] = out
    md = Path(args.out) / f"{results['name']}-robot.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render_robot(results))
    log(f"robot report: {md}")
    return 0 if all(lv["error_count"] == 0 for e in out for lv in e["levels"]) else 1


def render_robot(results: dict[str, Any]) -> str:
    lines = [f"# {results['name']}", "", f"`{results.get('command', '')}`", ""]
    lines += [
        "| config | rate (Hz) | N | latency p50 / p99 (ms) | server infer p50 / p99 (ms) "
        "| chunks/s (offered) | actions/s | late | errors | load 1m |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for entry in results.get("robot", []):
        for lv in entry["levels"]:
            lat, srv = lv["latency_ms"], lv["server_infer_ms"]
            late = lv["late_fraction"]
            cells = [
                entry["label"],
                f"{lv['rate_hz']:g}",
                str(lv["robots"]),
                f"{lat.get('p50')} / {lat.get('p99')}",
                f"{srv.get('p50')} / {srv.get('p99')}",
                f"{lv['chunks_per_s']:.1f} ({lv['offered_per_s']:.0f})",
                f"{lv['actions_per_s']:.0f}",
                "" if late is None else f"{late:.0%}",
                str(lv["error_count"]),
                str(lv.get("load_avg_1m", "")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| config | rate (Hz) | largest N with p99 ≤ objective |", "|---|---:|---:|"]
    for entry in results.get("robot", []):
        for rate, cap in entry["capacity"].items():
            lines.append(
                f"| {entry['label']} | {rate} | {cap['largest_n']} (p99 ≤ {cap['p99_ms_objective']:g} ms) |"
            )
    return "\n".join(lines) + "\n"


__all__ = ["add_robot_args", "run_robot_scenario"]
