"""Resume after a dropped connection: exact replay, live handoff, restore, resync, tokens."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from session.store import SessionStore
from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.realtime.wire import Received
from tests.sessions.client import (
    logged,
    opened,
    position,
    realtime_url,
    reply_text,
    resumed,
    seq,
    turn,
    user_text,
)
from tests.sessions.conftest import on_server_async, session_server

pytestmark = pytest.mark.system

RESPONSE_MS = 2000  # long enough to drop in the middle and still have a live tail after resume


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(tmp_path_factory.mktemp("srv"), module_redis.url, audio_ms=RESPONSE_MS) as live:
        yield live


async def session_log(server: LiveServer, session_id: str) -> list[dict]:
    """Every event the session sent: the logged ones from Redis, the audio deltas its writer
    holds in this process, in order."""
    writer = server.ctx.host.sessions[session_id].writer
    replay = await on_server_async(server, writer.replay(None))
    assert replay.held == "complete"
    return replay.events


async def redis_log(server: LiveServer, session_id: str) -> list[dict]:
    store: SessionStore = server.ctx.host.store
    return await on_server_async(server, store.events_after(session_id, None))


def shape(events: list[dict]) -> list[tuple[str, str]]:
    """What an uninterrupted run must match: event types and payload deltas, ids aside."""
    return [(e["type"], str(e.get("delta", ""))) for e in events]


async def test_drop_mid_response_then_resume_gets_every_event_once_in_order(server: LiveServer) -> None:
    async with opened(server) as first:
        await turn(first, "tell me a story", wait=False)
        deltas = 0
        while deltas < 5:
            deltas += (await first.events.next()).type == "response.output_audio.delta"
        first.abort()
        before = list(first.events.log)
    session_id, token = first.session_id, first.resume_token
    await asyncio.sleep(0.3)  # reconnecting takes a while; the response streams on meanwhile

    async with resumed(server, session_id, token, before[-1].raw["event_id"]) as second:
        after: list[Received] = await second.events.collect_until("response.done", within_s=30)
        replay_count = second.events.log[0].raw["replay_count"]
        sent = await session_log(server, session_id)  # while the session is still hosted here

    received = logged(before) + logged(after)
    places = [position(e) for e in received]
    assert places == sorted(set(places)), "out of order or duplicated in the received sequence"
    durable = [p for p, held in places if not held]
    assert durable == list(range(1, len(durable) + 1)), "a gap in the logged sequence"
    assert received[-1]["type"] == "response.done" and received[-1]["response"]["status"] == "completed"
    # Part of it was replayed, audio deltas included (held by this process, not in Redis),
    # the rest arrived live after the handoff.
    assert 0 < replay_count < len(logged(after))
    assert second.events.log[0].raw["audio_replay"] == "complete"
    replayed = [r.raw for r in second.events.log[1 : 1 + replay_count]]
    assert any(e["type"] == "response.output_audio.delta" for e in replayed)
    # Same ids and content as what the session sent, i.e. what an uninterrupted client got.
    assert received == sent
    assert await redis_log(server, session_id) == [
        e for e in received if e["type"] != "response.output_audio.delta"
    ]

    # And the same sequence as a run that was never interrupted (ids aside).
    async with opened(server) as reference:
        await turn(reference, "tell me a story", wait=False)
        await reference.events.collect_until("response.done", within_s=30)
    expected = logged(reference.events.log)
    assert shape(received) == shape(expected)


async def test_resume_after_the_response_ended_replays_it_then_continues(server: LiveServer) -> None:
    async with opened(server) as first:
        await user_text(first, "first")
        last_seen = first.last_event_id
        await first.send({"type": "response.create"})
        first.abort()
    async with resumed(server, first.session_id, first.resume_token, last_seen) as second:
        replay = await second.events.collect_until("response.done", within_s=30)
        assert "first | history: -" in reply_text(replay)
        reply = await turn(second, "second")
        # The history of the new turn has the first one.
        assert reply_text(reply).startswith("second | history: user:first / assistant:first | history: -")


async def test_clean_close_parks_then_resume_restores_from_redis(server: LiveServer) -> None:
    async with opened(server) as first:
        await turn(first, "remember me")
        last = first.last_event_id
    host = server.ctx.host
    # A close with 1000 parks the session: it leaves the process but stays in Redis.
    for _ in range(100):
        if first.session_id not in host.sessions:
            break
        await asyncio.sleep(0.02)
    assert first.session_id not in host.sessions
    async with resumed(server, first.session_id, first.resume_token, last) as second:
        assert second.events.log[0].raw["replay_count"] == 0
        reply = await turn(second, "and now")
        assert "user:remember me / assistant:remember me | history: -" in reply_text(reply)


async def test_ids_of_our_shape_that_are_not_ours_get_a_snapshot(server: LiveServer) -> None:
    """`last_event_id`s that look like ours: a non-ASCII digit (int() refuses "²", which
    str.isdigit takes), a held event this session never sent, another session's tag."""
    async with opened(server) as first:
        await user_text(first, "snap")
        last = str(first.events.log[-1].raw["event_id"])
        first.abort()
    tag = last.split("_")[1]
    for bogus in (f"event_{tag}_0_\u00b2", f"{last}.999999", f"event_{tag}_0_1.0", "event_ZZZZZZZZ_0_1.1"):
        async with resumed(server, first.session_id, first.resume_token, bogus) as again:
            hello = again.events.log[0].raw
            assert hello["replay_count"] == 0 and hello["replay_unavailable"] == "unknown_event_id", bogus
            assert (await again.events.next()).type == "omni.session.snapshot"
            again.abort()


async def test_unreplayable_id_gets_a_snapshot(server: LiveServer) -> None:
    async with opened(server) as first:
        item_id = await user_text(first, "snap")
        first.abort()
    bogus = "event_nothere_0_999999"
    async with resumed(server, first.session_id, first.resume_token, bogus) as second:
        resumed_event = second.events.log[0].raw
        assert (
            resumed_event["replay_count"] == 0 and resumed_event["replay_unavailable"] == "unknown_event_id"
        )
        snapshot = (await second.events.next()).raw
        assert snapshot["type"] == "omni.session.snapshot"
        assert snapshot["session"]["id"] == first.session_id
        assert [i["id"] for i in snapshot["items"]] == [item_id]
        # Resuming from the snapshot's id means: from the last logged event before it.
        second.abort()
    async with resumed(server, first.session_id, first.resume_token, snapshot["event_id"]) as third:
        assert third.events.log[0].raw["replay_count"] == 0


async def test_resume_token_by_subprotocol(server: LiveServer) -> None:
    async with opened(server) as first:
        first.abort()
    async with resumed(
        server, first.session_id, first.resume_token, first.last_event_id, via_subprotocol=True
    ) as second:
        assert second.ws.subprotocol == "realtime"


@pytest.mark.parametrize("token", [None, "rt_wrong"], ids=["missing", "wrong"])
async def test_bad_resume_token_is_403_before_upgrade(server: LiveServer, token: str | None) -> None:
    async with opened(server) as first:
        first.abort()
    headers = {"X-Omni-Resume-Token": token} if token else {}
    url = realtime_url(server, session_id=first.session_id, last_event_id=first.last_event_id)
    with pytest.raises(InvalidStatus) as caught:
        async with websockets.connect(url, additional_headers=headers, open_timeout=10):
            pass
    response = caught.value.response
    assert response.status_code == 403
    body = response.body.decode()
    assert '"invalid_resume_token"' in body
    assert first.session_id not in body and "expires" not in body


async def test_unknown_session_is_404(server: LiveServer) -> None:
    url = realtime_url(server, session_id="sess_doesnotexist0000000000", last_event_id="event_x_0_1")
    with pytest.raises(InvalidStatus) as caught:
        async with websockets.connect(
            url, additional_headers={"X-Omni-Resume-Token": "rt_x"}, open_timeout=10
        ):
            pass
    assert caught.value.response.status_code == 404
    assert b'"session_not_found"' in caught.value.response.body


async def test_session_state_and_delete(server: LiveServer) -> None:
    async with opened(server) as conn:
        await turn(conn, "state")
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            state = (await http.get(f"/v1/sessions/{conn.session_id}")).json()
            assert state["state"] == "active" and state["connected"] and state["live_here"]
            assert state["event_count"] == seq(conn.events.log[-1].raw)
            # The turn's audio deltas are held here for a resume, not counted as logged events.
            deltas = [r.raw for r in conn.events.log if r.type == "response.output_audio.delta"]
            # Held as PCM (and the JSON around it once), not as the events' base64 text.
            pcm = sum(len(base64.b64decode(d["delta"])) for d in deltas)
            assert deltas and pcm < state["log"]["held_bytes"] < sum(len(d["delta"]) for d in deltas)
            assert state["log"]["held_dropped"] == 0
            deleted = await http.delete(f"/v1/sessions/{conn.session_id}")
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            assert await conn.events.close_code(within_s=10) == 1000
            assert (await http.get(f"/v1/sessions/{conn.session_id}")).status_code == 404
