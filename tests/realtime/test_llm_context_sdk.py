"""A language-model responder over the SDK: a prompt longer than the model's context gets an
`error` event (`context_length_exceeded`) with `truncation: "disabled"`, and the same
conversation is answered with `truncation: "auto"` (the oldest items dropped to fit).

The responder is a tiny random Llama (512-token context) saved at test time, so its words are
noise; what is checked is the protocol around the context limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import sdk_session
from tests.tiny_lm import save_tiny_llama

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny_lm"))
    with live_server(Path(tmp_path_factory.mktemp("srv")), responder="llm", llm=str(model)) as live:
        yield live


def message(role: str, text: str) -> dict:
    kind = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


async def test_context_length_exceeded_then_truncation_auto(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            session={"type": "realtime", "output_modalities": ["text"], "truncation": "disabled"}
        )
        await events.wait_for("session.updated")
        for i in range(8):  # ~8 × 60 tokens of history: more than the 512-token context holds
            await conn.conversation.item.create(
                item=message("user", f"question {i}: " + "the lazy dog " * 15)
            )
            await conn.conversation.item.create(item=message("assistant", "the quick brown fox " * 10))
        await conn.conversation.item.create(item=message("user", "and now?"))
        await conn.response.create(response={"max_output_tokens": 8})
        turn = await events.collect_until("response.done", within_s=60)
        errors = [r.event for r in turn if r.type == "error"]
        assert len(errors) == 1
        assert errors[0].error.type == "invalid_request_error"
        assert errors[0].error.code == "context_length_exceeded"
        done = turn[-1].event.response
        assert done.status == "failed"
        assert done.status_details.error.code == "context_length_exceeded"

        await conn.session.update(session={"type": "realtime", "truncation": "auto"})
        await events.wait_for("session.updated")
        await conn.response.create(response={"max_output_tokens": 8})
        turn = await events.collect_until("response.done", within_s=60)
        assert not [r for r in turn if r.type == "error"]
        assert turn[-1].event.response.status == "completed"
        assert "".join(r.event.delta for r in turn if r.type == "response.output_text.delta")
