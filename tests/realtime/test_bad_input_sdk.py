"""Bad input over the official `openai` SDK: an `error` event (invalid_request_error, a code,
`param` where it applies, the client's `event_id`) and the socket stays open and served; an
oversized frame closes with 1009."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import WIRE_RATE, ServerEvents, decode_pcm16, pcm16_b64, ping, sdk_session, silence

pytestmark = pytest.mark.system

MAX_FRAME = 256 * 1024
LONG_TEXT = ", ".join(f"item number {k}" for k in range(40)) + "."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), max_message_bytes=MAX_FRAME) as live:
        yield live


async def expect_error(
    conn: Any, events: ServerEvents, code: str, *, event_id: str | None, param: str | None = None
) -> Any:
    """The next `error` event must carry `code`, `param` and the client's `event_id`; the
    session must then still answer."""
    error = (await events.wait_for("error", within_s=10)).event.error
    assert error.type == "invalid_request_error"
    assert error.code == code, error
    assert error.event_id == event_id, error
    assert error.param == param, error
    assert error.message
    await ping(conn, events)
    return error


async def push_to_talk(conn: Any, events: ServerEvents) -> None:
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await events.wait_for("session.updated")


async def add_user_text(conn: Any, events: ServerEvents, text: str) -> str:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    return str((await events.wait_for("conversation.item.done")).event.item.id)


async def test_invalid_json(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.send_raw('{"type": "input_audio_buffer.clear", "event_id": ')
        # Nothing could be read from the frame, so there is no event_id to echo.
        await expect_error(conn, events, "invalid_json", event_id=None)


async def test_unknown_event_type(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.send_raw(json.dumps({"type": "response.audio.delta", "event_id": "evt_unknown"}))
        error = await expect_error(conn, events, "invalid_event", event_id="evt_unknown", param="type")
        assert "response.audio.delta" in error.message


async def test_bad_field_value(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            event_id="evt_threshold",
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}},
            },
        )
        await expect_error(
            conn,
            events,
            "invalid_value",
            event_id="evt_threshold",
            param="session.audio.input.turn_detection.threshold",
        )
        # The rejected update changed nothing.
        await conn.session.update(session={"type": "realtime"})
        session = (await events.wait_for("session.updated")).event.session
        assert session.audio.input.turn_detection.threshold == 0.5


@pytest.mark.parametrize(
    ("audio", "what"),
    [
        ("not base64 at all!", "invalid base64"),
        (base64.b64encode(b"\x00\x01\x02").decode(), "odd byte count"),
    ],
)
async def test_bad_audio_append(server: LiveServer, audio: str, what: str) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.input_audio_buffer.append(audio=audio, event_id="evt_audio")
        await expect_error(conn, events, "invalid_value", event_id="evt_audio", param="audio")


async def test_commit_under_100_ms(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await push_to_talk(conn, events)
        await conn.input_audio_buffer.append(audio=pcm16_b64(silence(0.05)))
        await conn.input_audio_buffer.commit(event_id="evt_commit")
        await expect_error(conn, events, "input_audio_buffer_commit_empty", event_id="evt_commit")
        # 100 ms is enough.
        await conn.input_audio_buffer.append(audio=pcm16_b64(silence(0.1)))
        await conn.input_audio_buffer.commit()
        await events.wait_for("input_audio_buffer.committed", within_s=10)


async def test_response_create_while_active_then_cancel(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await push_to_talk(conn, events)
        await add_user_text(conn, events, LONG_TEXT)
        await conn.response.create()
        created = (await events.wait_for("response.created")).event.response
        await conn.response.create(event_id="evt_second")
        error = await expect_error(
            conn, events, "conversation_already_has_active_response", event_id="evt_second"
        )
        assert created.id in error.message
        await conn.response.cancel(event_id="evt_cancel")
        done = (await events.wait_for("response.done", within_s=30)).event.response
        assert done.id == created.id and done.status == "cancelled"
        assert done.status_details.reason == "client_cancelled"
        # Nothing active any more.
        await conn.response.cancel(event_id="evt_cancel_again")
        await expect_error(conn, events, "response_cancel_not_active", event_id="evt_cancel_again")


async def test_response_cancel_with_none_active(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.response.cancel(event_id="evt_cancel")
        await expect_error(conn, events, "response_cancel_not_active", event_id="evt_cancel")
        await conn.response.cancel(event_id="evt_cancel_id", response_id="resp_nope")
        await expect_error(
            conn, events, "response_cancel_not_active", event_id="evt_cancel_id", param="response_id"
        )


async def test_truncate_beyond_audio_length(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await push_to_talk(conn, events)
        await add_user_text(conn, events, "hello")
        await conn.response.create()
        done = (await events.wait_for("response.done", within_s=30)).event.response
        assert done.status == "completed"
        item = done.output[0]
        audio = decode_pcm16(r.event.delta for r in events.log if r.type == "response.output_audio.delta")
        length_ms = audio.size * 1000 // WIRE_RATE
        assert length_ms > 0 and np.abs(audio).max() > 0
        await conn.conversation.item.truncate(
            item_id=item.id, content_index=0, audio_end_ms=length_ms + 500, event_id="evt_truncate"
        )
        await expect_error(conn, events, "invalid_value", event_id="evt_truncate", param="audio_end_ms")
        # At the length itself it is fine (and a no-op for the audio).
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=length_ms)
        truncated = (await events.wait_for("conversation.item.truncated", within_s=10)).event
        assert truncated.audio_end_ms == length_ms


@pytest.mark.parametrize(
    "event",
    [
        {"type": "conversation.item.retrieve", "item_id": "item_nope"},
        {"type": "conversation.item.delete", "item_id": "item_nope"},
        {"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
    ],
    ids=lambda e: e["type"],
)
async def test_unknown_item_id(server: LiveServer, event: dict[str, Any]) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.send({**event, "event_id": "evt_item"})  # type: ignore[arg-type]
        error = await expect_error(conn, events, "item_not_found", event_id="evt_item", param="item_id")
        assert "item_nope" in error.message


async def test_unknown_previous_item_id(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.conversation.item.create(
            event_id="evt_prev",
            previous_item_id="item_nope",
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        )
        await expect_error(conn, events, "item_not_found", event_id="evt_prev", param="previous_item_id")


async def test_frame_over_the_size_limit_closes_1009(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await ping(conn, events)  # a frame just under the limit is fine
        await conn.input_audio_buffer.append(audio=pcm16_b64(silence(2.0)))  # 128 KiB of base64
        await ping(conn, events)
        await conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * MAX_FRAME}))
        assert await events.close_code(within_s=10) == 1009
