"""Admission at open: queue with updates, admitted after a wait, refused (1013, or 429 before
the upgrade), and 200 sessions opened, closed and killed with every counter back at zero."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
import websockets
from websockets.exceptions import InvalidStatus

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.realtime.wire import ServerEvents
from tests.sessions.client import opened, realtime_url, resumed, turn, until
from tests.sessions.conftest import on_server_async, session_server

pytestmark = pytest.mark.system

SLOTS = 2


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"),
        module_redis.url,
        max_sessions=SLOTS,
        admission_queue_s=1.5,
        admission_queue_max=1,
        disconnect_grace_s=0.3,
    ) as live:
        yield live


async def counters(server: LiveServer) -> dict[str, int]:
    host = server.ctx.host
    counts = await on_server_async(server, host.admission.counts())
    return {
        **host.stats(),
        "replica_active": counts.replica_active,
        "queued": counts.queued,
        "holders": counts.holders,
        "tickets": counts.tickets,
        "ctx_sessions": len(server.ctx.sessions),
    }


async def all_zero(server: LiveServer) -> bool:
    return not any((await counters(server)).values())


async def test_queued_then_admitted_when_a_slot_frees(server: LiveServer) -> None:
    async with (
        opened(server) as a,
        opened(server),
        websockets.connect(realtime_url(server, omni_extensions="1"), open_timeout=10) as ws,
        ServerEvents(ws.recv) as events,
    ):
        queued = (await events.next(10)).raw
        assert queued["type"] == "omni.admission.queued"
        assert queued["position"] == 1 and queued["estimated_wait_ms"] >= 0
        t0 = time.monotonic()
        await a.ws.close()  # a clean close parks `a` and frees its slot
        created = await events.wait_for("session.created", within_s=5)
        assert time.monotonic() - t0 < 1.5
        assert (await events.next(5)).type == "omni.session.resumable"
        assert created.raw["session"]["id"].startswith("sess_")
    await until(lambda: all_zero(server), within_s=10)


async def test_stock_client_waits_in_the_queue_without_omni_events(server: LiveServer) -> None:
    """A client that did not ask for `omni.*` events (a strict SDK) waits silently, then gets
    `session.created` and only standard events; its 101 carried the resume data as headers,
    and they resume the session."""
    async with (
        opened(server) as a,
        opened(server),
        websockets.connect(realtime_url(server), open_timeout=10) as ws,
        ServerEvents(ws.recv) as events,
    ):
        sid = ws.response.headers["X-Omni-Session-Id"]
        token = ws.response.headers["X-Omni-Resume-Token"]
        await a.ws.close()  # frees a slot
        created = await events.wait_for("session.created", within_s=5)
        assert created.raw["session"]["id"] == sid
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        await events.wait_for("input_audio_buffer.cleared", within_s=5)
        assert not [t for t in events.types() if t.startswith("omni.")], events.types()
        last = str(events.log[-1].raw["event_id"])
    async with resumed(server, sid, token, last) as again:
        assert again.events.log[0].raw["replay_count"] == 0
    await until(lambda: all_zero(server), within_s=10)


async def test_queue_deadline_refuses_with_error_and_1013(server: LiveServer) -> None:
    async with (
        opened(server),
        opened(server),
        websockets.connect(realtime_url(server, omni_extensions="1"), open_timeout=10) as ws,
        ServerEvents(ws.recv) as events,
    ):
        assert (await events.next(10)).type == "omni.admission.queued"
        error = (await events.wait_for("error", within_s=5)).raw["error"]
        assert error["code"] == "server_at_capacity"
        assert await events.close_code(within_s=5) == 1013
        assert "session.created" not in events.types()
    await until(lambda: all_zero(server), within_s=10)


async def test_input_while_queued_is_bounded_by_bytes(server: LiveServer) -> None:
    """A client streaming audio while it waits in the admission queue: frames are kept for
    the session up to QUEUED_INPUT_MAX_BYTES; past that the connection is closed with 1008 and
    a reason (never an unbounded buffer), and its queue place is given back."""
    from web.transports.realtime_ws import QUEUED_INPUT_MAX_BYTES

    append = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 64_000})
    async with (
        opened(server),
        opened(server),
        websockets.connect(realtime_url(server, omni_extensions="1"), open_timeout=10, max_size=None) as ws,
        ServerEvents(ws.recv) as events,
    ):
        assert (await events.next(10)).type == "omni.admission.queued"
        for _ in range(QUEUED_INPUT_MAX_BYTES // len(append) + 2):
            await ws.send(append)
        assert await events.close_code(within_s=5) == 1008
        assert ws.close_reason == "too much input while waiting in the admission queue"
        assert "session.created" not in events.types()
    await until(lambda: all_zero(server), within_s=10)


async def test_full_queue_is_429_with_retry_after_before_upgrade(server: LiveServer) -> None:
    async with (
        opened(server),
        opened(server),
        websockets.connect(realtime_url(server, omni_extensions="1"), open_timeout=10) as waiting,
        ServerEvents(waiting.recv) as ev,
    ):
        assert (await ev.next(10)).type == "omni.admission.queued"
        with pytest.raises(InvalidStatus) as caught:
            async with websockets.connect(realtime_url(server), open_timeout=10):
                pass
        response = caught.value.response
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        assert json.loads(response.body)["error"]["code"] == "server_at_capacity"
    await until(lambda: all_zero(server), within_s=10)


async def test_resume_that_needs_a_slot_is_429_when_full(server: LiveServer) -> None:
    async with opened(server) as parked:
        pass  # clean close: parked, its slot given back
    await until(lambda: all_zero(server), within_s=10)
    async with opened(server), opened(server):
        with pytest.raises(InvalidStatus) as caught:
            async with resumed(server, parked.session_id, parked.resume_token, parked.last_event_id):
                pass
        assert caught.value.response.status_code == 429
    # The two sessions above give their slots back asynchronously after their clean close.
    await until(lambda: all_zero(server), within_s=10)
    async with resumed(server, parked.session_id, parked.resume_token, parked.last_event_id):
        pass
    await until(lambda: all_zero(server), within_s=10)


@pytest.fixture(scope="module")
def big_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("big"), module_redis.url, max_sessions=256, disconnect_grace_s=0.5
    ) as live:
        yield live


async def test_open_close_and_kill_200_sessions_leaves_every_counter_at_zero(big_server: LiveServer) -> None:
    server = big_server
    n = 200
    sockets = await asyncio.gather(
        *(websockets.connect(realtime_url(server), open_timeout=30, max_size=None) for _ in range(n))
    )
    try:
        for ws in sockets:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert first["type"] == "session.created", first
        live = await counters(server)
        assert live["live"] == live["connected"] == live["replica_active"] == live["holders"] == n
        # Half close cleanly (parked now), half are killed (detached, parked after the grace).
        await asyncio.gather(*(ws.close() for ws in sockets[: n // 2]))
        for ws in sockets[n // 2 :]:
            ws.transport.abort()
        await until(lambda: all_zero(server), within_s=30)
    finally:
        for ws in sockets:
            ws.transport.abort()
    metrics = server.ctx.metrics.render().decode()
    assert "omniduplex_active_sessions 0.0" in metrics
    assert server.ctx.host.counts["client_closed"] >= n // 2
    assert server.ctx.host.counts["grace_expired"] >= n // 2


@pytest.fixture(scope="module")
def one_turn_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("turns"), module_redis.url, audio_ms=1500, max_generating=1, turn_queue_s=0.4
    ) as live:
        yield live


async def test_turn_that_cannot_start_in_time_fails_with_a_reason(one_turn_server: LiveServer) -> None:
    server = one_turn_server
    async with opened(server) as a, opened(server) as b:
        await turn(a, "long", wait=False)
        await a.events.wait_for("response.output_audio_transcript.delta", within_s=10)
        t0 = time.monotonic()
        refused = (await turn(b, "me too"))[-1].raw["response"]
        assert 0.3 < time.monotonic() - t0 < 2.0
        assert refused["status"] == "failed"
        assert "no generation slot" in refused["status_details"]["error"]["message"]
        assert (await a.events.wait_for("response.done", within_s=10)).raw["response"][
            "status"
        ] == "completed"
        # A slot is free again: the next turn runs.
        assert (await turn(b, "now"))[-1].raw["response"]["status"] == "completed"
    assert server.ctx.turn_gate.generating == 0 and server.ctx.turn_gate.waiting == 0
