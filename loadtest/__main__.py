"""``python -m loadtest`` / ``omniduplex-loadtest``: run, compare, capacity, report.

    python -m loadtest run --server-args "--pipeline null --max-sessions 256" --sessions 200 ...
    python -m loadtest compare --config "A=--pipeline x" --config "B=--pipeline x --edge-mode a->b=full"
    python -m loadtest capacity --server-args "--pipeline voice-cascade" --slo "ttfa_p95_ms<=1500,..."
    python -m loadtest report docs/loadtest/null-ws.json     # redraw Markdown and plots
    python -m loadtest run --scenario robot --sessions 1,8,32  # robots at 10/50 Hz, batched vs not
    python -m loadtest run --scenario live --sessions 1,4,8    # GPT-Live sessions on duplex-tiny

Exit status: 0 when every objective given with ``--slo`` held (``run``, ``compare``), 1 when one
failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shlex
import sys
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.commands import comparison, find_capacity, run_levels, server_target, speech_bank
from loadtest.live import add_live_args, run_live_scenario
from loadtest.results import dumps, load, new_results, write_outputs
from loadtest.robot import add_robot_args, run_robot_scenario
from loadtest.server_process import ConfigSpec, Target
from loadtest.slo import Objective, parse_slo
from loadtest.speech import SpeechBank
from loadtest.workload import Workload, add_workload_args, workload_from_args


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--name", default=None, help="results name (default: <command>-<UTC time>)")
    g.add_argument("--out", type=Path, default=Path("loadtest-results"), help="JSON and Markdown directory")
    g.add_argument("--plots", type=Path, default=None, help="PNG directory (default: --out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--piper-cache", type=Path, default=Path(".omniduplex/loadtest-cache"))
    g.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the load generator and started servers at this niceness (negative needs root): "
        "on a shared host, keeps unrelated jobs from distorting the measurement",
    )
    g.add_argument(
        "--server-logs", type=Path, default=Path(".omniduplex/loadtest-logs"), help="logs of started servers"
    )
    g.add_argument("--slo", default="", help="objectives, e.g. 'ttfa_p95_ms<=1500,underruns==0,errors==0'")


def _server(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (one of)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--url", default=None, help="a running server, http://host:port (default 127.0.0.1:8000)")
    x.add_argument("--server-args", default=None, help="start `omniduplex serve ARGS` for the run")
    g.add_argument("--label", default=None, help="name of this configuration in reports")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the workload at one or more concurrency levels")
    _server(run)
    add_workload_args(run)
    add_robot_args(run)
    add_live_args(run)
    _common(run)
    cmp = sub.add_parser("compare", help="two server configurations in turn, same workload, ratios")
    cmp.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="LABEL=SERVER_ARGS",
        help="twice: baseline first (e.g. 'async_chunk=--pipeline qwen3-omni-tiny')",
    )
    add_workload_args(cmp)
    _common(cmp)
    cap = sub.add_parser("capacity", help="bisect the largest N that meets --slo")
    _server(cap)
    add_workload_args(cap, levels=False)
    cap.add_argument("--start", type=int, default=1, help="first N probed (then doubled)")
    cap.add_argument("--max", type=int, default=256, help="largest N probed")
    cap.add_argument("--resolution", type=int, default=1, help="stop bisecting within this many sessions")
    _common(cap)
    rep = sub.add_parser("report", help="re-render Markdown and plots from a results JSON")
    rep.add_argument("results", type=Path)
    rep.add_argument("--plots", type=Path, default=None)
    return parser


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    # The load generator times every delta it receives: like the server (web.server.context), it
    # keeps the cyclic GC from stopping its loop every second with hundreds of sessions.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _cmd_run(args: argparse.Namespace, results: dict[str, Any]) -> int:
    if args.scenario == "robot":  # its own runner: robot control loops, two server configs
        return await run_robot_scenario(args, results, _log)
    if args.scenario == "live":  # its own runner: GPT-Live sessions streaming in real time
        return await run_live_scenario(args, results, _log)
    workload = workload_from_args(args)
    objectives = parse_slo(args.slo)
    bank = speech_bank(workload, args.piper_cache)
    config = ConfigSpec(args.label or "server", shlex.split(args.server_args)) if args.server_args else None
    async with server_target(args.url, config, args.server_logs, nice=args.nice) as target:
        if args.label:
            target.label = args.label
        results["levels"] = await _levels(target, workload, bank, objectives, args)
    return 0 if all(lv.get("slo_ok", True) for lv in results["levels"]) else 1


async def _levels(
    target: Target,
    workload: Workload,
    bank: SpeechBank,
    objectives: list[Objective],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """The session-count levels of ``args.sessions`` against one server."""
    return await run_levels(
        target,
        workload,
        args.sessions,
        bank,
        objectives=objectives,
        progress=not args.no_progress,
        log=_log,
    )


async def _cmd_compare(args: argparse.Namespace, results: dict[str, Any]) -> int:
    configs = [ConfigSpec.parse(c) for c in args.config]
    if len(configs) != 2:
        raise ValueError("compare needs exactly two --config")
    workload = workload_from_args(args)
    objectives = parse_slo(args.slo)
    bank = speech_bank(workload, args.piper_cache)
    for config in configs:
        async with server_target(None, config, args.server_logs, nice=args.nice) as target:
            results["levels"] += await _levels(target, workload, bank, objectives, args)
    results["comparison"] = comparison(results["levels"], configs[0].label, configs[1].label)
    return 0 if all(lv.get("slo_ok", True) for lv in results["levels"]) else 1


async def _cmd_capacity(args: argparse.Namespace, results: dict[str, Any]) -> int:
    objectives = parse_slo(args.slo)
    if not objectives:
        raise ValueError("capacity needs --slo")
    workload = workload_from_args(args, sessions=args.start)
    bank = speech_bank(workload, args.piper_cache)
    config = ConfigSpec(args.label or "server", shlex.split(args.server_args)) if args.server_args else None
    async with server_target(args.url, config, args.server_logs, nice=args.nice) as target:
        if args.label:
            target.label = args.label
        results["levels"], results["capacity"] = await find_capacity(
            target,
            workload,
            bank,
            objectives=objectives,
            start=args.start,
            max_n=args.max,
            resolution=args.resolution,
            progress=not args.no_progress,
            log=_log,
        )
    _log(f"capacity: {results['capacity']['capacity']} sessions ({results['capacity']['slo']})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command == "report":
        data = load(args.results)
        written = write_outputs(data, args.results.parent, args.plots or args.results.parent)
        _log("\n".join(str(p) for p in written.values()))
        return 0
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    name = args.name or f"{args.command}-{stamp}"
    results = new_results(args.command, name, "python -m loadtest " + shlex.join(argv))
    if args.nice:
        os.nice(args.nice)  # before any thread starts: Linux niceness is per thread, inherited
        results["nice"] = args.nice
    runner = {"run": _cmd_run, "compare": _cmd_compare, "capacity": _cmd_capacity}[args.command]
    try:
        code = _run_async(runner(args, results))
    except (ValueError, NotImplementedError) as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "scenario", None) in ("robot", "live"):  # reports written by their modules
        args.out.mkdir(parents=True, exist_ok=True)
        json_path = args.out / f"{name}.json"
        json_path.write_text(dumps(results))
        _log(f"results: {json_path}")
        return code
    written = write_outputs(results, args.out, args.plots or args.out)
    _log(f"results: {written['json']}\nreport:  {written['markdown']}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
