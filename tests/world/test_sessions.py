"""World sessions on the session layer, against a real server (tests/live_server.py) on a real
redis-server: identity, admission slots shared with voice sessions, the Redis record, retention
(disconnect grace) and resume onto the running world.

The server takes one session at a time (``max_sessions=1``, no admission queue), so every test
also checks that the one before it gave its slot back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest_redis import RedisServerProcess, start_tcp_redis
from tests.live_server import LiveServer, live_server
from tests.world.conftest import VideoClient

pytestmark = pytest.mark.system

T = TypeVar("T")

KEY, OTHER_KEY = "sk-world-a", "sk-world-b"
GRACE_S = 2.0
PIPELINE = "world-tiny-jepa"
START = {
    "type": "session.start",
    "model": "tiny-jepa",
    "format": "jpeg",
    "width": 64,
    "height": 64,
    "seed": 3,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    redis: RedisServerProcess = start_tcp_redis(tmp_path_factory.mktemp("redis"))
    try:
        with live_server(
            Path(tmp_path_factory.mktemp("srv")),
            pipeline="null",
            vad=False,
            redis_url=redis.url,
            api_keys=f"{KEY}:tenant-a,{OTHER_KEY}:tenant-b",
            max_sessions=1,
            admission_queue_max=0,  # a full replica refuses at once (429), voice and world alike
            disconnect_grace_s=GRACE_S,
        ) as live:
            yield live
    finally:
        redis.stop()


@pytest.fixture(autouse=True)
async def slot_free_before(request: pytest.FixtureRequest) -> None:
    """Each test on ``server`` starts once the one before it gave its slot back."""
    if "server" in request.fixturenames:
        await eventually(lambda: slot_is_free(request.getfixturevalue("server")))


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def on_server(server: LiveServer, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the server's event loop (its state is touched only there)."""
    loop = server.ctx.host.loop
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    return await asyncio.wait_for(asyncio.wrap_future(future), 10)


async def live_requests(server: LiveServer) -> list[str]:
    async def read() -> list[str]:
        orchestrator = server.server.config.app.state.video.runtimes.running.get(PIPELINE)
        return [] if orchestrator is None else orchestrator.live_requests

    return await on_server(server, read())


async def world_stats(server: LiveServer) -> dict[str, int]:
    async def read() -> dict[str, int]:
        stats: dict[str, int] = server.server.config.app.state.ctx.world.stats()
        return stats

    return await on_server(server, read())


async def eventually(check: Callable[[], Coroutine[Any, Any, bool]], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def open_world(server: LiveServer, key: str = KEY, **kwargs: Any) -> tuple[VideoClient, dict[str, Any]]:
    """A new world session: its client and its ``omni.session.resumable`` event (the first: the
    client asks for ``omni.*`` events)."""
    ws = await connect(
        f"{server.ws_url}/v1/realtime/video?omni_extensions=1",
        additional_headers=auth(key),
        max_size=2**24,
        **kwargs,
    )
    client = VideoClient(ws)
    resumable = await client.event()
    assert resumable["type"] == "omni.session.resumable", resumable
    assert resumable["session_id"].startswith("sess_") and resumable["resume_token"].startswith("rt_")
    return client, resumable


async def resume(server: LiveServer, session_id: str, token: str, key: str = KEY) -> VideoClient:
    headers = {**auth(key), "X-Omni-Resume-Token": token}
    url = f"{server.ws_url}/v1/realtime/video?session_id={session_id}"
    return VideoClient(await connect(url, additional_headers=headers, max_size=2**24))


async def refused(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of a WebSocket open refused before the upgrade."""
    try:
        ws = await connect(url, additional_headers=headers)
    except InvalidStatus as exc:
        return exc.response.status_code, json.loads(exc.response.body or b"{}")
    await ws.close()
    raise AssertionError(f"{url} was accepted")


async def get_session(server: LiveServer, session_id: str, key: str = KEY) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"{server.http_url}/v1/sessions/{session_id}", headers=auth(key))


def drop(client: VideoClient) -> None:
    """Lose the connection: TCP gone, no close frame (the server sees 1006)."""
    client.ws.transport.abort()


async def slot_is_free(server: LiveServer) -> bool:
    """A new world session opens (and is closed again with 1000; its record goes after its
    slot, so once it answers 404 the slot is free for the next test)."""
    try:
        client, resumable = await open_world(server)
    except InvalidStatus as exc:
        assert exc.response.status_code == 429
        return False
    await client.ws.close()
    await eventually(lambda: _gone(server, resumable["session_id"]))
    return True


async def test_world_session_takes_a_slot_shared_with_voice(server: LiveServer) -> None:
    voice_url = f"{server.ws_url}/v1/realtime"
    client, resumable = await open_world(server)
    session_id = resumable["session_id"]
    # the only slot is taken: another world and a voice session are refused before the upgrade
    status, body = await refused(f"{server.ws_url}/v1/realtime/video", auth())
    assert status == 429 and body["error"]["code"] == "server_at_capacity"
    status, body = await refused(voice_url, auth(OTHER_KEY))
    assert status == 429 and body["error"]["code"] == "server_at_capacity"
    # its record: kind world, active, the tenant's only
    state = await get_session(server, session_id)
    assert state.status_code == 200
    body = state.json()
    assert body["kind"] == "world" and body["state"] == "active" and body["connected"] is True
    assert (await get_session(server, session_id, OTHER_KEY)).status_code == 404
    await client.send(START)
    start = await client.expect("video.start")
    assert start["session_id"] == session_id
    await client.chunk()
    await eventually(lambda: _world_config_recorded(server, session_id))
    # session.stop, then a clean close: the session ends, its slot is free for voice
    await client.send({"type": "session.stop"})
    await client.expect("session.done")
    await client.ws.close()
    await eventually(lambda: _gone(server, session_id))
    voice = await connect(voice_url, additional_headers=auth(OTHER_KEY))
    async with voice:
        created = json.loads(await asyncio.wait_for(voice.recv(), 10))
        assert created["type"] == "session.created"
        # while voice holds the slot, a world session is refused
        status, body = await refused(f"{server.ws_url}/v1/realtime/video", auth())
        assert status == 429 and body["error"]["code"] == "server_at_capacity"
    await eventually(lambda: slot_is_free(server))


async def _world_config_recorded(server: LiveServer, session_id: str) -> bool:
    """The Redis record holds the running generation's config (model, format, size, ...)."""

    async def read() -> dict[str, Any]:
        record = await server.ctx.host.store.get_session("tenant-a", session_id)
        return dict(record.config)

    config = await on_server(server, read())
    return bool(
        config.get("model") == "tiny-jepa" and config.get("width") == 64 and config.get("format") == "jpeg"
    )


async def _gone(server: LiveServer, session_id: str) -> bool:
    return (await get_session(server, session_id)).status_code == 404


async def test_drop_detaches_and_resume_continues_the_world(server: LiveServer) -> None:
    client, resumable = await open_world(server)
    session_id, token = resumable["session_id"], resumable["resume_token"]
    await client.send(START)
    start = await client.expect("video.start")
    request_id = start["request_id"]
    received = [await client.chunk() for _ in range(4)]
    last = received[-1].meta["chunk_index"]
    drop(client)
    await eventually(lambda: _state_is(server, session_id, "detached"))
    assert request_id in await live_requests(server)  # the world runs on (paused)
    # detached: the world holds its place; nothing is generated for nobody
    state = (await get_session(server, session_id)).json()
    held = state["world"]["chunk_index"]
    await asyncio.sleep(0.5)
    assert (await get_session(server, session_id)).json()["world"]["chunk_index"] == held
    # a bad token, an unknown id, another tenant: refused before the upgrade
    url = f"{server.ws_url}/v1/realtime/video?session_id={session_id}"
    status, body = await refused(url, {**auth(), "X-Omni-Resume-Token": "rt_wrong"})
    assert status == 403 and body["error"]["code"] == "invalid_resume_token"
    status, body = await refused(url, auth())
    assert status == 403 and body["error"]["code"] == "invalid_resume_token"
    unknown = f"{server.ws_url}/v1/realtime/video?session_id=sess_{'x' * 24}"
    status, body = await refused(unknown, {**auth(), "X-Omni-Resume-Token": token})
    assert status == 404 and body["error"]["code"] == "session_not_found"
    status, body = await refused(url, {**auth(OTHER_KEY), "X-Omni-Resume-Token": token})
    assert status == 404 and body["error"]["code"] == "session_not_found"
    # resume: where the world is, then chunks from there (no restart from chunk 0)
    again = await resume(server, session_id, token)
    async with again.ws:
        resumed = await again.event()
        assert resumed["type"] == "omni.session.resumed"
        assert resumed["session_id"] == session_id and resumed["request_id"] == request_id
        assert resumed["phase"] == "streaming" and resumed["format"] == "jpeg"
        assert resumed["config"]["model"] == "tiny-jepa" and resumed["config"]["width"] == 64
        assert resumed["chunk_index"] > last
        after = [await again.chunk() for _ in range(4)]
        indices = [c.meta["chunk_index"] for c in after]
        assert indices[0] == resumed["chunk_index"]
        assert indices == list(range(indices[0], indices[0] + 4))
        assert all(c.meta["request_id"] == request_id and c.data for c in after)
        assert (await get_session(server, session_id)).json()["state"] == "active"
        await again.send({"type": "session.stop"})
        await again.expect("session.done")
    await eventually(lambda: _gone(server, session_id))
    assert request_id not in await live_requests(server)


async def test_stock_client_gets_no_omni_event_and_resumes_from_the_101(server: LiveServer) -> None:
    """A client that did not ask for ``omni.*`` events (vLLM-Omni's example client) sees
    ``video.start`` first; its resume data came as headers on the 101, and they resume it."""
    ws = await connect(f"{server.ws_url}/v1/realtime/video", additional_headers=auth(), max_size=2**24)
    assert ws.response is not None
    session_id = ws.response.headers["X-Omni-Session-Id"]
    token = ws.response.headers["X-Omni-Resume-Token"]
    assert session_id.startswith("sess_") and token.startswith("rt_")
    client = VideoClient(ws)
    await client.send(START)
    first = await client.event()
    assert first["type"] == "video.start" and first["session_id"] == session_id, first
    await client.chunk()
    drop(client)
    await eventually(lambda: _state_is(server, session_id, "detached"))
    again = await resume(server, session_id, token)  # a resume asks for `omni.*` by itself
    async with again.ws:
        resumed = await again.event()
        assert resumed["type"] == "omni.session.resumed" and resumed["session_id"] == session_id
        await again.send({"type": "session.stop"})
        await again.expect("session.done")
    await eventually(lambda: _gone(server, session_id))


async def test_resumed_frames_continue_the_same_trajectory(server: LiveServer) -> None:
    """tiny-jepa is deterministic for a seed: a world resumed after a drop sends, chunk for
    chunk, the frames a world never interrupted sends (the rolling context survived)."""
    reference, _ = await open_world(server)
    async with reference.ws:
        await reference.send(START)
        await reference.expect("video.start")
        expected = {c.meta["chunk_index"]: c.data for c in [await reference.chunk() for _ in range(10)]}
        await reference.send({"type": "session.stop"})
        await reference.expect("session.done")
    await eventually(lambda: slot_is_free(server))
    client, resumable = await open_world(server)
    await client.send(START)
    await client.expect("video.start")
    for _ in range(3):
        await client.chunk()
    drop(client)
    await eventually(lambda: _state_is(server, resumable["session_id"], "detached"))
    again = await resume(server, resumable["session_id"], resumable["resume_token"])
    async with again.ws:
        resumed = await again.event()
        assert resumed["type"] == "omni.session.resumed"
        compared = 0
        while compared < 3:
            chunk = await again.chunk()
            index = chunk.meta["chunk_index"]
            assert index in expected, f"chunk {index} is past the reference run"
            assert chunk.data == expected[index], f"chunk {index} differs from the uninterrupted run"
            compared += 1
        await again.send({"type": "session.stop"})
        await again.expect("session.done")
    await eventually(lambda: slot_is_free(server))


async def _state_is(server: LiveServer, session_id: str, state: str) -> bool:
    response = await get_session(server, session_id)
    return response.status_code == 200 and response.json()["state"] == state


async def test_grace_expiry_cancels_the_world_and_frees_the_slot(server: LiveServer) -> None:
    client, resumable = await open_world(server)
    session_id, token = resumable["session_id"], resumable["resume_token"]
    await client.send(START)
    request_id = (await client.expect("video.start"))["request_id"]
    await client.chunk()
    drop(client)
    await eventually(lambda: _state_is(server, session_id, "detached"))
    dropped_at = time.monotonic()
    assert request_id in await live_requests(server)
    await eventually(lambda: _gone(server, session_id), limit_s=GRACE_S + 5)
    assert time.monotonic() - dropped_at >= GRACE_S - 0.5  # not before the grace
    assert request_id not in await live_requests(server)
    assert await world_stats(server) == {"live": 0, "connected": 0, "unreleased": 0, "tasks": 0}
    url = f"{server.ws_url}/v1/realtime/video?session_id={session_id}"
    status, body = await refused(url, {**auth(), "X-Omni-Resume-Token": token})
    assert status == 404 and body["error"]["code"] == "session_not_found"
    assert await slot_is_free(server)


async def test_session_stop_then_drop_ends_at_once(server: LiveServer) -> None:
    client, resumable = await open_world(server)
    session_id = resumable["session_id"]
    await client.send(START)
    request_id = (await client.expect("video.start"))["request_id"]
    await client.chunk()
    await client.send({"type": "session.stop"})
    await client.expect("session.done")
    drop(client)  # no world is running: nothing to keep through a grace period
    began = time.monotonic()
    await eventually(lambda: _gone(server, session_id), limit_s=GRACE_S)
    assert time.monotonic() - began < GRACE_S
    assert request_id not in await live_requests(server)
    assert await slot_is_free(server)


async def test_clean_close_while_generating_ends_at_once(server: LiveServer) -> None:
    client, resumable = await open_world(server)
    session_id = resumable["session_id"]
    await client.send(START)
    request_id = (await client.expect("video.start"))["request_id"]
    await client.chunk()
    await client.ws.close(1000)
    await eventually(lambda: _gone(server, session_id), limit_s=GRACE_S)
    await eventually(lambda: _request_gone(server, request_id), limit_s=GRACE_S)
    assert await slot_is_free(server)


async def _request_gone(server: LiveServer, request_id: str) -> bool:
    return request_id not in await live_requests(server)


async def test_delete_ends_a_live_world(server: LiveServer) -> None:
    client, resumable = await open_world(server)
    session_id = resumable["session_id"]
    await client.send(START)
    request_id = (await client.expect("video.start"))["request_id"]
    await client.chunk()
    async with httpx.AsyncClient() as http:
        url = f"{server.http_url}/v1/sessions/{session_id}"
        assert (await http.delete(url, headers=auth(OTHER_KEY))).status_code == 404
        deleted = await http.delete(url, headers=auth())
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await asyncio.wait_for(client.ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
    assert (await get_session(server, session_id)).status_code == 404
    await eventually(lambda: _request_gone(server, request_id))
    assert await slot_is_free(server)


async def test_refusals_before_the_upgrade(server: LiveServer) -> None:
    video = f"{server.ws_url}/v1/realtime/video"
    status, body = await refused(video, {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = await refused(video, auth("sk-nobody"))
    assert status == 401
    status, body = await refused(f"{video}?session_id=not-an-id", {**auth(), "X-Omni-Resume-Token": "rt_x"})
    assert status == 404 and body["error"]["code"] == "session_not_found"
    # a voice session's id is no world
    voice = await connect(f"{server.ws_url}/v1/realtime?omni_extensions=1", additional_headers=auth())
    async with voice:
        events = [json.loads(await asyncio.wait_for(voice.recv(), 10)) for _ in range(2)]
        resumable = next(e for e in events if e["type"] == "omni.session.resumable")
        url = f"{video}?session_id={resumable['session_id']}"
        status, body = await refused(url, {**auth(), "X-Omni-Resume-Token": resumable["resume_token"]})
        assert status == 404 and body["error"]["code"] == "session_not_found"
    await eventually(lambda: slot_is_free(server))


async def _post_offer(server: LiveServer, client: Any, headers: dict[str, str]) -> httpx.Response:
    await client.pc.setLocalDescription(await client.pc.createOffer())
    async with httpx.AsyncClient() as http:
        return await http.post(
            f"{server.http_url}/v1/realtime/video/calls",
            content=client.pc.localDescription.sdp,
            headers={"Content-Type": "application/sdp", **headers},
        )


async def test_webrtc_call_is_a_hosted_world_session(server: LiveServer) -> None:
    from aiortc import RTCSessionDescription

    from tests.world.test_rtc import RtcClient

    nobody = RtcClient()
    try:
        assert (await _post_offer(server, nobody, {})).status_code == 401
    finally:
        await nobody.pc.close()
    async with httpx.AsyncClient() as http:  # a bad offer after admission gives the slot back
        bad = await http.post(f"{server.http_url}/v1/realtime/video/calls", content=b"v=0", headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_offer"
    client = RtcClient()
    try:
        answer = await _post_offer(server, client, auth())
        assert answer.status_code == 201, answer.text
        session_id = answer.headers["x-omni-session-id"]
        await client.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        await asyncio.wait_for(client.opened.wait(), 15)
        client.send(START)
        await client.expect("video.start")
        await client.expect("video.chunk_metadata")
        body = (await get_session(server, session_id)).json()
        assert body["kind"] == "world" and body["transport"] == "webrtc" and body["state"] == "active"
        # the call holds the only slot
        status, refusal = await refused(f"{server.ws_url}/v1/realtime/video", auth())
        assert status == 429 and refusal["error"]["code"] == "server_at_capacity"
        second = RtcClient()
        try:
            assert (await _post_offer(server, second, auth())).status_code == 429
        finally:
            await second.pc.close()
    finally:
        await client.pc.close()  # no hangup: detached for the grace (test_rtc_resume.py), then gone
    await eventually(lambda: _gone(server, session_id), limit_s=20)
    await eventually(lambda: slot_is_free(server))


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Idle TTL 2.5 s and a 6 s lifetime (the writer refreshes the keys' TTL about every
    second while a world streams: the idle TTL leaves it a margin on a busy machine)."""
    with live_server(
        Path(tmp_path_factory.mktemp("short")),
        pipeline="null",
        vad=False,
        api_keys=f"{KEY}:tenant-a",
        idle_ttl_s=2.5,
        max_lifetime_s=6.0,
    ) as live:
        yield live


async def _expired(client: VideoClient, limit_s: float) -> dict[str, Any]:
    """Read until the server closes: the ``session_expired`` error, and close code 1001."""
    error: dict[str, Any] | None = None
    try:
        while True:
            message = await asyncio.wait_for(client.ws.recv(), limit_s)
            if isinstance(message, str) and json.loads(message)["type"] == "error":
                error = json.loads(message)
    except ConnectionClosed as closed:
        assert closed.rcvd is not None and closed.rcvd.code == 1001
    assert error is not None and error["code"] == "session_expired", error
    return error


async def test_idle_world_session_expires(short_server: LiveServer) -> None:
    client, resumable = await open_world(short_server)
    began = time.monotonic()
    await _expired(client, 10)  # connected, but nothing asked and nothing sent
    assert time.monotonic() - began >= 2.0
    assert (await get_session(short_server, resumable["session_id"])).status_code == 404


async def test_streaming_world_session_ends_at_its_lifetime(short_server: LiveServer) -> None:
    client, resumable = await open_world(short_server)
    began = time.monotonic()
    await client.send(START)
    request_id = (await client.expect("video.start"))["request_id"]
    while time.monotonic() - began < 4.0:  # past the idle TTL: the chunks keep it active
        await client.chunk()
    state = await get_session(short_server, resumable["session_id"])
    assert state.status_code == 200 and state.json()["state"] == "active"
    error = await _expired(client, 10)  # but not past its lifetime
    assert time.monotonic() - began >= 5.0
    assert error["request_id"] == request_id and "maximum duration" in error["message"]
    assert (await get_session(short_server, resumable["session_id"])).status_code == 404
    assert request_id not in await live_requests(short_server)


async def test_resumed_m4s_stream_starts_with_an_init_segment(server: LiveServer) -> None:
    """A resumed client has a new player: its first fMP4 chunk carries the init segment and
    decodes on its own."""
    import io

    import av

    client, resumable = await open_world(server)
    await client.send({**START, "format": "m4s"})
    await client.expect("video.start")
    first = await client.chunk()
    assert first.meta["init_byte_length"] > 0
    later = await client.chunk()
    assert later.meta.get("init_byte_length") is None
    drop(client)
    await eventually(lambda: _state_is(server, resumable["session_id"], "detached"))
    again = await resume(server, resumable["session_id"], resumable["resume_token"])
    async with again.ws:
        assert (await again.event())["type"] == "omni.session.resumed"
        chunk = await again.chunk()
        assert chunk.meta["chunk_index"] > later.meta["chunk_index"]
        assert chunk.meta["init_byte_length"] > 0
        with av.open(io.BytesIO(chunk.data), format="mp4") as container:
            frames = list(container.decode(video=0))
        assert len(frames) == chunk.meta["frame_count"] and frames[0].width == 64
        await again.send({"type": "session.stop"})
        await again.expect("session.done")
