"""Credentials on a server with API keys: 401 before the upgrade for bad or missing ones;
`Authorization: Bearer` (the SDK), the browser subprotocol `openai-insecure-api-key.<key>`
(accepted as `realtime`) and ephemeral `ek_` keys from `POST /v1/realtime/client_secrets`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from openai import AsyncOpenAI
from websockets.exceptions import InvalidStatus

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import ServerEvents, ping, sdk_session

pytestmark = pytest.mark.system

KEY = "k1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), api_keys=f"{KEY}:tenantA") as live:
        yield live


def realtime_url(server: LiveServer) -> str:
    return f"{server.ws_url}/v1/realtime?model=voice-cascade"


@pytest.mark.parametrize(
    ("headers", "subprotocols"),
    [
        ({}, None),
        ({"Authorization": "Bearer wrong"}, None),
        ({"Authorization": f"Basic {KEY}"}, None),
        ({}, ["realtime", "openai-insecure-api-key.wrong"]),
        ({}, ["realtime"]),
    ],
    ids=["missing", "wrong-bearer", "not-bearer", "wrong-subprotocol-key", "subprotocol-without-key"],
)
async def test_bad_or_missing_credentials_get_401_before_upgrade(
    server: LiveServer, headers: dict[str, str], subprotocols: list[str] | None
) -> None:
    with pytest.raises(InvalidStatus) as caught:
        async with websockets.connect(
            realtime_url(server),
            additional_headers=headers,
            subprotocols=subprotocols,  # type: ignore[arg-type]
            open_timeout=10,
        ):
            pass
    response = caught.value.response
    assert response.status_code == 401
    error = json.loads(response.body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


async def test_sdk_with_a_wrong_key_is_refused(server: LiveServer) -> None:
    client = AsyncOpenAI(api_key="wrong", base_url=server.base_url, max_retries=0)
    with pytest.raises(InvalidStatus) as caught:  # the SDK surfaces the failed handshake as is
        async with client.realtime.connect(model="voice-cascade") as conn:
            await conn.recv()
    assert caught.value.response.status_code == 401


async def test_bearer_key_via_sdk(server: LiveServer) -> None:
    async with sdk_session(server, api_key=KEY) as (conn, events):
        await ping(conn, events)


async def test_browser_subprotocol_key_is_accepted_as_realtime(server: LiveServer) -> None:
    async with websockets.connect(
        realtime_url(server),
        subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"],  # type: ignore[list-item]
        open_timeout=10,
    ) as ws:
        assert ws.subprotocol == "realtime"
        async with ServerEvents(ws.recv) as events:
            assert (await events.next()).type == "session.created"
            await ws.send('{"type": "input_audio_buffer.clear", "event_id": "evt_1"}')
            await events.wait_for("input_audio_buffer.cleared", within_s=10)


async def test_ephemeral_key_from_client_secrets(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url, timeout=10) as http:
        refused = await http.post("/v1/realtime/client_secrets", json={"session": {"type": "realtime"}})
        assert refused.status_code == 401
        issued = await http.post(
            "/v1/realtime/client_secrets",
            headers={"Authorization": f"Bearer {KEY}"},
            json={
                "expires_after": {"anchor": "created_at", "seconds": 60},
                "session": {"type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"]},
            },
        )
    assert issued.status_code == 200, issued.text
    body = issued.json()
    secret = body["value"]
    assert secret.startswith("ek_") and body["session"]["instructions"] == "Be brief."

    # The SDK sends it as a Bearer key; the session starts from the key's scoped config.
    client = AsyncOpenAI(api_key=secret, base_url=server.base_url)
    async with (
        client.realtime.connect(model="voice-cascade") as conn,
        ServerEvents(conn.recv_bytes) as events,
    ):
        created = (await events.next()).event
        assert created.type == "session.created"
        assert created.session.instructions == "Be brief."
        assert created.session.output_modalities == ["text"]
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        )
        await conn.response.create()
        done = (await events.wait_for("response.done", within_s=30)).event.response
        assert done.status == "completed" and done.output[0].content[0].text == "You said: hi"

    # A browser sends the same key as a subprotocol.
    async with websockets.connect(
        realtime_url(server),
        subprotocols=["realtime", f"openai-insecure-api-key.{secret}"],  # type: ignore[list-item]
        open_timeout=10,
    ) as ws:
        assert ws.subprotocol == "realtime"
        async with ServerEvents(ws.recv) as events:
            assert (await events.next()).type == "session.created"
