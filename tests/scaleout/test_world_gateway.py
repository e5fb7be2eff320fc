"""World-model sessions through the gateway, with real processes (a redis-server, two replicas
and a gateway on loopback): ``/v1/realtime/video`` is routed and relayed like ``/v1/realtime``
(new → a picked replica, ``?session_id=`` → the world's owner), ``/v1/realtime/video/calls``
and its ``DELETE`` hangup like voice calls; a world counts in its replica's ``/readyz``,
``/metrics`` and registry load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiortc import RTCSessionDescription
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from loadtest.server_metrics import Scrape
from tests.scaleout.cluster import Cluster, Proc, get, replica_id_of, replicas_view, wait_until
from tests.world.conftest import VideoClient
from tests.world.test_rtc import RtcClient
from web.deploy.replica import opens_new_session
from web.gateway.relay import _client_close
from web.gateway.ws_endpoint import world_error

pytestmark = pytest.mark.system

START = {
    "type": "session.start",
    "model": "tiny-jepa",
    "format": "jpeg",
    "width": 64,
    "height": 64,
    "seed": 3,
}


def video_url(proc: Proc, query: str = "") -> str:
    return proc.url.replace("http://", "ws://") + "/v1/realtime/video" + query


async def open_world(gateway: Proc) -> tuple[VideoClient, str, str]:
    client = VideoClient(await connect(video_url(gateway, "?omni_extensions=1"), max_size=2**24))
    resumable = await client.event()
    assert resumable["type"] == "omni.session.resumable", resumable
    return client, resumable["session_id"], resumable["resume_token"]


async def session_state(proc: Proc, session_id: str) -> httpx.Response:
    return await get(f"{proc.url}/v1/sessions/{session_id}")


async def counts(replica: Proc) -> dict[str, Any]:
    """What the replica reports: ``/readyz`` sessions and ``/metrics`` active sessions."""
    ready = (await get(replica.url + "/readyz")).json()
    scrape = Scrape.parse((await get(replica.url + "/metrics")).text, 0.0)
    return {
        "readyz": ready["sessions"],
        "readyz_world": ready["sessions_by_kind"]["world"],
        "metrics": scrape.value("omniduplex_active_sessions"),
        "metrics_world": scrape.value("omniduplex_active_sessions_by_kind", kind="world"),
    }


async def by_id(c: Cluster) -> dict[str, Proc]:
    return {await replica_id_of(r): r for r in c.replicas}


async def registry_load(c: Cluster, replica_id: str) -> int:
    return next(int(r["load"]) for r in await replicas_view(c.gateway) if r["id"] == replica_id)


async def test_world_through_gateway_streams_counts_and_resumes_on_its_owner(shared: Cluster) -> None:
    c = shared
    replicas = await by_id(c)
    client, session_id, token = await open_world(c.gateway)
    await client.send(START)
    start = await client.expect("video.start")
    received = [await client.chunk() for _ in range(4)]
    assert all(ch.data for ch in received)  # binary frames pass the relay unchanged
    last = received[-1].meta["chunk_index"]

    # Bound to the replica that opened it; counted there (readyz, metrics, registry load).
    state = (await session_state(c.gateway, session_id)).json()
    assert state["kind"] == "world" and state["state"] == "active"
    owner_id = state["replica"]["id"]
    owner = replicas[owner_id]
    other = next(r for r in c.replicas if r is not owner)
    assert await counts(owner) == {"readyz": 1, "readyz_world": 1, "metrics": 1, "metrics_world": 1}
    assert await counts(other) == {"readyz": 0, "readyz_world": 0, "metrics": 0, "metrics_world": 0}

    async def loaded() -> bool:
        return await registry_load(c, owner_id) == 1

    await wait_until(loaded, 5, "the owner reports the world in its load")

    # Drop (no close frame): the gateway tells the owner 1001, not 1000, so the world detaches.
    client.ws.transport.abort()

    async def detached() -> bool:
        return (await session_state(c.gateway, session_id)).json().get("state") == "detached"

    await wait_until(detached, 10, "the world detaches on its owner")
    assert (await counts(owner))["readyz_world"] == 1  # a detached world still holds its slot

    # Resume through the gateway: routed to the owner, the only replica that has the world.
    resumed_ws = await connect(
        video_url(c.gateway, f"?session_id={session_id}"),
        additional_headers={"X-Omni-Resume-Token": token},
        max_size=2**24,
    )
    again = VideoClient(resumed_ws)
    async with again.ws:
        resumed = await again.event()
        assert resumed["type"] == "omni.session.resumed", resumed
        assert resumed["session_id"] == session_id and resumed["request_id"] == start["request_id"]
        assert resumed["chunk_index"] > last
        after = [await again.chunk() for _ in range(4)]
        indices = [ch.meta["chunk_index"] for ch in after]
        assert indices == list(range(resumed["chunk_index"], resumed["chunk_index"] + 4))
        assert all(ch.meta["request_id"] == start["request_id"] for ch in after)
        state = (await session_state(c.gateway, session_id)).json()
        assert state["state"] == "active" and state["replica"]["id"] == owner_id
        await again.send({"type": "session.stop"})
        await again.expect("session.done")

    async def gone() -> bool:
        return (await session_state(c.gateway, session_id)).status_code == 404

    await wait_until(gone, 10, "the world ends after session.stop and close")

    async def uncounted() -> bool:
        return await counts(owner) == {"readyz": 0, "readyz_world": 0, "metrics": 0, "metrics_world": 0}

    await wait_until(uncounted, 10, "the ended world is no longer counted")


async def test_resume_after_the_owner_died_is_404_not_a_retry_loop(two_replicas: Cluster) -> None:
    """A world lives in its owner's process only: once the owner is killed, the live replica
    refuses to take it over (409) and the gateway answers 404 ``session_not_found``, as a
    replica does for a direct resume of a world whose process is gone, not ``retry later``."""
    c = two_replicas
    replicas = await by_id(c)
    client, session_id, token = await open_world(c.gateway)
    await client.send(START)
    await client.expect("video.start")
    owner = replicas[(await session_state(c.gateway, session_id)).json()["replica"]["id"]]
    owner.kill9()
    with pytest.raises(InvalidStatus) as refused:
        await connect(
            video_url(c.gateway, f"?session_id={session_id}"),
            additional_headers={"X-Omni-Resume-Token": token},
        )
    assert refused.value.response.status_code == 404
    assert json.loads(refused.value.response.body)["error"]["code"] == "session_not_found"
    client.ws.transport.abort()


async def test_world_call_through_gateway_and_delete_hangup_finds_its_replica(shared: Cluster) -> None:
    c = shared
    replicas = await by_id(c)
    client = RtcClient()
    try:
        await client.pc.setLocalDescription(await client.pc.createOffer())
        async with httpx.AsyncClient(trust_env=False, timeout=20) as http:
            answer = await http.post(
                f"{c.gateway.url}/v1/realtime/video/calls",
                content=client.pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp"},
            )
        assert answer.status_code == 201, answer.text
        location = answer.headers["location"]
        assert location.startswith("/v1/realtime/video/calls/vrtc_")
        session_id = answer.headers["x-omni-session-id"]
        await client.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        await asyncio.wait_for(client.opened.wait(), 15)  # media and controls go to the replica
        client.send(START)
        await client.expect("video.start")
        status = await client.expect("video.chunk_metadata")
        assert status["kind"] == "rtp"
        state = (await session_state(c.gateway, session_id)).json()
        assert state["transport"] == "webrtc"
        owner = replicas[state["replica"]["id"]]
        assert (await counts(owner))["readyz_world"] == 1

        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            hung_up = await http.delete(f"{c.gateway.url}{location}")  # routed by the call record
            assert hung_up.status_code == 200, hung_up.text  # as a voice call's hangup answers

            async def ended() -> bool:
                return (await counts(owner))["readyz_world"] == 0

            await wait_until(ended, 20, "the call's world ends on its replica")
            again = await http.delete(f"{c.gateway.url}{location}")
            assert again.status_code == 404  # the replica no longer has the call
            unknown = await http.delete(f"{c.gateway.url}/v1/realtime/video/calls/vrtc_unknown")
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "call_not_found"
    finally:
        await client.pc.close()


async def test_no_live_replica_gives_a_world_error_and_1013(db_url: str, tmp_path: Path) -> None:
    c = Cluster(db_url, tmp_path)  # a registry nobody registered in
    try:
        gw = c.add_gateway()
        async with connect(video_url(gw)) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            # the world protocol's error shape (code at the top), not the realtime one
            assert error == {"type": "error", "code": "no_replica_available", "message": error["message"]}
            try:
                await asyncio.wait_for(ws.recv(), 10)
                raise AssertionError("the gateway kept the connection open")
            except ConnectionClosed as closed:
                assert closed.rcvd is not None and closed.rcvd.code == 1013
        async with httpx.AsyncClient(trust_env=False) as http:
            offer = await http.post(f"{gw.url}/v1/realtime/video/calls", content=b"v=0")
        assert offer.status_code == 503 and offer.json()["error"]["code"] == "no_replica_available"
    finally:
        c.stop()


def test_a_draining_replica_refuses_new_worlds_only() -> None:
    ws = {"type": "websocket", "path": "/v1/realtime/video", "query_string": b""}
    assert opens_new_session(ws)
    assert not opens_new_session({**ws, "query_string": b"session_id=sess_1"})  # a resume passes
    assert opens_new_session({"type": "http", "method": "POST", "path": "/v1/realtime/video/calls"})
    assert not opens_new_session({"type": "http", "method": "DELETE", "path": "/v1/realtime/video/calls/v"})
    assert world_error("x", "y") == {"type": "error", "code": "x", "message": "y"}


def test_a_client_that_sent_no_close_code_is_a_drop_for_the_replica() -> None:
    """A lost client (uvicorn reports 1005 for a lost TCP connection, 1006 abnormal) is relayed
    as 1001: a clean 1000 would end a world instead of detaching it for a resume."""
    assert [_client_close(code, "")[0] for code in (1005, 1006, 1015)] == [1001] * 3
    assert _client_close(1000, "bye") == (1000, "bye")  # a deliberate close stays as it was
    assert _client_close(4001, "x") == (4001, "x")
