"""A client that goes away while its request body is read (issue 33), on every body-reading
route, against real processes: ``omniduplex serve``, ``omniduplex gateway`` (with a replica)
and ``serve --workers 2`` (whose forwarder reads the body of a hangup for a call it does not
know). Each drop is one INFO line in that process's log, and no traceback anywhere (before:
starlette's ``ClientDisconnect`` escaped as "Exception in ASGI application")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio

from loadtest.server_process import Child
from tests.scaleout.cluster import cluster, replica_id_of
from tests.scaleout.workers_parent import live_workers, start_parent

pytestmark = pytest.mark.system

GONE = "the client went away during its body"
# Every route of a replica that reads a body (web/app.py, web/transports/webrtc.py, web/transports/video.py,
# web/transports/live_ws.py).
SERVE_ROUTES = [
    ("POST", "/v1/realtime/client_secrets"),
    ("POST", "/v1/realtime/calls"),
    ("POST", "/v1/realtime/video/calls"),
    ("POST", "/v1/live/sessions"),
]


async def drop_mid_body(port: int, method: str, path: str) -> None:
    """Headers promising 64 KB, 1 KB of it, a pause (the server is reading), then the socket
    closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    kind = "application/sdp" if path.startswith("/v1/live/") else "application/json"  # live: 415 first
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: 65536\r\n\r\n"
    )
    writer.write(head.encode() + b'{"session": "' + b"x" * 1000)
    await writer.drain()
    await asyncio.sleep(0.5)
    writer.transport.abort()
    del reader


def log_of(proc: Child) -> str:
    return proc.log_path.read_text(errors="replace")


async def wait_for_lines(read: Callable[[], str], paths: list[str], timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = read()
        if all(f"{path}: {GONE}" in text for path in paths) or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.1)


def assert_one_line_each_and_no_traceback(text: str, routes: list[tuple[str, str]]) -> None:
    for method, path in routes:
        lines = [line for line in text.splitlines() if f"{method} {path}: {GONE}" in line]
        assert len(lines) == 1, (method, path, text[-3000:])
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-5000:]
    assert "ClientDisconnect" not in text, text[-5000:]


async def test_a_replica_and_a_gateway_log_one_line_per_dropped_body(
    fresh_db: Callable[[], str], tmp_path: Path
) -> None:
    url = fresh_db()
    with cluster(url, tmp_path, replicas=1, extra=["--log-level", "info"]) as c:
        replica, gateway = c.replicas[0], c.gateway
        for method, path in SERVE_ROUTES:
            await drop_mid_body(replica.port, method, path)
        # The gateway reads the body before it forwards it: its own routes, and the call
        # routes of a call it knows (the call's replica in Redis, as after a create).
        client = redis.asyncio.Redis.from_url(url)
        try:
            owner = await replica_id_of(replica)
            for call_id in ("rtc_dropped", "vcall_dropped", "rtc_live_dropped"):
                await client.set(f"omni:gw:call:{call_id}", owner, ex=60)
        finally:
            await client.aclose()
        gateway_routes = [
            *SERVE_ROUTES,
            ("POST", "/v1/realtime/calls/rtc_dropped/hangup"),
            ("DELETE", "/v1/realtime/video/calls/vcall_dropped"),
            ("DELETE", "/v1/live/sessions/rtc_live_dropped"),
        ]
        for method, path in gateway_routes:
            await drop_mid_body(gateway.port, method, path)
        replica_log = await wait_for_lines(lambda: log_of(replica), [p for _, p in SERVE_ROUTES])
        gateway_log = await wait_for_lines(lambda: log_of(gateway), [p for _, p in gateway_routes])
        # Both still serve.
        for proc in (replica, gateway):
            reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await reader.read()).startswith(b"HTTP/1.1 200")
            writer.close()
    assert_one_line_each_and_no_traceback(replica_log, SERVE_ROUTES)
    assert_one_line_each_and_no_traceback(gateway_log, gateway_routes)


async def test_a_worker_forwarding_a_hangup_logs_one_line_per_dropped_body(tmp_path: Path) -> None:
    parent = start_parent(tmp_path, workers=2, log_level="info")
    try:
        await live_workers(parent, 2)  # each knows its sibling: a hangup it does not know goes there
        routes = [
            ("POST", "/v1/realtime/calls/rtc_unknown/hangup"),  # tried on the sibling: body read first
            ("DELETE", "/v1/realtime/video/calls/vcall_unknown"),
            *SERVE_ROUTES,
        ]
        for method, path in routes:
            await drop_mid_body(parent.port, method, path)
        text = await wait_for_lines(lambda: log_of(parent), [p for _, p in routes])  # read before the stop
    finally:
        parent.stop()
    assert_one_line_each_and_no_traceback(text, routes)
