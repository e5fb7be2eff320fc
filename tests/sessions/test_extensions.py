"""`omni.*` events reach only clients that ask for them (web/transports/omni_extensions.py).

A strict client (the Agents SDK validates every event against the OpenAI union) must see only
standard events; it gets its resume data as headers on the 101 instead. A client that asks
(`?omni_extensions=1` or `X-Omni-Extensions: 1`) gets `omni.session.resumable`; a resume asks
by itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import websockets

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.realtime.wire import ServerEvents
from tests.sessions.client import realtime_url, reply_text, resumed, user_text
from tests.sessions.conftest import session_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(tmp_path_factory.mktemp("srv"), module_redis.url, disconnect_grace_s=5) as live:
        yield live


async def test_stock_client_sees_only_standard_events_and_resumes_from_the_101(server: LiveServer) -> None:
    async with (
        websockets.connect(realtime_url(server), open_timeout=20) as ws,
        ServerEvents(ws.recv) as events,  # strict SDK validation of every standard event
    ):
        assert ws.response is not None
        session_id = ws.response.headers["X-Omni-Session-Id"]
        token = ws.response.headers["X-Omni-Resume-Token"]
        created = await events.wait_for("session.created", within_s=20)
        assert created.raw["session"]["id"] == session_id
        assert created.raw["session"]["expires_at"] > 0  # the rest of the resume data
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        await events.wait_for("input_audio_buffer.cleared", within_s=10)
        assert [t for t in events.types() if t.startswith("omni.")] == [], events.types()
        assert token.startswith("rt_")
        last = str(events.log[-1].raw["event_id"])
        ws.transport.abort()  # dropped: detached, resumable

    async with resumed(server, session_id, token, last) as again:  # a resume asks by itself
        assert again.events.log[0].raw["replay_count"] == 0
        await user_text(again, "still here")
        start = len(again.events.log)
        await again.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        await again.events.wait_for("response.done", within_s=30)
        assert reply_text(again.events.log[start:]).startswith("still here")


@pytest.mark.parametrize("how", ["query", "header"])
async def test_a_client_that_asks_gets_omni_session_resumable(server: LiveServer, how: str) -> None:
    url = realtime_url(server, omni_extensions="1") if how == "query" else realtime_url(server)
    headers = {"X-Omni-Extensions": "1"} if how == "header" else {}
    async with (
        websockets.connect(url, additional_headers=headers, open_timeout=20) as ws,
        ServerEvents(ws.recv) as events,
    ):
        created = await events.wait_for("session.created", within_s=20)
        resumable = (await events.next(10)).raw
        assert resumable["type"] == "omni.session.resumable", resumable
        assert resumable["session_id"] == created.raw["session"]["id"]
        assert ws.response is not None
        assert resumable["resume_token"] == ws.response.headers["X-Omni-Resume-Token"]
