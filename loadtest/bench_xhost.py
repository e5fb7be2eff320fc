"""Stages on other hosts, measured on one machine (loopback): the data plane, then the pipeline.

1. **Transfer**: a payload (an ``AudioChunk``) of 16 KiB, 1 MiB, 8 MiB and 64 MiB put by another
   process, pulled through the mooncake connector (``get``: transfer engine read + decode, and
   the same as it was before the zero-copy change, ``get_before``), the transfer engine read
   alone (the connector's read: blocking up to 256 KiB, polled above; and the engine's own
   spinning ``transfer_sync_read``), and over a raw TCP socket to the same process (one
   connection kept open): ``raw_bytes`` moves the bytes only, into one reused buffer;
   ``raw_object`` has the same semantics as the connector (the owner pickles the object, arrays
   out of band; the reader receives into a fresh buffer and unpickles). ``connector_put`` is a
   put (+ release) in the reader itself. Interleaved per rep, in an order that rotates.
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
import copy
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
from loadtest.report import write_json
from runtime.connectors import Handle
from runtime.orchestrator import Orchestrator
from runtime.remote.connector import MooncakeConnector, decode
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
from runtime.remote.connector import MooncakeConnector, decode
from runtime.remote.transfer import TransferEndpoint
sizes = [int(s) for s in sys.argv[1:]]
conn = MooncakeConnector(TransferEndpoint("127.0.0.1", 2 * sum(sizes) + (1 << 20)), inline_max=0)
raw = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
chunks = {n: AudioChunk(raw[: n // 4 * 4].view(np.float32), 24_000) for n in sizes}
server = socket.create_server(("127.0.0.1", 0))
def serve():
    while True:
        c, _ = server.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = c.recv(9, socket.MSG_WAITALL)
            if len(head) < 9:
                break
            n = int.from_bytes(head[1:], "big")
            if head[0] == 0:  # bytes: the first n bytes of the array
                c.sendall(memoryview(raw)[:n])
                continue
            buffers = []  # object: the chunk pickled as the connector does (arrays out of band)
            header = pickle.dumps(chunks[n], protocol=5, buffer_callback=buffers.append)
            data = [b.raw() for b in buffers]
            c.sendall(b"".join(x.to_bytes(8, "big") for x in (len(header), *(d.nbytes for d in data), 0)))
            c.sendall(header)
            for d in data:
                c.sendall(d)
threading.Thread(target=serve, daemon=True).start()
handles = [conn.put("bench", str(n), chunks[n]) for n in sizes]
print(server.getsockname()[1], base64.b64encode(pickle.dumps(handles)).decode(), flush=True)
sys.stdin.read()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}


class RawClient:
    """The baseline: one kept-open TCP connection to the owner, plain ``socket`` calls."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sink = bytearray(max(SIZES))

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("owner closed the raw socket")
            got += n

    def read_bytes(self, size: int) -> None:
        """``size`` bytes into one preallocated buffer, nothing decoded (reused every call)."""
        self.sock.sendall(b"\0" + size.to_bytes(8, "big"))
        self._recv_into(memoryview(self.sink)[:size])

    def read_object(self, size: int) -> Any:
        """The owner's payload pickled (protocol 5, arrays out of band) and sent; received into a
        fresh buffer (the object outlives the call, as a connector's does) and unpickled."""
        self.sock.sendall(b"\1" + size.to_bytes(8, "big"))
        lengths: list[int] = []
        while not lengths or lengths[-1]:
            head = bytearray(8)
            self._recv_into(memoryview(head))
            lengths.append(int.from_bytes(head, "big"))
        lengths.pop()
        data = np.empty(sum(lengths), np.uint8)
        self._recv_into(data.data)
        view, spans, at = data.data, [], 0
        for n in lengths:
            spans.append(view[at : at + n])
            at += n
        return pickle.loads(spans[0], buffers=spans[1:])

    def close(self) -> None:
        self.sock.close()


def get_before(conn: MooncakeConnector, handle: Handle) -> Any:
    """The connector's pull as it was before the change (kept here for the before/after pair):
    the engine's blocking ``transfer_sync_read`` (which spins on the status), a copy of the
    scratch slice out into a ``bytearray``, decode, free the slice."""
    ref, pool = handle.ref, conn.endpoint.pool
    scratch = pool.alloc(ref.nbytes)
    try:
        rc = conn.endpoint._engine.transfer_sync_read(
            ref.owner, conn.endpoint.address(scratch), ref.address, ref.nbytes
        )
        if rc < 0:
            raise RuntimeError(f"transfer_sync_read: {rc}")
        data = bytearray(conn.endpoint.view(scratch, ref.nbytes))
    finally:
        pool.free(scratch)
    return decode(data, ref)


def measure_size(
    reader: MooncakeConnector, raw: RawClient, size: int, handle: Handle, reps: int
) -> dict[str, Any]:
    ref = handle.ref
    scratch = reader.endpoint.pool.alloc(ref.nbytes)
    local = copy.deepcopy(reader.get(handle))  # the same payload in this process, to put it
    cases: dict[str, Any] = {
        "connector_get": lambda: reader.get(handle),
        "connector_get_before": lambda: get_before(reader, handle),
        "engine_read": lambda: reader.endpoint.read(ref.owner, ref.address, scratch, ref.nbytes),
        "engine_sync_read": lambda: reader.endpoint._engine.transfer_sync_read(
            ref.owner, reader.endpoint.address(scratch), ref.address, ref.nbytes
        ),
        "raw_bytes": lambda: raw.read_bytes(size),
        "raw_object": lambda: raw.read_object(size),
        "connector_put": lambda: reader.release(reader.put("bench", "p", local)),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(reps + 1):  # the first of each is a warm-up (connection, segment lookup)
        # the order rotates every rep: no case is always the one that wakes the owner up
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            call = cases[name]
            t = time.perf_counter()
            got = call()
            elapsed = time.perf_counter() - t
            del got
            if rep:
                samples[name].append(elapsed)
    assert reader.health()["lent_bytes"] == 0, "a pulled payload kept its slice"
    reader.endpoint.pool.free(scratch)
    out: dict[str, Any] = {"reps": reps, "bytes": ref.nbytes}
    for name, values in samples.items():
        p50 = statistics.median(values)
        out[name] = {
            "p50_us": p50 * 1e6,
            "gib_s": size / p50 / 2**30,
            "p10_us": float(np.percentile(values, 10)) * 1e6,
            "p90_us": float(np.percentile(values, 90)) * 1e6,
        }
    return out


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
        # 256 MiB + 1 MiB: the default pool (--pool-mb), so a quarter (lend_max) holds 64 MiB
        reader = MooncakeConnector(TransferEndpoint("127.0.0.1", (256 << 20) + (1 << 20)))
        raw = RawClient(int(port))
        out: dict[str, Any] = {}
        for size, handle in zip(SIZES, handles, strict=True):
            n = reps if size <= 1 << 20 else max(5, reps // 5) if size <= 8 << 20 else max(3, reps // 10)
            out[str(size)] = measure_size(reader, raw, size, handle, n)
        raw.close()
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
    def cell(row: dict[str, Any]) -> str:
        return f"{row['p50_us']:.0f} µs ({row['gib_s']:.2f} GiB/s)"

    lines = [
        "| size | connector get | get, before | engine read | engine sync read | raw bytes | raw object"
        " | get / raw bytes | get / raw object | before / raw bytes | connector put |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, row in report["transfer"].items():
        label = f"{int(size) >> 10} KiB" if int(size) < 1 << 20 else f"{int(size) >> 20} MiB"
        g, b = row["connector_get"]["gib_s"], row["connector_get_before"]["gib_s"]
        rb, ro = row["raw_bytes"]["gib_s"], row["raw_object"]["gib_s"]
        lines.append(
            f"| {label} | {cell(row['connector_get'])} | {cell(row['connector_get_before'])}"
            f" | {cell(row['engine_read'])} | {cell(row['engine_sync_read'])} | {cell(row['raw_bytes'])}"
            f" | {cell(row['raw_object'])} | {g / rb:.0%} | {g / ro:.0%} | {b / rb:.0%}"
            f" | {row['connector_put']['p50_us']:.0f} µs |"
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
    parser.add_argument(
        "--reps", type=int, default=50, help="pulls per size (a fifth for 8 MiB, a tenth for 64 MiB)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--pairs", type=int, default=3, help="interleaved local/remote waves per concurrency")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--skip-transfer", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report: dict[str, Any] = {"load_before": os.getloadavg(), "transfer": {}}
    if not args.skip_transfer:
        report["transfer"] = transfer_bench(args.reps)
    if not args.skip_pipeline:
        report["pipeline"] = asyncio.run(pipeline_bench(args))
    report["load_after"] = os.getloadavg()
    print(markdown(report))
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    write_json(args.out, report, default=float)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
