"""A text turn with the official openai SDK against a real server (smoke)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import sdk_session

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv"))) as live:
        yield live


async def test_text_turn_over_sdk(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "good morning"}],
            }
        )
        await conn.response.create()
        turn = await events.collect_until("response.done", within_s=30)
    assert turn[-1].event.response.status == "completed"
    text = "".join(r.event.delta for r in turn if r.type == "response.output_text.delta")
    assert text.strip() == "You said: good morning"
