"""WebRTC calls are hosted sessions: a vanished peer detaches its session for the disconnect
grace, and the session resumes over the WebSocket or on a new call (real aiortc peers with no
ICE servers, a real server on the history-echo pipeline, its own real redis-server).

The history-echo responder puts the conversation history in its reply, so a resumed session
shows in its answer that it kept what was said during the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from session.resume import OMNI_MARK
from tests.live_server import LiveServer
from tests.peer_faults import vanish
from tests.sessions.client import resumed, seq, until, user_text
from tests.sessions.conftest import on_server_async, session_server
from tests.webrtc.conftest import open_peer_connections, webrtc_service

pytestmark = pytest.mark.system

GRACE_S = 8.0  # long enough to look at a detached session before the grace runs out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = Path(tmp_path_factory.mktemp("resume"))
    with session_server(folder, None, audio_ms=800, disconnect_grace_s=GRACE_S) as live:
        yield live


async def session_state(server: LiveServer, session_id: str) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10.0) as http:
        resp = await http.get(f"{server.http_url}/v1/sessions/{session_id}")
    return resp.status_code, resp.json()


async def wait_for_state(server: LiveServer, session_id: str, state: str, within_s: float) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        status, body = await session_state(server, session_id)
        if status == 200 and body["state"] == state:
            return body
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"session {session_id} not {state} within {within_s} s: {status} {body}")
        await asyncio.sleep(0.05)


async def slots_held(server: LiveServer) -> int:
    counts = await on_server_async(server, server.ctx.host.admission.counts())
    return int(counts.replica_active)


async def settled(server: LiveServer) -> None:
    """No call, no session and no slot left from an earlier test."""
    deadline = asyncio.get_running_loop().time() + GRACE_S + 10
    while server.ctx.sessions or webrtc_service(server).calls or await slots_held(server):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("the server did not settle")
        await asyncio.sleep(0.1)


async def opened_call(server: LiveServer) -> tuple[RealtimeCallClient, str, str]:
    """A new call: its session id and resume token (from `omni.session.resumable`, which it
    asks for)."""
    client = RealtimeCallClient(server.http_url, extensions=True)
    await client.connect()
    _, created = await client.wait_event("session.created")
    _, resumable = await client.wait_event("omni.session.resumable")
    assert resumable["session_id"] == created["session"]["id"]
    return client, resumable["session_id"], resumable["resume_token"]


async def say_on_channel(client: RealtimeCallClient, text: str) -> dict[str, Any]:
    """A user message sent on the events channel; its `conversation.item.done`."""
    after = len(client.events)
    client.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        }
    )
    _, done = await client.wait_event("conversation.item.done", after=after, timeout_s=10)
    return done


def loud_seconds(client: RealtimeCallClient, since: float, threshold: float = 0.01) -> float:
    return sum(0.02 for f in client.heard if f.at >= since and f.rms > threshold)


async def test_vanished_peer_detaches_and_resumes_over_the_websocket(
    server: LiveServer, fast_consent: None
) -> None:
    await settled(server)
    client, session_id, token = await opened_call(server)
    try:
        done = await say_on_channel(client, "hello from the call")
        item_id = done["item"]["id"]
        last_seen = client.events[-1][1]["event_id"]
        assert await slots_held(server) == 1

        vanish(client.pc)
        state = await wait_for_state(server, session_id, "detached", within_s=GRACE_S - 2)
        assert state["live_here"] is True and state["connected"] is False
        assert await slots_held(server) == 1  # the slot is held through the grace
        assert webrtc_service(server).calls == {}  # the call itself is gone

        async with resumed(server, session_id, token, last_seen) as ws:
            assert ws.events.log[0].raw["replay_count"] == 0  # it had seen everything
            ws_item = await user_text(ws, "and now over the websocket")
            await ws.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
            reply = await ws.events.wait_for("response.done", within_s=30)
            text = reply.raw["response"]["output"][0]["content"][0]["text"]
            assert "hello from the call" in text  # the call's item is in the history
            assert ws_item != item_id
            assert (await session_state(server, session_id))[1]["state"] == "active"
    finally:
        await client.close()


async def test_hangup_ends_the_session_and_frees_the_slot(server: LiveServer) -> None:
    await settled(server)
    client, session_id, _ = await opened_call(server)
    try:
        assert await slots_held(server) == 1
        assert await client.hangup() == 200
        await until(lambda: client.pc.connectionState == "closed")
        assert session_id not in server.ctx.sessions
        assert await slots_held(server) == 0
        status, body = await session_state(server, session_id)
        assert status == 404 and body["error"]["code"] == "session_not_found"
        assert await client.hangup() == 404  # and only once
    finally:
        await client.close()


async def test_hangup_after_the_peer_closed_still_ends_the_session(server: LiveServer) -> None:
    """The demo page closes its peer connection first, then posts the hangup: the session,
    detached by then, is ended all the same."""
    await settled(server)
    client, session_id, _ = await opened_call(server)
    try:
        await client.pc.close()
        await wait_for_state(server, session_id, "detached", within_s=GRACE_S - 2)
        assert await client.hangup() == 200
        status, _ = await session_state(server, session_id)
        assert status == 404
        assert session_id not in server.ctx.sessions
        assert await slots_held(server) == 0
    finally:
        await client.close()


async def test_closing_the_events_channel_is_a_clean_close(server: LiveServer) -> None:
    """Like a WebSocket close 1000: the session is parked at once (no grace), slot given back."""
    await settled(server)
    client, session_id, _ = await opened_call(server)
    try:
        client.channel.close()
        state = await wait_for_state(server, session_id, "parked", within_s=GRACE_S - 2)
        assert state["live_here"] is False
        assert await slots_held(server) == 0
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("session_id", "token", "status", "code"),
    [
        (None, "wrong-token", 403, "invalid_resume_token"),
        (None, None, 403, "invalid_resume_token"),
        ("sess_doesnotexist0000000000", "any-token", 404, "session_not_found"),
        ("not-a-session-id", "any-token", 404, "session_not_found"),
    ],
)
async def test_bad_resume_is_refused_before_any_peer_connection(
    server: LiveServer, session_id: str | None, token: str | None, status: int, code: str
) -> None:
    await settled(server)
    client, real_id, _ = await opened_call(server)
    service = webrtc_service(server)
    try:
        calls_before = set(service.calls)
        peers_before = len(open_peer_connections())
        offer_client = RealtimeCallClient(server.http_url)
        offer = await offer_client.offer()
        await offer_client.close()
        headers = {"Content-Type": "application/sdp"}
        if token is not None:
            headers["X-Omni-Resume-Token"] = token
        async with httpx.AsyncClient(timeout=10.0) as http:
            resp = await http.post(
                f"{server.http_url}/v1/realtime/calls",
                params={"session_id": session_id or real_id},
                content=offer,
                headers=headers,
            )
        assert resp.status_code == status
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == code
        assert set(service.calls) == calls_before
        assert len(open_peer_connections()) == peers_before  # nothing half-open on the server
        assert (await session_state(server, real_id))[1]["state"] == "active"  # untouched
        assert await client.hangup() == 200
    finally:
        await client.close()


async def test_a_second_call_resumes_with_replay_and_audio(server: LiveServer) -> None:
    await settled(server)
    first, session_id, token = await opened_call(server)
    try:
        done = await say_on_channel(first, "hello from the call")
        seen_through = done["event_id"]
        first.send({"type": "response.create"})
        _, answered = await first.wait_event("response.done", timeout_s=30)
        await first.wait_event("output_audio_buffer.stopped", timeout_s=10)
        missed = logged_events(first, after=seen_through)  # as if the call had dropped there
        assert answered in missed
    finally:
        await first.close()  # no hangup: the session is detached, not ended
    await wait_for_state(server, session_id, "detached", within_s=GRACE_S - 2)

    second = RealtimeCallClient(server.http_url)
    try:
        await second.connect(resume=(session_id, token, seen_through))
        _, resumed_event = await second.wait_event("omni.session.resumed", timeout_s=10)
        assert resumed_event["session_id"] == session_id
        assert second.events[0][1] == resumed_event  # first on the new channel
        assert resumed_event["replay_count"] == len(missed)
        # The replay is what the first call got after `seen_through`: the same events.
        await until(lambda: len(second.events) > len(missed))
        replayed = [e for _, e in second.events[1 : 1 + len(missed)]]
        assert replayed == missed
        assert not second.of_type("omni.session.resumable")  # a resume shows no new token
        assert not second.of_type("response.output_audio.delta")

        start = second.clock()
        after = len(second.events)
        second.send({"type": "response.create"})
        _, reply_done = await second.wait_event("response.done", after=after, timeout_s=30)
        transcript = reply_done["response"]["output"][0]["content"][0]["transcript"]
        assert "hello from the call" in transcript  # the conversation carried over
        await second.wait_event("output_audio_buffer.stopped", after=after, timeout_s=10)
        assert loud_seconds(second, start) >= 0.4  # the 800 ms answer tone, on the new track
        assert not second.of_type("response.output_audio.delta")
        assert (await session_state(server, session_id))[1]["connected"] is True
        assert await second.hangup() == 200
    finally:
        await second.close()


async def test_stock_call_gets_no_omni_event_and_resumes_from_the_201(server: LiveServer) -> None:
    """A call that did not ask for `omni.*` events (the official browser SDK) gets only
    standard events on `oai-events`; its 201 carries the resume data, and it resumes."""
    await settled(server)
    first = RealtimeCallClient(server.http_url)
    try:
        info = await first.connect()
        session_id = info.headers["x-omni-session-id"]
        token = info.headers["x-omni-resume-token"]
        _, created = await first.wait_event("session.created")
        assert created["session"]["id"] == session_id
        done = await say_on_channel(first, "hello stock")
        assert not [e for _, e in first.events if e["type"].startswith("omni.")], first.events
        seen_through = done["event_id"]
    finally:
        await first.close()
    await wait_for_state(server, session_id, "detached", within_s=GRACE_S - 2)
    second = RealtimeCallClient(server.http_url)
    try:
        await second.connect(resume=(session_id, token, seen_through))
        _, back = await second.wait_event("omni.session.resumed", timeout_s=10)  # a resume asks
        assert back["session_id"] == session_id
        assert await second.hangup() == 200
    finally:
        await second.close()


def logged_events(client: RealtimeCallClient, *, after: str) -> list[dict[str, Any]]:
    """The session's logged events a call received after event `after` (connection events,
    `omni.*`, left out: they are not in the log)."""
    events = [
        e for _, e in client.events if OMNI_MARK not in e["event_id"] and not e["type"].startswith("omni.")
    ]
    return [e for e in events if seq(e) > seq({"event_id": after})]
