"""Retention on short settings: idle TTL (connected, and parked), maximum lifetime, disconnect
grace (an in-flight response cancelled after it, the session still resumable)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio
from websockets.exceptions import ConnectionClosed, InvalidStatus

from session.store.keys import session_keys
from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import opened, resumed, turn, until
from tests.sessions.conftest import session_server

pytestmark = pytest.mark.system

IDLE_S = 1.5
GRACE_S = 0.4
LIFETIME_S = 3.0


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"),
        module_redis.url,
        audio_ms=3000,
        idle_ttl_s=IDLE_S,
        disconnect_grace_s=GRACE_S,
        max_lifetime_s=LIFETIME_S,
    ) as live:
        yield live


async def keys_left(url: str, session_id: str) -> int:
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(url)
    try:
        return int(await client.exists(*session_keys(session_id).all()))
    finally:
        await client.aclose()


async def status(server: LiveServer, session_id: str) -> int:
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        return (await http.get(f"/v1/sessions/{session_id}")).status_code


async def gone(server: LiveServer, session_id: str) -> bool:
    return await status(server, session_id) == 404


async def test_connected_but_idle_session_expires(
    server: LiveServer, module_redis: RedisServerProcess
) -> None:
    t0 = time.monotonic()
    async with opened(server) as conn:
        error = (await conn.events.wait_for("error", within_s=IDLE_S + 3)).raw["error"]
        assert error["code"] == "session_expired" and "idle" in error["message"]
        assert await conn.events.close_code(within_s=5) == 1001
    assert IDLE_S - 0.1 < time.monotonic() - t0 < IDLE_S + 2.5
    await until(lambda: gone(server, conn.session_id), within_s=5)
    assert await keys_left(module_redis.url, conn.session_id) == 0


async def test_parked_session_is_gone_after_the_idle_ttl(
    server: LiveServer, module_redis: RedisServerProcess
) -> None:
    async with opened(server) as conn:
        pass  # clean close: parked, resumable until the idle TTL
    assert await status(server, conn.session_id) == 200
    await asyncio.sleep(IDLE_S + 0.5)
    assert await keys_left(module_redis.url, conn.session_id) == 0  # Redis's own TTL did it
    assert await status(server, conn.session_id) == 404
    with pytest.raises(InvalidStatus) as caught:
        async with resumed(server, conn.session_id, conn.resume_token, conn.last_event_id):
            pass
    assert caught.value.response.status_code == 404


async def test_lifetime_expiry(server: LiveServer, module_redis: RedisServerProcess) -> None:
    async with opened(server) as conn:
        created_at = time.monotonic()
        expires_at = conn.events.log[0].raw["session"]["expires_at"]
        assert abs(expires_at - time.time() - LIFETIME_S) < 1.5
        # Stay active (the idle TTL must not be what ends it).
        with contextlib.suppress(ConnectionClosed):
            while "error" not in conn.events.types():
                await conn.send({"type": "input_audio_buffer.clear"})
                await asyncio.sleep(0.3)
        assert await conn.events.close_code(within_s=5) == 1001
        error = next(r.raw["error"] for r in conn.events.log if r.type == "error")
        assert error["code"] == "session_expired" and "maximum duration" in error["message"]
    assert LIFETIME_S - 0.2 < time.monotonic() - created_at < LIFETIME_S + 1.5
    await until(lambda: gone(server, conn.session_id), within_s=5)
    assert await keys_left(module_redis.url, conn.session_id) == 0


async def test_grace_expiry_cancels_the_response_and_stays_resumable(server: LiveServer) -> None:
    async with opened(server) as first:
        await turn(first, "a long answer", wait=False)
        await first.events.wait_for("response.output_audio.delta", within_s=10)
        first.abort()
        last = first.last_event_id
    host = server.ctx.host
    await until(lambda: first.session_id not in host.sessions, within_s=GRACE_S + 3)
    async with resumed(server, first.session_id, first.resume_token, last) as second:
        done = (await second.events.wait_for("response.done", within_s=5)).raw["response"]
        assert done["status"] == "cancelled"
        reply = await turn(second, "again", audio=False)  # short: the lifetime here is short too
        assert reply[-1].raw["response"]["status"] == "completed"
