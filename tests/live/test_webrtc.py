"""GPT-Live over WebRTC (``POST /v1/live/sessions`` with an SDP offer) against duplex-tiny, with
a real aiortc client peer on loopback: the 201 answer with its Location and resume headers,
``session.start`` / ``session.started`` on the ``oai-events`` channel, the microphone on the
track (an append on the channel is refused), the model's stream on the server's track (no audio
deltas on the channel) with its transcript on the channel, ``session.close`` answered with
``session.closed``, and nothing left behind; a dropped call resumes on a WebSocket."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from tests.live.wire import connect
from tests.live_server import LiveServer

pytestmark = pytest.mark.system


class LiveCallClient(RealtimeCallClient):
    path = "/v1/live/sessions"


def mic(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * 48_000)) * 0.1).astype(np.float32)


async def _no_live_sessions(server: LiveServer, within_s: float = 10.0) -> None:
    for _ in range(int(within_s / 0.05)):
        if server.ctx.metrics.session_counts()["live"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a live session was left behind")


async def test_a_live_session_over_webrtc(server: LiveServer) -> None:
    async with LiveCallClient(server.http_url, api_key="sk-live-a") as client:
        call = client.call
        assert call is not None and call.status_code == 201
        assert call.location == f"/v1/live/sessions/{call.call_id}"
        assert call.headers["content-type"].startswith("application/sdp")
        sid = call.headers["x-omni-session-id"]
        client.send(
            {"type": "session.start", "session": {"model": "duplex-tiny", "delegation": {"type": "client"}}}
        )
        _, started = await client.wait_event("session.started")
        assert started["session"]["id"] == sid
        client.say("user", mic(4.0), 48_000)
        _, text = await client.wait_event("session.output_transcript.delta", timeout_s=30)
        assert text["delta"] and text["end_ms"] > text["start_ms"]
        client.send({"type": "session.input_audio.append", "audio": "AAAA"})
        _, refused = await client.wait_event("error")
        assert refused["error"]["code"] == "invalid_event"
        await asyncio.sleep(4.0)  # the rest of the utterance, and what the model says to it
        client.send({"type": "session.close"})
        _, closed = await client.wait_event("session.closed", timeout_s=15)
        assert closed["reason"] == "close_requested"
        assert closed["usage"]["seconds"] > 3.0  # the track's audio is the session's clock
        types = {e["type"] for _, e in client.events}
        assert "session.output_audio.delta" not in types  # the model's audio is on the track
        heard = client.heard_audio()
        assert heard.size and float(np.abs(heard).max()) > 0.01  # the model's (noise) speech
    await _no_live_sessions(server)


async def test_a_call_is_hung_up_at_its_location(server: LiveServer) -> None:
    async with LiveCallClient(server.http_url, api_key="sk-live-a") as client:
        assert client.call is not None
        client.send(
            {"type": "session.start", "session": {"model": "duplex-tiny", "delegation": {"type": "client"}}}
        )
        await client.wait_event("session.started")
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            other = await http.delete(client.call.location, headers={"Authorization": "Bearer sk-live-b"})
            assert other.status_code == 404  # another tenant's call
            done = await http.delete(client.call.location, headers={"Authorization": "Bearer sk-live-a"})
            assert done.status_code == 200
        _, closed = await client.wait_event("session.closed", timeout_s=10)
        assert closed["reason"] == "remote_hangup"
    await _no_live_sessions(server)


async def test_a_dropped_call_resumes_on_a_websocket(server: LiveServer) -> None:
    client = LiveCallClient(server.http_url, api_key="sk-live-a")
    await client.connect()
    assert client.call is not None
    sid = client.call.headers["x-omni-session-id"]
    token = client.call.headers["x-omni-resume-token"]
    client.send(
        {"type": "session.start", "session": {"model": "duplex-tiny", "delegation": {"type": "client"}}}
    )
    await client.wait_event("session.started")
    client.say("user", mic(1.0), 48_000)
    await asyncio.sleep(1.5)
    await client.close()  # the peer goes without closing the channel first: a lost connection
    again = None
    for _ in range(40):  # until the server has seen the peer go (ICE/DTLS/SCTP teardown)
        ws = await connect(server, query=f"?session_id={sid}", headers={"X-Omni-Resume-Token": token})
        first = await ws.event()
        if first["type"] == "session.started":
            again = ws
            break
        await ws.ws.close()
        await asyncio.sleep(0.25)
    assert again is not None, "the session could not be resumed"
    async with again.ws:
        assert first["session"]["omni"]["resumed"] is True
        assert first["session"]["omni"]["usage_s"] > 0.5
        await again.send({"type": "session.close"})
        assert (await again.wait_for("session.closed"))["reason"] == "close_requested"
    await _no_live_sessions(server)
