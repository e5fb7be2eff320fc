"""Who may open a WebRTC call and get a demo key, on a server with API keys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from tests.live_server import LiveServer, live_server
from tests.session.realtime_harness import assert_valid_server_event
from web.transports.webrtc import DEMO_KEY_ENV, append_rejection, too_large

pytestmark = pytest.mark.system

API_KEY = "sk-test-webrtc"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("keyed")), api_keys=f"{API_KEY}:acme", vad=False) as live:
        yield live


async def test_calls_need_a_key(keyed: LiveServer) -> None:
    client = RealtimeCallClient(keyed.http_url)
    with pytest.raises(RuntimeError, match="401"):
        await client.connect()
    await client.close()
    bad = RealtimeCallClient(keyed.http_url, api_key="sk-wrong")
    with pytest.raises(RuntimeError, match="invalid_api_key"):
        await bad.connect()
    await bad.close()


async def test_api_key_and_ephemeral_key_open_calls(keyed: LiveServer) -> None:
    async with RealtimeCallClient(keyed.http_url, api_key=API_KEY) as client:
        await client.wait_event("session.created")
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            f"{keyed.http_url}/v1/realtime/client_secrets",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"session": {"type": "realtime", "instructions": "Scoped by the key."}},
        )
    secret = resp.json()["value"]
    async with RealtimeCallClient(keyed.http_url, api_key=secret) as client:
        _, created = await client.wait_event("session.created")
        assert created["session"]["instructions"] == "Scoped by the key."
        # Only the caller's tenant can hang it up.
        assert client.call is not None
        async with httpx.AsyncClient() as http:
            other = await http.post(f"{keyed.http_url}{client.call.location}/hangup")
        assert other.status_code == 401
        assert await client.hangup() == 200


async def test_demo_session_needs_a_key_or_the_demo_secret(
    keyed: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with httpx.AsyncClient() as http:
        denied = await http.post(f"{keyed.http_url}/v1/demo/session")
        assert denied.status_code == 401 and DEMO_KEY_ENV in denied.json()["error"]["message"]
        with_key = await http.post(
            f"{keyed.http_url}/v1/demo/session", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert with_key.status_code == 200 and with_key.json()["value"].startswith("ek_")
        monkeypatch.setenv(DEMO_KEY_ENV, "let-me-demo")
        with_demo = await http.post(
            f"{keyed.http_url}/v1/demo/session", headers={"Authorization": "Bearer let-me-demo"}
        )
        assert with_demo.status_code == 200
        wrong_demo = await http.post(
            f"{keyed.http_url}/v1/demo/session", headers={"Authorization": "Bearer let-me-in"}
        )
        assert wrong_demo.status_code == 401


def test_transport_errors_are_valid_server_events() -> None:
    rejection = append_rejection('{"type": "input_audio_buffer.append", "audio": "", "event_id": "e1"}')
    assert rejection is not None and rejection["error"]["event_id"] == "e1"
    assert_valid_server_event(rejection)
    assert append_rejection('{"type": "response.create"}') is None
    assert append_rejection("not json input_audio_buffer.append") is None
    big = too_large({"type": "conversation.item.retrieved"}, 300_000, 262_144)
    assert big["error"]["code"] == "event_too_large"
    assert_valid_server_event(big)


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("one")), max_sessions=1, vad=False) as live:
        yield live


async def test_calls_take_and_give_back_admission_slots(one_slot: LiveServer) -> None:
    async with RealtimeCallClient(one_slot.http_url) as first:
        await first.wait_event("session.created")
        second = RealtimeCallClient(one_slot.http_url)
        with pytest.raises(RuntimeError, match="429"):
            await second.connect()
        await second.close()
        assert await first.hangup() == 200
    for _ in range(100):  # the slot comes back once the call has ended
        third = RealtimeCallClient(one_slot.http_url)
        try:
            await third.connect()
            break
        except RuntimeError:
            await third.close()
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the slot never came back")
    await third.wait_event("session.created")
    await third.close()
