"""WebRTC calls against a real server with a real aiortc client peer (loopback, no ICE servers).

The client speaks Piper sentences on its audio track in real time; the server runs the whole
voice cascade and answers on its own track while events flow on the `oai-events` channel.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from tests.live_server import LiveServer
from tests.session.realtime_harness import assert_valid_server_event
from tests.speech_audio import SENTENCE, words
from tests.webrtc.conftest import GRACE_S, TRANSCRIBED, open_peer_connections, webrtc_service

pytestmark = pytest.mark.system

SILENT_RMS = 1e-3


def loud_seconds(client: RealtimeCallClient, start: float, end: float, threshold: float = 0.01) -> float:
    return sum(0.02 for f in client.heard if start <= f.at < end and f.rms > threshold)


async def wait_until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)


async def test_voice_turn_over_webrtc(server: LiveServer, sentence48k: np.ndarray) -> None:
    async with RealtimeCallClient(server.http_url) as client:
        assert client.call is not None and client.call.status_code == 201
        assert client.call.location == f"/v1/realtime/calls/{client.call.call_id}"
        assert client.call.headers["content-type"].startswith("application/sdp")
        # No STUN/TURN configured: host candidates only (nothing asked a public STUN server).
        candidates = [line for line in client.call.answer_sdp.splitlines() if line.startswith("a=candidate")]
        assert candidates and all(" typ host" in line for line in candidates)
        client.send({"type": "session.update", "session": TRANSCRIBED})
        await client.wait_event("session.updated")
        utterance = client.say("user-1", sentence48k, 48_000)

        _, transcript = await client.wait_event(
            "conversation.item.input_audio_transcription.completed", timeout_s=60
        )
        assert words(transcript["transcript"]) == words(SENTENCE)
        started_at, started = await client.wait_event("output_audio_buffer.started", timeout_s=60)
        _, done = await client.wait_event("response.done", timeout_s=60)
        stopped_at, stopped = await client.wait_event("output_audio_buffer.stopped", timeout_s=60)
        assert started["response_id"] == stopped["response_id"] == done["response"]["id"]
        assert done["response"]["status"] == "completed"
        await asyncio.sleep(0.3)  # the client's jitter buffer still holds the last frames

        # The answer ("You said: ...") arrived on the track: loud, and as long as it should be.
        assert utterance.ended_at is not None
        answer = client.heard_audio(since=started_at)
        loud = loud_seconds(client, started_at, stopped_at + 0.3)
        assert 1.5 < loud < 8.0, loud
        assert float(np.sqrt(np.mean(answer**2))) > 0.02
        assert stopped_at - started_at > 2.0  # played out in real time, not dumped

        # The channel carries the same protocol as the WebSocket, audio excepted.
        types = [e["type"] for _, e in client.events]
        assert types[0] == "session.created"
        assert "response.output_audio.delta" not in types
        for _, event in client.events:
            assert_valid_server_event(event)
        assert len({e["event_id"] for _, e in client.events}) == len(client.events)


async def test_barge_in_clears_outbound_audio(
    server: LiveServer, sentence48k: np.ndarray, interruption48k: np.ndarray
) -> None:
    async with RealtimeCallClient(server.http_url) as client:
        client.send({"type": "session.update", "session": TRANSCRIBED})
        await client.wait_event("session.updated")
        client.say("user-1", sentence48k, 48_000)
        started_at, started = await client.wait_event("output_audio_buffer.started", timeout_s=60)
        rid = started["response_id"]
        await wait_until(lambda: loud_seconds(client, started_at, time.monotonic()) > 0.5, 10)

        mark = len(client.events)
        interruption = client.say("user-2", interruption48k, 48_000)
        cleared_at, cleared = await client.wait_event("output_audio_buffer.cleared", after=mark, timeout_s=30)
        assert cleared["response_id"] == rid
        # The pipeline is faster than real time: the response may have finished generating
        # before the interruption (then only its playout is cut) or be cancelled by it.
        _, done = await client.wait_event("response.done", where=lambda e: e["response"]["id"] == rid)
        if done["response"]["status"] != "completed":
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "turn_detected"
        _, truncated = await client.wait_event("conversation.item.truncated", after=mark)
        # Truncated at what the track had sent: more than the half second we heard, far from all.
        assert 500 <= truncated["audio_end_ms"] < 4000

        # The outbound track went silent (allow the client's ~100 ms jitter buffer), and stays
        # silent until the next answer begins.
        assert interruption.started_at is not None
        await asyncio.sleep(1.0)
        quiet_from = cleared_at + 0.25
        after = [f for f in client.heard if quiet_from <= f.at < quiet_from + 0.75]
        assert len(after) > 20
        assert max(f.rms for f in after) < SILENT_RMS, [round(f.rms, 4) for f in after]
        assert cleared_at - interruption.started_at < 1.0  # VAD onset, not end of speech
        for _, event in client.events:
            assert_valid_server_event(event)


async def test_output_audio_buffer_clear_from_the_client(server: LiveServer, sentence48k: np.ndarray) -> None:
    async with RealtimeCallClient(server.http_url) as client:
        client.say("user-1", sentence48k, 48_000)
        started_at, started = await client.wait_event("output_audio_buffer.started", timeout_s=60)
        await wait_until(lambda: loud_seconds(client, started_at, time.monotonic()) > 0.3, 10)
        mark = len(client.events)
        client.send({"type": "output_audio_buffer.clear", "event_id": "evt_clear"})
        cleared_at, cleared = await client.wait_event("output_audio_buffer.cleared", after=mark)
        assert cleared["response_id"] == started["response_id"]
        await asyncio.sleep(0.8)
        after = [f for f in client.heard if cleared_at + 0.25 <= f.at]
        assert after and max(f.rms for f in after) < SILENT_RMS


async def test_invalid_channel_messages_get_error_events(server: LiveServer) -> None:
    async with RealtimeCallClient(server.http_url) as client:
        await client.wait_event("session.created")
        client.send_raw("this is not json")
        _, err = await client.wait_event("error")
        assert err["error"]["code"] == "invalid_json"
        client.send({"type": "no.such.event", "event_id": "evt_1"})
        _, err = await client.wait_event("error", where=lambda e: e["error"].get("event_id") == "evt_1")
        assert err["error"]["code"] == "invalid_event"
        client.send({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "evt_2"})
        _, err = await client.wait_event("error", where=lambda e: e["error"].get("event_id") == "evt_2")
        assert err["error"]["code"] == "invalid_event" and "audio track" in err["error"]["message"]
        client.send_raw(b"\xff\xfe not utf-8".decode("latin-1"))
        await client.wait_event("error", where=lambda e: e["error"]["code"] == "invalid_json")
        # The session is still alive and answers properly.
        client.send({"type": "session.update", "session": {"type": "realtime", "instructions": "be brief"}})
        _, updated = await client.wait_event("session.updated")
        assert updated["session"]["instructions"] == "be brief"
        for _, event in client.events:
            assert_valid_server_event(event)


async def test_multipart_offer_with_session_config(server: LiveServer) -> None:
    session = {"type": "realtime", "instructions": "Speak like a pirate.", "output_modalities": ["audio"]}
    async with RealtimeCallClient(server.http_url, session=session) as client:
        _, created = await client.wait_event("session.created")
        assert created["session"]["instructions"] == "Speak like a pirate."
        assert_valid_server_event(created)


async def settled(server: LiveServer) -> None:
    """Calls of earlier tests end asynchronously (their peers closed): wait them out."""
    await wait_until(lambda: not server.ctx.sessions and not webrtc_service(server).calls, 15)


async def test_hangup_releases_the_call(server: LiveServer) -> None:
    service = webrtc_service(server)
    async with RealtimeCallClient(server.http_url) as client:
        _, created = await client.wait_event("session.created")
        session_id = created["session"]["id"]
        assert client.call is not None
        assert client.call.call_id in service.calls and session_id in server.ctx.sessions
        assert await client.hangup() == 200
        await wait_until(lambda: client.call.call_id not in service.calls)
        await wait_until(lambda: client.pc.connectionState == "closed")
        assert session_id not in server.ctx.sessions
        async with httpx.AsyncClient() as http:
            again = await http.post(f"{server.http_url}{client.call.location}/hangup")
        assert again.status_code == 404


async def test_peer_gone_without_hangup_gets_the_grace_then_is_released(server: LiveServer) -> None:
    """`pc.close()` (a closed tab) is no hangup: like a dropped WebSocket, the session is
    detached for the disconnect grace (see tests/webrtc/test_resume.py), then parked."""
    await settled(server)
    client = RealtimeCallClient(server.http_url)
    await client.connect()
    _, created = await client.wait_event("session.created")
    session_id = created["session"]["id"]
    assert session_id in server.ctx.sessions
    await client.pc.close()  # gone without a hangup
    url = f"{server.http_url}/v1/sessions/{session_id}"
    async with httpx.AsyncClient() as http:
        await wait_until(lambda: not webrtc_service(server).calls)
        detached = (await http.get(url)).json()
        assert detached["state"] == "detached" and detached["live_here"] is True
        started = time.monotonic()
        await settled(server)
        assert time.monotonic() - started >= GRACE_S - 1.0
        assert (await http.get(url)).json()["state"] == "parked"
    await client.close()


async def test_ice_that_never_connects_is_released(server: LiveServer) -> None:
    service = webrtc_service(server)
    await settled(server)
    service.connect_timeout_s = 1.5
    try:
        client = RealtimeCallClient(server.http_url)
        offer = await client.offer()
        # No candidates: the server can never reach this peer.
        offer = "".join(line + "\r\n" for line in offer.splitlines() if not line.startswith("a=candidate"))
        async with httpx.AsyncClient() as http:
            resp = await http.post(
                f"{server.http_url}/v1/realtime/calls",
                content=offer,
                headers={"Content-Type": "application/sdp"},
            )
        assert resp.status_code == 201
        assert len(server.ctx.sessions) == 1
        started = time.monotonic()
        await settled(server)
        assert time.monotonic() - started < 5.0
        await client.close()
    finally:
        service.connect_timeout_s = 30.0
    assert open_peer_connections() == []


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        ("hello", "application/sdp", 400, "invalid_offer"),
        ("", "application/sdp", 400, "invalid_offer"),
        ("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n", "application/sdp", 400, "invalid_offer"),
        ("{}", "application/json", 415, "unsupported_content_type"),
    ],
)
async def test_bad_offers_are_rejected_with_json(
    server: LiveServer, body: str, content_type: str, status: int, code: str
) -> None:
    await settled(server)
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            f"{server.http_url}/v1/realtime/calls", content=body, headers={"Content-Type": content_type}
        )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["code"] == code and error["message"]
    assert not server.ctx.sessions and not webrtc_service(server).calls


async def test_offer_aiortc_refuses_leaves_no_peer(server: LiveServer) -> None:
    await settled(server)
    client = RealtimeCallClient(server.http_url)
    offer = await client.offer()
    await client.close()
    no_mux = "".join(line + "\r\n" for line in offer.splitlines() if line != "a=rtcp-mux")
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            f"{server.http_url}/v1/realtime/calls",
            content=no_mux,
            headers={"Content-Type": "application/sdp"},
        )
    assert resp.status_code == 400
    assert "RTCP mux" in resp.json()["error"]["message"]
    assert open_peer_connections() == []
    assert not webrtc_service(server).calls


async def test_multipart_errors(server: LiveServer) -> None:
    async with httpx.AsyncClient() as http:
        no_sdp = await http.post(f"{server.http_url}/v1/realtime/calls", files={"session": (None, "{}")})
        bad_json = await http.post(
            f"{server.http_url}/v1/realtime/calls", files={"sdp": (None, "v=0"), "session": (None, "{")}
        )
        bad_session = await http.post(
            f"{server.http_url}/v1/realtime/calls",
            files={"sdp": (None, "v=0"), "session": (None, json.dumps({"type": "realtime", "bogus": 1}))},
        )
    assert no_sdp.status_code == 400 and no_sdp.json()["error"]["code"] == "missing_required_parameter"
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    assert bad_session.status_code == 400 and bad_session.json()["error"]["code"] == "invalid_session_config"


async def test_demo_session_hands_out_an_ephemeral_key(server: LiveServer) -> None:
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{server.http_url}/v1/demo/session")
        page = await http.get(f"{server.http_url}/")
    assert resp.status_code == 200
    body = resp.json()
    assert body["value"].startswith("ek_") and body["ice_servers"] == []
    assert page.status_code == 200 and "<html" in page.text.lower()
    async with RealtimeCallClient(server.http_url, api_key=body["value"]) as client:
        _, created = await client.wait_event("session.created")
        # The key's scope (the demo session: transcription on) applies to the call.
        assert created["session"]["audio"]["input"]["transcription"] is not None
