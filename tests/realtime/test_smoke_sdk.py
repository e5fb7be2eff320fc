"""A text turn with the official openai SDK against a real server (smoke)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.live_server import LiveServer, live_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv"))) as live:
        yield live


async def test_text_turn_over_sdk(server: LiveServer) -> None:
    client = AsyncOpenAI(api_key="unused", base_url=server.base_url)
    async with client.realtime.connect(model="voice-cascade") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "good morning"}],
            }
        )
        await conn.response.create()
        text = []
        async for event in conn:
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type == "response.done":
                assert event.response.status == "completed"
                break
    assert "".join(text).strip() == "You said: good morning"
