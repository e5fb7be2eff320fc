"""GPT-Live sessions hold the same admission slots as every other kind: past the replica's
limit a new one is refused before the upgrade (429 with ``Retry-After``), and a session that
ends gives its slot back. An ``ek_`` client secret opens a session like an API key, for its
tenant, and may then read (``GET /v1/sessions/{id}``) what it opened."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.live.wire import connect
from tests.live_server import LiveServer, live_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(
        Path(tmp_path_factory.mktemp("srv")),
        pipeline="duplex-tiny",
        vad=False,
        api_keys="sk-live-a:tenant-a",
        max_sessions=1,
    ) as live:
        yield live


async def test_a_full_replica_refuses_a_live_session_until_one_ends(one_slot: LiveServer) -> None:
    first = await connect(one_slot)
    async with first.ws:
        await first.start()
        with pytest.raises(websockets.InvalidStatus) as refused:
            await connect(one_slot)
        response = refused.value.response
        assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
        assert json.loads(response.body)["error"]["message"].startswith("No session slot is free")
        await first.send({"type": "session.close"})
        await first.wait_for("session.closed")
    for _ in range(100):  # the slot goes back as the session ends
        try:
            again = await connect(one_slot)
        except websockets.InvalidStatus:
            await asyncio.sleep(0.05)
            continue
        async with again.ws:
            assert (await again.start())["session"]["id"].startswith("sess_")
        break
    else:
        raise AssertionError("the slot never came back")


async def test_an_ephemeral_key_opens_a_live_session(one_slot: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=one_slot.http_url) as http:
        for _ in range(100):  # the previous test's session may still be ending
            if one_slot.ctx.metrics.session_counts()["live"] == 0:
                break
            await asyncio.sleep(0.05)
        secret = await http.post("/v1/realtime/client_secrets", headers={"Authorization": "Bearer sk-live-a"})
        ek = secret.json()["value"]
        assert ek.startswith("ek_")
        client = await connect(one_slot, ek)
        async with client.ws:
            sid = (await client.start())["session"]["id"]
            mine = await http.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {ek}"})
            assert mine.status_code == 200 and mine.json()["kind"] == "live"
            await client.send({"type": "session.close"})
            await client.wait_for("session.closed")


@pytest.fixture(scope="module")
def short_idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(
        Path(tmp_path_factory.mktemp("idle")), pipeline="duplex-tiny", vad=False, idle_ttl_s=2.0
    ) as live:
        yield live


async def test_an_idle_live_session_expires(short_idle: LiveServer) -> None:
    """No input and nothing from the model past the idle TTL: ``session.closed`` with reason
    ``expired`` (after the final usage), close 1001, and the session is gone."""
    client = await connect(short_idle, None)
    async with client.ws:
        await client.start()
        closed = await client.wait_for("session.closed", within_s=30)
        assert closed["reason"] == "expired"
        code, _reason = await client.closed()
        assert code == 1001
    assert short_idle.ctx.metrics.session_counts()["live"] == 0
