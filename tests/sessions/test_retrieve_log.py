"""`conversation.item.retrieved` on a real server and redis-server: sent in full, logged as a
reference to its item (so a retrieve never copies the item into Redis), and rebuilt from the
conversation when a resume replays it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from session.store import SessionStore
from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import logged, opened, resumed, user_text
from tests.sessions.conftest import on_server_async, session_server

pytestmark = pytest.mark.system

TEXT = "retrieve me " * 20_000  # 240 KB


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(tmp_path_factory.mktemp("srv"), module_redis.url) as live:
        yield live


async def redis_log(server: LiveServer, session_id: str) -> list[dict]:
    store: SessionStore = server.ctx.host.store
    writer = server.ctx.host.sessions[session_id].writer
    await on_server_async(server, writer.flush())
    return await on_server_async(server, store.events_after(session_id, None))


async def test_a_retrieve_is_logged_as_a_reference_and_a_resume_rebuilds_it(server: LiveServer) -> None:
    async with opened(server) as first:
        item_id = await user_text(first, TEXT)
        before = first.last_event_id
        for _ in range(3):
            await first.send({"type": "conversation.item.retrieve", "item_id": item_id})
        live = [await first.events.wait_for("conversation.item.retrieved", within_s=10) for _ in range(3)]
        assert all(r.raw["item"]["content"][0]["text"] == TEXT for r in live)
        # Redis has a reference per retrieve, not the item: the log's bytes do not grow with it.
        log = await redis_log(server, first.session_id)
        refs = [e for e in log if e["type"] == "conversation.item.retrieved"]
        assert refs == [
            {"type": "conversation.item.retrieved", "event_id": r.raw["event_id"], "item_ref": item_id}
            for r in live
        ]
        assert all(len(e.wire) < 200 for e in refs)  # type: ignore[attr-defined]
        first.abort()
    session_id, token = first.session_id, first.resume_token
    await asyncio.sleep(0.2)

    # A resume from before the retrieves gets each one back, as it was sent.
    async with resumed(server, session_id, token, before) as second:
        replayed = [
            await second.events.wait_for("conversation.item.retrieved", within_s=10) for _ in range(3)
        ]
        assert [r.raw for r in replayed] == [r.raw for r in live]
        # The item deleted, a resume from before the retrieves gets what a retrieve gets now.
        await second.send({"type": "conversation.item.delete", "item_id": item_id})
        await second.events.wait_for("conversation.item.deleted", within_s=10)
        second.abort()
    await asyncio.sleep(0.2)
    async with resumed(server, session_id, token, before) as third:
        events = logged(await third.events.collect_until("conversation.item.deleted", within_s=10))
        errors = [e for e in events if e["type"] == "error"]
        assert [e["event_id"] for e in errors] == [r.raw["event_id"] for r in live]
        assert {e["error"]["code"] for e in errors} == {"item_not_found"}
        assert not any(e["type"] == "conversation.item.retrieved" for e in events)
        assert events[-1] == {
            "type": "conversation.item.deleted",
            "event_id": events[-1]["event_id"],
            "item_id": item_id,
        }
