"""Gateway overhead: added latency per relayed WebSocket message, and relayed messages/s per core.

Real processes on loopback: an embedded ``redis-server`` (unix socket), an ``omniduplex
gateway`` subprocess and, as the replica behind it, either

* ``echo`` (default): a ``websockets`` echo server in its own process, registered in the
  replica registry like a replica (this process heartbeats its lease). It isolates what the
  gateway adds: the replica answers in microseconds;
* ``replica``: a real ``omniduplex serve --pipeline null`` replica; the probe is
  ``input_audio_buffer.clear`` → ``input_audio_buffer.cleared`` (a full trip through the
  session core, no model).

**Latency.** One connection straight to the replica and one through the gateway, probed in
alternation (so drift in machine load hits both alike), ``--pings`` each after a warm-up,
for two payloads: a small control event (~100 B) and a 40 ms audio delta (24 kHz PCM16 in
base64, ~2.6 KB). A round trip through the gateway relays two messages (one each way), so
added latency per relayed message = (RTT via gateway − RTT direct) / 2, reported at p50 (the
difference of the medians) and p99.

**Throughput.** ``--connections`` connections through the gateway, each keeping ``--window``
audio-delta messages in flight for ``--seconds``. Relayed messages = 2 × echoes. Per core =
relayed messages / CPU seconds the gateway process used meanwhile (user + system, psutil),
so the figure does not depend on how many cores the client and the replica took.

    .venv/bin/python -m loadtest.bench_gateway                     # echo replica
    .venv/bin/python -m loadtest.bench_gateway --target replica     # real null replica
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.typing import Subprotocol

from loadtest.report import publish
from loadtest.server_process import Child, free_port, replica_args, spawn
from loadtest.stats import summarize
from runtime.metrics import percentile
from session.affinity import ReplicaInfo, ReplicaLease, ReplicaRegistry
from session.store import EmbeddedRedis, redis_connection

# --- processes ------------------------------------------------------------------------------------


def spawn_gateway(redis_url: str, log_dir: Path) -> Child:
    port = free_port()
    args = [
        "-m",
        "web.cli",
        "gateway",
        "--redis-url",
        redis_url,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return spawn("gateway", args, log_dir, port)


def spawn_replica(
    redis_url: str, log_dir: Path, *, pipeline: str = "null", lease_s: float = 5.0, refresh_s: float = 2.0
) -> Child:
    port = free_port()
    serve = replica_args(
        redis_url,
        port,
        pipeline=pipeline,
        lease_s=lease_s,
        refresh_s=refresh_s,
        data_dir=log_dir / f"data-{port}",
    )
    args = ["-m", "web.cli", *serve, "--log-level", "warning"]
    return spawn("replica", args, log_dir, port)


async def wait_http(child: Child, path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False, timeout=1.0) as http:
        while True:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(child.url + path)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not ready in {timeout_s} s:\n{child.tail()}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def embedded_redis(tmp: Path) -> AsyncIterator[str]:
    server = EmbeddedRedis(tmp / "redis", fsync="everysec")
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


# --- the echo replica -----------------------------------------------------------------------------


async def _echo(ws: ServerConnection) -> None:
    with contextlib.suppress(Exception):
        async for message in ws:
            await ws.send(message)


async def run_echo_server(port: int) -> None:
    async with serve(_echo, "127.0.0.1", port, compression=None, max_size=None, max_queue=256):
        await asyncio.Future()


# --- probes ---------------------------------------------------------------------------------------

AUDIO_DELTA = json.dumps(
    {
        "type": "input_audio_buffer.append",
        "audio": base64.b64encode(bytes(960 * 2)).decode(),  # 40 ms of 24 kHz PCM16
    }
)
CONTROL = json.dumps({"type": "input_audio_buffer.clear", "event_id": "evt_bench_control_0001"})


async def open_ws(url: str) -> ClientConnection:
    return await connect(
        url, subprotocols=[Subprotocol("realtime")], compression=None, proxy=None, max_size=None
    )


async def rtt(ws: ClientConnection, message: str, expect: str | None) -> float:
    """One round trip; with ``expect`` (a real replica) wait for that event type."""
    t0 = time.perf_counter()
    await ws.send(message)
    while True:
        reply = await ws.recv()
        if expect is None or f'"type":"{expect}"' in str(reply).replace(" ", ""):
            return (time.perf_counter() - t0) * 1000.0


async def latency(
    direct_url: str, gateway_url: str, *, message: str, expect: str | None, pings: int
) -> dict[str, Any]:
    direct, via = await open_ws(direct_url), await open_ws(gateway_url)
    try:
        if expect is not None:  # a real replica greets first
            for ws in (direct, via):
                await ws.recv()
        for _ in range(max(50, pings // 10)):  # warm-up
            await rtt(direct, message, expect)
            await rtt(via, message, expect)
        d, g = [], []
        for _ in range(pings):
            d.append(await rtt(direct, message, expect))
            g.append(await rtt(via, message, expect))
    finally:
        await direct.close()
        await via.close()
    return {
        "bytes": len(message),
        "rtt_direct_ms": summarize(d, 3),
        "rtt_gateway_ms": summarize(g, 3),
        "added_per_message_ms_p50": round((percentile(g, 50) - percentile(d, 50)) / 2, 4),
        "added_per_message_ms_p99": round((percentile(g, 99) - percentile(d, 99)) / 2, 4),
    }


async def throughput(
    gateway_url: str, gateway_pid: int, *, connections: int, window: int, seconds: float
) -> dict[str, Any]:
    conns = [await open_ws(gateway_url) for _ in range(connections)]
    echoes = 0
    stop = asyncio.Event()

    async def pump(ws: ClientConnection) -> None:
        nonlocal echoes
        for _ in range(window):
            await ws.send(AUDIO_DELTA)
        while not stop.is_set():
            await ws.recv()
            echoes += 1
            await ws.send(AUDIO_DELTA)

    gw = psutil.Process(gateway_pid)
    tasks = [asyncio.create_task(pump(ws), name=f"bench-pump-{i}") for i, ws in enumerate(conns)]
    try:
        await asyncio.sleep(1.0)  # warm-up
        c0, e0, t0 = gw.cpu_times(), echoes, time.perf_counter()
        await asyncio.sleep(seconds)
        c1, e1, t1 = gw.cpu_times(), echoes, time.perf_counter()
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ws in conns:
            await ws.close()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    relayed = 2 * (e1 - e0)
    return {
        "connections": connections,
        "window": window,
        "seconds": round(t1 - t0, 2),
        "relayed_messages": relayed,
        "relayed_per_s_wall": round(relayed / (t1 - t0)),
        "gateway_cpu_s": round(cpu, 3),
        "gateway_cpu_utilisation": round(cpu / (t1 - t0), 2),
        "relayed_per_cpu_s": round(relayed / cpu) if cpu > 0 else None,
    }


# --- scenarios ------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="od-bench-gw-") as tmp_name:
        tmp = Path(tmp_name)
        async with embedded_redis(tmp) as redis_url, redis_connection(redis_url) as redis:
            children: list[Child] = []
            lease: ReplicaLease | None = None
            try:
                if args.target == "echo":
                    port = free_port()
                    echo = spawn(
                        "echo", ["-m", "loadtest.bench_gateway", "--echo-server", str(port)], tmp, port
                    )
                    children.append(echo)
                    lease = ReplicaLease(
                        ReplicaRegistry(redis), ReplicaInfo("rep_echo", echo.url, capacity=100_000)
                    )
                    await lease.start()
                    upstream, expect = echo, None
                    await _wait_port(echo)
                else:
                    upstream = spawn_replica(redis_url, tmp, pipeline="null")
                    children.append(upstream)
                    await wait_http(upstream, "/readyz")
                    expect = "input_audio_buffer.cleared"
                gateway = spawn_gateway(redis_url, tmp)
                children.append(gateway)
                await wait_http(gateway, "/readyz")
                direct_url = f"ws://127.0.0.1:{upstream.port}/v1/realtime"
                out: dict[str, Any] = {"target": args.target, "cpus": os.cpu_count()}
                probes = {"control": CONTROL} if expect else {"control": CONTROL, "audio_delta": AUDIO_DELTA}
                out["latency"] = {
                    name: await latency(
                        direct_url, gateway.ws_url, message=msg, expect=expect, pings=args.pings
                    )
                    for name, msg in probes.items()
                }
                if expect is None:
                    out["throughput"] = await throughput(
                        gateway.ws_url,
                        gateway.proc.pid,
                        connections=args.connections,
                        window=args.window,
                        seconds=args.seconds,
                    )
                return out
            finally:
                if lease is not None:
                    await lease.stop()
                for child in reversed(children):
                    child.stop()


async def _wait_port(child: Child, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", child.port)
            writer.close()
            await writer.wait_closed()
            return
        except OSError:
            if time.monotonic() > deadline or not child.alive():
                raise RuntimeError(f"{child.name} did not listen:\n{child.tail()}") from None
            await asyncio.sleep(0.05)


def report(out: dict[str, Any]) -> str:
    lines = [f"target: {out['target']} replica, {out['cpus']} CPUs", ""]
    lines.append(
        "| probe | bytes | RTT direct p50 ms | RTT via gateway p50 ms | added per message p50 ms | p99 ms |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, r in out["latency"].items():
        lines.append(
            f"| {name} | {r['bytes']} | {r['rtt_direct_ms']['p50']} | {r['rtt_gateway_ms']['p50']} | "
            f"{r['added_per_message_ms_p50']} | {r['added_per_message_ms_p99']} |"
        )
    t = out.get("throughput")
    if t:
        lines.append(
            f"\nthroughput: {t['relayed_per_s_wall']} relayed msgs/s wall, {t['connections']} connections "
            f"(gateway at {t['gateway_cpu_utilisation']} cores) = {t['relayed_per_cpu_s']} relayed msgs per "
            f"gateway CPU second"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["echo", "replica"], default="echo")
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--echo-server", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_server is not None:
        asyncio.run(run_echo_server(args.echo_server))
        return 0
    out = asyncio.run(run(args))
    publish(report(out), out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
