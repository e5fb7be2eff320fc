"""A full-duplex session that is parked and resumed re-opens its live request: the model
answers again after the resume, and the conversation from before is kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import chunks, pcm16_b64
from tests.sessions.client import Conn, opened, resumed

pytestmark = pytest.mark.system

RATE = 24_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline="duplex-tiny", vad=False) as live:
        yield live


async def talk_until_the_model_answers(conn: Conn, seed: int) -> dict:
    mic = (np.random.default_rng(seed).standard_normal(RATE * 6) * 0.1).astype(np.float32)

    async def stream() -> None:
        for piece in chunks(mic, 40):
            await conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(piece)})
            await asyncio.sleep(0.04)

    sender = asyncio.create_task(stream())
    try:
        done = await conn.events.wait_for("response.done", within_s=30)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    return dict(done.raw)


async def test_parked_then_resumed_session_reopens_its_live_request(server: LiveServer) -> None:
    orch, host = server.ctx.orchestrator, server.ctx.host
    async with opened(server) as first:
        before = await talk_until_the_model_answers(first, 1)
        last = first.last_event_id
        assert len(orch.live_requests) == 1
    for _ in range(200):  # a close with 1000 parks the session: its live request ends with it
        if first.session_id not in host.sessions and not orch.live_requests:
            break
        await asyncio.sleep(0.02)
    assert first.session_id not in host.sessions and orch.live_requests == []

    async with resumed(server, first.session_id, first.resume_token, last) as second:
        earlier = before["response"]["output"][0]["id"]  # the model's item from before the park
        await second.send({"type": "conversation.item.retrieve", "item_id": earlier})
        retrieved = await second.events.wait_for("conversation.item.retrieved", within_s=10)
        assert retrieved.raw["item"]["role"] == "assistant"
        after = await talk_until_the_model_answers(second, 2)
        assert len(orch.live_requests) == 1  # opened again for the restored session
        items = [r.raw for r in second.events.log if r.type == "conversation.item.added"]
    assert after["response"]["id"] != before["response"]["id"]
    assert after["response"]["status"] in ("completed", "incomplete")
    assert items and items[0]["item"]["role"] == "user"  # the new user audio, a new user item
