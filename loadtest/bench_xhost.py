"""Stages on other hosts, measured on one machine (loopback): the data plane, then the pipeline.

1. **Transfer**: a payload of 16 KiB, 1 MiB, 8 MiB and 64 MiB put by another process, pulled
   through the mooncake connector (``get``: transfer engine read + decode), the transfer engine
   read alone, and the same bytes over a raw TCP socket to the same process (one connection
   kept open, a length asked for and received into a preallocated buffer). Interleaved per rep.
2. **Pipeline**: qwen3-omni-tiny with every stage local against talker and code2wav on two
   ``omniduplex stage`` processes (a real redis-server, the registry, the zmq control plane),
   TTFA and RTF per request at each concurrency, in interleaved pairs (local, remote, local, ...).
   Both orchestrators live in this process; the idle one costs nothing.

    .venv/bin/python -m loadtest.bench_xhost --out bench_xhost.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from loadtest.bench_qwen import RequestTiming, summarize, wave
from runtime.connectors import Handle
from runtime.orchestrator import Orchestrator
from runtime.remote.connector import MooncakeConnector
from runtime.remote.orchestrator import RemoteOrchestrator
from runtime.remote.transfer import TransferEndpoint
from runtime.spec import load_pipeline
from session.stage_registry import registry_lister
from session.store.embedded import find_redis_server

ROOT = Path(__file__).resolve().parents[1]
SIZES = (16 << 10, 1 << 20, 8 << 20, 64 << 20)

OWNER = """
import base64, pickle, socket, sys, threading
import numpy as np
from runtime.payloads import AudioChunk
from runtime.remote.connector import MooncakeConnector
from runtime.remote.transfer import TransferEndpoint
sizes = [int(s) for s in sys.argv[1:]]
conn = MooncakeConnector(TransferEndpoint("127.0.0.1", 2 * sum(sizes) + (1 << 20)), inline_max=0)
raw = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
server = socket.create_server(("127.0.0.1", 0))
def serve():
    while True:
        c, _ = server.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = c.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                break
            c.sendall(memoryview(raw)[: int.from_bytes(head, "big")])
threading.Thread(target=serve, daemon=True).start()
handles = [conn.put("bench", str(n), AudioChunk(raw[: n // 4 * 4].view(np.float32), 24_000)) for n in sizes]
print(server.getsockname()[1], base64.b64encode(pickle.dumps(handles)).decode(), flush=True)
sys.stdin.read()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}


def transfer_bench(reps: int) -> dict[str, Any]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, *map(str, SIZES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert owner.stdout is not None
        port, blob = owner.stdout.readline().split()
        handles: list[Handle] = pickle.loads(base64.b64decode(blob))
        reader = MooncakeConnector(TransferEndpoint("127.0.0.1", 2 * max(SIZES) + (1 << 20)))
        sock = socket.create_connection(("127.0.0.1", int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = bytearray(max(SIZES))
        out: dict[str, Any] = {}
        for size, handle in zip(SIZES, handles, strict=True):
            n = reps if size <= 1 << 20 else max(3, reps // 10)
            get_s, read_s, raw_s = [], [], []
            scratch = reader.endpoint.pool.alloc(handle.ref.nbytes)
            for rep in range(n + 1):  # the first of each is a warm-up (connection, segment lookup)
                t = time.perf_counter()
                reader.get(handle)
                t1 = time.perf_counter()
                reader.endpoint.read(handle.ref.owner, handle.ref.address, scratch, handle.ref.nbytes)
                t2 = time.perf_counter()
                sock.sendall(size.to_bytes(8, "big"))
                view, got = memoryview(sink), 0
                while got < size:
                    got += sock.recv_into(view[got:size])
                t3 = time.perf_counter()
                if rep:
                    get_s.append(t1 - t)
                    read_s.append(t2 - t1)
                    raw_s.append(t3 - t2)
            reader.endpoint.pool.free(scratch)

            def figures(samples: list[float], size: int = size) -> dict[str, float]:
                p50 = statistics.median(samples)
                return {"p50_us": p50 * 1e6, "gib_s": size / p50 / 2**30}

            out[str(size)] = {
                "reps": n,
                "connector_get": figures(get_s),
                "engine_read": figures(read_s),
                "raw_socket": figures(raw_s),
            }
        sock.close()
        reader.close()
        return out
    finally:
        owner.kill()
        owner.wait(10)


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_host(stage: str, redis_url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "web.cli",
            "stage",
            "--pipeline",
            "qwen3-omni-tiny",
            "--stage",
            stage,
            "--redis-url",
            redis_url,
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


async def pipeline_bench(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench_xhost"))
    redis_proc, url = start_redis(tmp)
    hosts = [start_host(stage, url) for stage in ("talker", "code2wav")]
    redis = Redis.from_url(url, decode_responses=True)
    spec = load_pipeline("qwen3-omni-tiny")
    local = Orchestrator.from_spec(spec)
    remote = RemoteOrchestrator(
        spec, remote=["talker", "code2wav"], lister=registry_lister(redis, spec.name), keys=None
    )
    try:
        await local.start()
        await remote.start()
        deadline = time.monotonic() + 180
        while not all(
            any(m.replica.ready for m in s.members.values()) for s in remote.remote.stages.values()
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage hosts did not join: {remote.remote.refused}")
            await asyncio.sleep(0.2)
        runs: dict[str, dict[int, list[RequestTiming]]] = {"local": {}, "remote": {}}
        await wave(local, 1, args.tokens, args.frames, None)  # warm-ups
        await wave(remote, 1, args.tokens, args.frames, None)
        for _ in range(args.pairs):
            for concurrency in args.concurrency:
                for name, orch in (("local", local), ("remote", remote)):
                    timings = await wave(orch, concurrency, args.tokens, args.frames, None)
                    runs[name].setdefault(concurrency, []).extend(timings)
        report: dict[str, Any] = {}
        for concurrency in args.concurrency:
            a, b = summarize(runs["local"][concurrency]), summarize(runs["remote"][concurrency])
            report[str(concurrency)] = {
                "local": {k: v for k, v in a.items() if k != "requests"},
                "remote": {k: v for k, v in b.items() if k != "requests"},
                "ttfa_ratio": b["ttfa_ms_median"] / a["ttfa_ms_median"],
            }
        calls = {row["stage"]: row["calls"] for row in remote.remote.snapshot()}
        report["remote_calls"] = calls
        return report
    finally:
        await remote.close()
        await local.close()
        await redis.aclose()
        for proc in hosts:
            proc.terminate()
        for proc in hosts:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis_proc.terminate()
        redis_proc.wait(10)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| size | connector get p50 | engine read p50 | raw socket p50 | get / raw throughput |",
        "|---|---|---|---|---|",
    ]
    for size, row in report["transfer"].items():
        g, r, s = row["connector_get"], row["engine_read"], row["raw_socket"]
        label = f"{int(size) >> 10} KiB" if int(size) < 1 << 20 else f"{int(size) >> 20} MiB"
        lines.append(
            f"| {label} | {g['p50_us']:.0f} µs ({g['gib_s']:.2f} GiB/s)"
            f" | {r['p50_us']:.0f} µs ({r['gib_s']:.2f} GiB/s)"
            f" | {s['p50_us']:.0f} µs ({s['gib_s']:.2f} GiB/s) | {g['gib_s'] / s['gib_s']:.0%} |"
        )
    if "pipeline" in report:
        lines += [
            "",
            "| concurrency | TTFA local p50 | TTFA remote p50 | ratio | RTF max local | RTF max remote |",
            "|---|---|---|---|---|---|",
        ]
        for c, row in report["pipeline"].items():
            if c == "remote_calls":
                continue
            lo, re_ = row["local"], row["remote"]
            lines.append(
                f"| {c} | {lo['ttfa_ms_median']:.0f} ms | {re_['ttfa_ms_median']:.0f} ms"
                f" | {row['ttfa_ratio']:.2f} | {lo['rtf_max']:.2f} | {re_['rtf_max']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--reps", type=int, default=50, help="pulls per size (a tenth for 8 and 64 MiB)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--pairs", type=int, default=3, help="interleaved local/remote waves per concurrency")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--skip-pipeline", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report: dict[str, Any] = {"load_before": os.getloadavg(), "transfer": transfer_bench(args.reps)}
    if not args.skip_pipeline:
        report["pipeline"] = asyncio.run(pipeline_bench(args))
    report["load_after"] = os.getloadavg()
    print(markdown(report))
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
