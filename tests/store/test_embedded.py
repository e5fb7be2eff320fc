"""The embedded redis-server: start, reuse, stop, and kill -9 + restart keeps sessions (AOF)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis.asyncio

from session.store import EmbeddedRedis, SessionStore, SessionWriter, redis_connection
from session.store.embedded import pid_alive

pytestmark = pytest.mark.system


async def test_start_ping_stop_leaves_nothing(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "od")
    url = await server.start()
    pid = server.pid
    try:
        assert url.startswith("unix://")
        assert pid is not None and pid_alive(pid)
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        assert await client.ping()
        assert (await client.config_get("appendonly"))["appendonly"] == "yes"
        assert (await client.config_get("appendfsync"))["appendfsync"] == "always"
        assert (await client.config_get("port"))["port"] == "0"  # no TCP socket
        await client.aclose()
    finally:
        await server.stop()
    assert not pid_alive(pid)
    assert not (tmp_path / "od" / "redis.pid").exists()
    await server.stop()  # idempotent


async def test_reuses_running_server_from_same_dir(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "od")
    await first.start()
    second = EmbeddedRedis(tmp_path / "od")
    try:
        await second.start()
        assert second.reused and second.pid == first.pid
    finally:
        await second.stop()
        await first.stop()
    assert first.pid is None


async def test_stale_pidfile_is_replaced(tmp_path: Path) -> None:
    data = tmp_path / "od"
    data.mkdir()
    (data / "redis.pid").write_text("999999\n")
    server = EmbeddedRedis(data)
    await server.start()
    try:
        assert not server.reused and server.pid != 999999
    finally:
        await server.stop()


async def test_kill_dash_nine_and_restart_keeps_session_and_events(tmp_path: Path) -> None:
    data = tmp_path / "od"
    async with redis_connection(None, data_dir=data) as client:
        store = SessionStore(client)
        record, token = await store.create_session("tenantA", {"instructions": "be brief"})
        writer = SessionWriter(store, record)
        sent = [writer.append({"type": "response.output_text.delta", "delta": f"w{i}"}) for i in range(20)]
        writer.put_item({"id": "item_1", "type": "message", "role": "user", "content": [{"text": "hi"}]})
        await writer.close()
        pid = int((data / "redis.pid").read_text())
        os.kill(pid, signal.SIGKILL)  # crash: no clean shutdown, no final fsync
    assert (data / "redis.pid").exists()  # stale pidfile left behind

    server = EmbeddedRedis(data)
    await server.start()
    try:
        assert not server.reused and server.pid != pid
        client2 = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
        store2 = SessionStore(client2)
        again = await store2.authorize_resume("tenantA", record.session_id, token)
        assert again.config == {"instructions": "be brief"} and again.event_seq == 20
        assert await store2.events_after(record.session_id, sent[4]["event_id"]) == sent[5:]
        snap = await store2.load_snapshot("tenantA", record.session_id)
        assert [i["id"] for i in snap.items] == ["item_1"]
        # the conversation continues where it was
        w2 = SessionWriter(store2, again)
        more = w2.append({"type": "response.done"})
        await w2.close()
        assert more["event_id"].endswith("_21")
        await client2.aclose()
    finally:
        await server.stop()
