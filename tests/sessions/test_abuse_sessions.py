"""Issue 13 points 3 to 5 on a real server (real redis-server): one session's unwritable data
fails that session alone, a client that stops reading is cut off (bytes, then a deadline), and
no admission slot outlives its session."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psutil
import pytest
import redis.asyncio
import websockets
from websockets.asyncio.client import ClientConnection

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import opened, realtime_url, until, user_text
from tests.sessions.conftest import on_server_async, session_server

pytestmark = pytest.mark.system

ITEM_TEXT = "w" * (1900 * 1024)  # the 1.9 MB item (one frame under the 2 MiB limit)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"),
        module_redis.url,
        max_sessions=2,
        disconnect_grace_s=1.0,
        outbox_max_bytes=4 << 20,
        event_log_max_bytes=8 << 20,
        ws_send_timeout_s=2.0,
    ) as live:
        yield live


async def slots_in_use(server: LiveServer) -> int:
    counts = await on_server_async(server, server.ctx.host.admission.counts())
    return int(counts.replica_active)


async def redis_used(url: str) -> int:
    client = redis.asyncio.Redis.from_url(url)
    try:
        return int((await client.info("memory"))["used_memory"])
    finally:
        await client.aclose()


@asynccontextmanager
async def silent_client(server: LiveServer) -> AsyncIterator[tuple[ClientConnection, str]]:
    """A session whose client reads its first events and one 1.9 MB item's, then stops
    reading (max_queue=1: the client library buffers one message, then TCP backs up)."""
    sock = socket.socket()  # a small receive window: the loopback default grows to 32 MB
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", server.settings.port))
    sock.setblocking(False)
    async with websockets.connect(
        realtime_url(server), sock=sock, max_size=None, max_queue=1, open_timeout=20, compression=None
    ) as ws:
        session_id = ""
        while not session_id:
            event = json.loads(await asyncio.wait_for(ws.recv(), 20))
            if event["type"] == "session.created":
                session_id = event["session"]["id"]
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ITEM_TEXT}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {**item, "id": "item_big"}}))
        while json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] != "conversation.item.done":
            pass
        yield ws, session_id


async def retrieve_flood(ws: ClientConnection, n: int = 100) -> None:
    frame = json.dumps({"type": "conversation.item.retrieve", "item_id": "item_big"})
    for _ in range(n):  # 100 × 55 bytes sent, 100 × 1.9 MB asked for
        await ws.send(frame)


# --- point 3: a session whose data cannot be stored fails alone; its slot comes back --------------


async def test_unwritable_session_fails_alone_and_frees_its_slot(server: LiveServer) -> None:
    async with opened(server) as bad, opened(server) as good:
        assert await slots_in_use(server) == 2
        hs = server.ctx.host.sessions[bad.session_id]

        async def inject() -> None:  # what a lone surrogate did before the edge refused it
            hs.writer.put_item({"id": "\ud800x", "type": "message"})

        await on_server_async(server, inject())
        error = await bad.events.wait_for("error", within_s=10)
        assert (
            error.raw["error"]["code"] == "session_failed" and "\ud800" not in error.raw["error"]["message"]
        )
        assert await bad.events.close_code(10) == 1011
        item = await user_text(good, "the other session keeps persisting")
        await on_server_async(server, server.ctx.host.sessions[good.session_id].writer.flush())
        stored = await on_server_async(server, server.ctx.host.store.list_items(good.session_id))
        assert [i["id"] for i in stored] == [item]
        await until(lambda: _eq(slots_in_use(server), 1), within_s=10)
        async with opened(server) as third:  # the slot is really back: a --max-sessions 2 server opens
            await user_text(third, "admitted")


async def _eq(value: Any, expected: int) -> bool:
    """For `until`: whether the awaited `value` equals `expected`."""
    return bool(await value == expected)


# --- point 4: retrieve amplification bounded in bytes, server and Redis ------------------------------


async def test_retrieve_amplification_is_bounded(
    server: LiveServer, module_redis: RedisServerProcess
) -> None:
    proc = psutil.Process()
    redis_before, rss_before = await redis_used(module_redis.url), proc.memory_info().rss
    async with silent_client(server) as (ws, session_id):
        before_flood = await redis_used(module_redis.url)
        await retrieve_flood(ws)
        # closed 1008 (outbox over 4 MiB) or at the send deadline: the session detaches
        await until(
            lambda: (
                session_id not in server.ctx.host.sessions
                or not server.ctx.host.sessions[session_id].connected
            ),
            within_s=20,
        )
        redis_growth = await redis_used(module_redis.url) - redis_before
        rss_growth = proc.memory_info().rss - rss_before
        # The item's own cost (its record, and its added/done events: ~8.7 MB measured); each
        # retrieve's log entry is a reference (before: the 1.9 MB reply, up to the log's 8 MiB).
        assert redis_growth < 12 << 20, f"Redis grew by {redis_growth >> 20} MB"
        flood_growth = await redis_used(module_redis.url) - before_flood
        assert flood_growth < 1 << 20, f"100 retrieves grew Redis by {flood_growth} bytes"
        assert rss_growth < 64 << 20, f"the server grew by {rss_growth >> 20} MB"
        await until(lambda: _eq(slots_in_use(server), 0), within_s=15)  # grace over: parked, slot back
    assert session_id not in server.ctx.host.sessions


async def test_retrieves_read_in_full_copy_nothing_into_redis(
    server: LiveServer, module_redis: RedisServerProcess
) -> None:
    """Issue 33: 40 retrieves of the 1.9 MB item by a client that reads every one grew the
    server and Redis by ~110 MB each (every reply logged in full). Now: the item once in Redis,
    and server + Redis RSS within the 64 MB per abusive session."""
    redis_proc = psutil.Process(module_redis.proc.pid)
    proc = psutil.Process()
    async with opened(server) as conn:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ITEM_TEXT}]}
        await conn.send({"type": "conversation.item.create", "item": {**item, "id": "item_big"}})
        await conn.events.wait_for("conversation.item.done", within_s=20)
        await on_server_async(server, server.ctx.host.sessions[conn.session_id].writer.flush())
        used_before = await redis_used(module_redis.url)
        rss_before = proc.memory_info().rss + redis_proc.memory_info().rss
        peak = 0
        for _ in range(20):  # two at a time: this server's outbox holds 4 MiB
            for _ in range(2):
                await conn.send({"type": "conversation.item.retrieve", "item_id": "item_big"})
            for _ in range(2):
                got = await conn.events.wait_for("conversation.item.retrieved", within_s=20)
                assert len(got.raw["item"]["content"][0]["text"]) == len(ITEM_TEXT)
            conn.events.log.clear()  # the test's own copies: not the server's
            peak = max(peak, proc.memory_info().rss + redis_proc.memory_info().rss - rss_before)
        await on_server_async(server, server.ctx.host.sessions[conn.session_id].writer.flush())
        used_growth = await redis_used(module_redis.url) - used_before
        assert used_growth < 256 << 10, f"40 retrieves grew Redis by {used_growth} bytes"
        assert peak < 64 << 20, f"server + Redis RSS grew by {peak >> 20} MB"


# --- point 5: a client that stops reading is closed at the send deadline -------------------------------


@pytest.fixture(scope="module")
def stall_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    """An outbox budget too large to matter: only the send deadline can end a silent client."""
    with session_server(
        tmp_path_factory.mktemp("srv3"),
        module_redis.url,
        max_sessions=2,
        disconnect_grace_s=1.0,
        outbox_max_bytes=512 << 20,
        ws_send_timeout_s=1.5,
    ) as live:
        yield live


async def test_client_that_stops_reading_is_dropped_at_the_deadline(
    stall_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = stall_server
    caplog.set_level(logging.INFO, logger="web.edge.uvicorn_guards")
    async with silent_client(server) as (ws, session_id):
        await retrieve_flood(ws, n=20)  # ~38 MB asked for: far more than the socket buffers hold
        started = time.monotonic()
        await until(lambda: not server.ctx.host.sessions[session_id].connected, within_s=15)
        assert time.monotonic() - started < 10
        await until(lambda: _eq(slots_in_use(server), 0), within_s=15)  # grace over: parked
    assert any("closed 1008" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def patient_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    """Deadlines far away (outbox, send, grace): only the idle TTL can end a silent session."""
    with session_server(
        tmp_path_factory.mktemp("srv2"),
        module_redis.url,
        max_sessions=2,
        idle_ttl_s=3.0,
        disconnect_grace_s=60.0,
        outbox_max_bytes=256 << 20,
        ws_send_timeout_s=120.0,
    ) as live:
        yield live


async def test_idle_ttl_frees_the_slot_of_a_session_whose_client_stopped_reading(
    patient_server: LiveServer,
) -> None:
    server = patient_server
    async with silent_client(server) as (ws, session_id):
        await retrieve_flood(ws, n=5)
        started = time.monotonic()
        await until(lambda: _eq(slots_in_use(server), 0), within_s=20)  # TTL 3 s + bounded close
        assert time.monotonic() - started < 15
        assert session_id not in server.ctx.host.sessions
        assert ws.transport is not None and not ws.transport.is_closing()  # the socket itself still open
