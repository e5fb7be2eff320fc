"""WebRTC world calls are resumable: a vanished peer detaches its generating world for the
disconnect grace (slot held, generation paused), and the world resumes on a new call or over
the WebSocket, where it was (real aiortc peers with no ICE servers, loopback only; a real
server on the null pipeline with tiny-jepa worlds and its own real redis-server).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription

from tests.live_server import LiveServer, live_server
from tests.peer_faults import vanish
from tests.world.test_rtc import RtcClient
from tests.world.test_sessions import (
    KEY,
    OTHER_KEY,
    START,
    auth,
    eventually,
    get_session,
    live_requests,
    on_server,
    open_world,
    resume,
    world_stats,
)

pytestmark = pytest.mark.system

GRACE_S = 3.0
CALLS = "/v1/realtime/video/calls"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(
        Path(tmp_path_factory.mktemp("srv")),
        pipeline="null",
        vad=False,
        api_keys=f"{KEY}:tenant-a,{OTHER_KEY}:tenant-b",
        disconnect_grace_s=GRACE_S,
    ) as live:
        yield live


@pytest.fixture(autouse=True)
async def settled(server: LiveServer) -> None:
    """Each test starts with no world, no call and no slot left from the one before."""
    await eventually(lambda: _settled(server), limit_s=GRACE_S + 10)


async def _settled(server: LiveServer) -> bool:
    stats = await world_stats(server)
    return stats["live"] == 0 and not service(server).calls and await slots_held(server) == 0


def service(server: LiveServer) -> Any:
    return server.server.config.app.state.video


async def slots_held(server: LiveServer) -> int:
    counts = await on_server(server, server.ctx.host.admission.counts())
    return int(counts.replica_active)


def open_peer_connections() -> int:
    gc.collect()
    return sum(
        1 for o in gc.get_objects() if isinstance(o, RTCPeerConnection) and o.connectionState != "closed"
    )


async def post_offer(
    server: LiveServer, client: RtcClient, headers: dict[str, str], params: dict[str, str] | None = None
) -> httpx.Response:
    await client.pc.setLocalDescription(await client.pc.createOffer())
    async with httpx.AsyncClient(timeout=20) as http:
        return await http.post(
            f"{server.http_url}{CALLS}",
            params=params,
            content=client.pc.localDescription.sdp,
            headers={"Content-Type": "application/sdp", **headers},
        )


async def call(
    server: LiveServer, client: RtcClient, *, resume_of: tuple[str, str] | None = None
) -> tuple[str, dict[str, Any]]:
    """Connect ``client`` (a new world, or a resume of ``(session_id, token)``): the call's
    Location and the first event on ``controls``."""
    headers, params = auth(), {"omni_extensions": "1"}  # it asks for `omni.*` events
    if resume_of is not None:
        headers["X-Omni-Resume-Token"] = resume_of[1]
        params = {"session_id": resume_of[0]}
    answer = await post_offer(server, client, headers, params)
    assert answer.status_code == 201, answer.text
    await client.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
    await asyncio.wait_for(client.opened.wait(), 15)
    first = await asyncio.wait_for(client.events.get(), 10)
    assert answer.headers["x-omni-session-id"] == first["session_id"]
    return answer.headers["location"], first


async def started_world(server: LiveServer, client: RtcClient) -> tuple[str, str, str, dict[str, Any]]:
    """A new call with a world streaming: (location, session id, token, last chunk status)."""
    location, resumable = await call(server, client)
    assert resumable["type"] == "omni.session.resumable"  # first on `controls`, as on the WebSocket
    assert resumable["resume_token"].startswith("rt_")
    client.send(START)
    await client.expect("video.start")
    status = [await client.expect("video.chunk_metadata") for _ in range(3)][-1]
    return location, resumable["session_id"], resumable["resume_token"], status


async def state_of(server: LiveServer, session_id: str) -> dict[str, Any]:
    response = await get_session(server, session_id)
    return response.json() if response.status_code == 200 else {"state": response.status_code}


async def test_vanished_call_detaches_and_a_new_call_resumes_the_world(
    server: LiveServer, fast_consent: None
) -> None:
    first = RtcClient()
    second = RtcClient()
    try:
        _, session_id, token, last = await started_world(server, first)
        request_id = last["request_id"]
        assert await slots_held(server) == 1
        vanish(first.pc)
        await eventually(lambda: _state_is(server, session_id, "detached"), limit_s=GRACE_S)
        assert not service(server).calls  # the call is gone, its world is not
        assert await slots_held(server) == 1  # the slot is held through the grace
        assert request_id in await live_requests(server)  # the world runs on, paused
        held = (await state_of(server, session_id))["world"]["chunk_index"]
        await asyncio.sleep(0.5)
        assert (await state_of(server, session_id))["world"]["chunk_index"] == held

        location, resumed = await call(server, second, resume_of=(session_id, token))
        assert resumed["type"] == "omni.session.resumed"  # first on the new `controls`
        assert resumed["session_id"] == session_id and resumed["request_id"] == request_id
        assert resumed["phase"] == "streaming" and resumed["chunk_index"] > last["chunk_index"]
        statuses = [await second.expect("video.chunk_metadata") for _ in range(3)]
        indices = [s["chunk_index"] for s in statuses]
        assert indices == list(range(resumed["chunk_index"], resumed["chunk_index"] + 3))  # no restart
        assert all(s["request_id"] == request_id and s["kind"] == "rtp" for s in statuses)
        assert second.track is not None
        frame = await asyncio.wait_for(second.track.recv(), 10)  # frames on the new call's track
        assert (frame.width, frame.height) == (64, 64)
        body = await state_of(server, session_id)
        assert body["state"] == "active" and body["transport"] == "webrtc"
        assert await slots_held(server) == 1  # the same slot

        async with httpx.AsyncClient() as http:  # hangup: the world ends at once
            assert (
                await http.delete(f"{server.http_url}{location}", headers=auth(OTHER_KEY))
            ).status_code == 404
            assert (await http.delete(f"{server.http_url}{location}", headers=auth())).status_code == 200
            assert (await get_session(server, session_id)).status_code == 404
            assert await slots_held(server) == 0
            assert (await http.delete(f"{server.http_url}{location}", headers=auth())).status_code == 404
        await eventually(lambda: _request_gone(server, request_id))
    finally:
        await first.pc.close()
        await second.pc.close()


@pytest.mark.parametrize(
    ("which", "token", "key", "status", "code"),
    [
        ("real", "rt_wrong", KEY, 403, "invalid_resume_token"),
        ("real", None, KEY, 403, "invalid_resume_token"),
        ("unknown", "real", KEY, 404, "session_not_found"),
        ("not-an-id", "real", KEY, 404, "session_not_found"),
        ("real", "real", OTHER_KEY, 404, "session_not_found"),
    ],
)
async def test_bad_resume_is_refused_before_any_peer_connection(
    server: LiveServer, which: str, token: str | None, key: str, status: int, code: str
) -> None:
    client = RtcClient()
    offering = RtcClient()
    try:
        _, session_id, real_token, _ = await started_world(server, client)
        await offering.pc.setLocalDescription(await offering.pc.createOffer())
        offer = offering.pc.localDescription.sdp
        await offering.pc.close()
        calls_before, peers_before = set(service(server).calls), open_peer_connections()
        target = {"real": session_id, "unknown": f"sess_{'x' * 24}", "not-an-id": "not-an-id"}[which]
        headers = {**auth(key), "Content-Type": "application/sdp"}
        if token is not None:
            headers["X-Omni-Resume-Token"] = real_token if token == "real" else token
        async with httpx.AsyncClient(timeout=10) as http:
            refused = await http.post(
                f"{server.http_url}{CALLS}", params={"session_id": target}, content=offer, headers=headers
            )
        assert refused.status_code == status, refused.text
        assert refused.json()["error"]["code"] == code
        assert set(service(server).calls) == calls_before
        assert open_peer_connections() == peers_before  # nothing half-open on the server
        body = await state_of(server, session_id)
        assert body["state"] == "active" and body["connected"] is True  # untouched
    finally:
        await client.pc.close()


async def test_a_call_resumes_over_the_websocket(server: LiveServer) -> None:
    client = RtcClient()
    try:
        _, session_id, token, last = await started_world(server, client)
    finally:
        await client.pc.close()  # no hangup: the peer is gone, the world detached
    await eventually(lambda: _state_is(server, session_id, "detached"), limit_s=GRACE_S)
    again = await resume(server, session_id, token)
    async with again.ws:
        resumed = await again.event()
        assert resumed["type"] == "omni.session.resumed" and resumed["request_id"] == last["request_id"]
        assert resumed["chunk_index"] > last["chunk_index"]
        chunks = [await again.chunk() for _ in range(3)]  # now JPEG bytes after each metadata
        indices = [c.meta["chunk_index"] for c in chunks]
        assert indices == list(range(resumed["chunk_index"], resumed["chunk_index"] + 3))
        assert all(c.meta["kind"] == "media" and c.data[:2] == b"\xff\xd8" for c in chunks)
        assert (await state_of(server, session_id))["transport"] == "websocket"
        await again.send({"type": "session.stop"})
        await again.expect("session.done")
    await eventually(lambda: _gone(server, session_id))


async def test_a_websocket_world_resumes_on_a_call(server: LiveServer) -> None:
    """The other way round: a world begun over the WebSocket continues on a call's track."""
    ws_client, resumable = await open_world(server)
    session_id, token = resumable["session_id"], resumable["resume_token"]
    await ws_client.send(START)
    await ws_client.expect("video.start")
    last = [await ws_client.chunk() for _ in range(2)][-1].meta
    ws_client.ws.transport.abort()  # dropped: no close frame
    await eventually(lambda: _state_is(server, session_id, "detached"), limit_s=GRACE_S)
    client = RtcClient()
    try:
        location, resumed = await call(server, client, resume_of=(session_id, token))
        assert resumed["type"] == "omni.session.resumed" and resumed["chunk_index"] > last["chunk_index"]
        status = await client.expect("video.chunk_metadata")
        assert status["kind"] == "rtp" and status["chunk_index"] == resumed["chunk_index"]
        assert client.track is not None
        frame = await asyncio.wait_for(client.track.recv(), 10)
        assert (frame.width, frame.height) == (64, 64)
        assert (await state_of(server, session_id))["transport"] == "webrtc"
        async with httpx.AsyncClient() as http:
            assert (await http.delete(f"{server.http_url}{location}", headers=auth())).status_code == 200
        assert (await get_session(server, session_id)).status_code == 404
    finally:
        await client.pc.close()


async def test_hangup_after_the_peer_went_ends_the_detached_world(server: LiveServer) -> None:
    client = RtcClient()
    try:
        location, session_id, _, last = await started_world(server, client)
        await client.pc.close()
        await eventually(lambda: _state_is(server, session_id, "detached"), limit_s=GRACE_S)
        async with httpx.AsyncClient() as http:
            assert (await http.delete(f"{server.http_url}{location}", headers=auth())).status_code == 200
        assert (await get_session(server, session_id)).status_code == 404
        assert await slots_held(server) == 0
        await eventually(lambda: _request_gone(server, last["request_id"]))
    finally:
        await client.pc.close()


async def test_grace_expiry_ends_the_world_and_frees_the_slot(server: LiveServer) -> None:
    client = RtcClient()
    try:
        _, session_id, token, last = await started_world(server, client)
    finally:
        await client.pc.close()
    await eventually(lambda: _state_is(server, session_id, "detached"), limit_s=GRACE_S)
    detached_at = time.monotonic()
    assert await slots_held(server) == 1
    await eventually(lambda: _gone(server, session_id), limit_s=GRACE_S + 5)
    assert time.monotonic() - detached_at >= GRACE_S - 0.5  # not before the grace
    assert await slots_held(server) == 0
    assert last["request_id"] not in await live_requests(server)
    late = RtcClient()
    try:
        refused = await post_offer(
            server, late, {**auth(), "X-Omni-Resume-Token": token}, {"session_id": session_id}
        )
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "session_not_found"
    finally:
        await late.pc.close()


async def _state_is(server: LiveServer, session_id: str, state: str) -> bool:
    return bool((await state_of(server, session_id))["state"] == state)


async def _gone(server: LiveServer, session_id: str) -> bool:
    return (await get_session(server, session_id)).status_code == 404


async def _request_gone(server: LiveServer, request_id: str) -> bool:
    return request_id not in await live_requests(server)
