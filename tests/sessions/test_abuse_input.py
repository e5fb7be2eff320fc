"""Hostile input on a real server (real redis-server), issue 13 points 3, 6, 7, 11, 12:
each attack gets its clear error, the session keeps answering, and nothing it sent reaches
Redis or a later session. (Point 3's writer isolation: tests/sessions/test_abuse_writer.py.)"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import websockets

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import Conn, opened, resumed, turn, user_text
from tests.sessions.conftest import on_server_async, session_server

pytestmark = pytest.mark.system

CONVERSATION_BYTES = 1024 * 1024
INSTRUCTIONS_BYTES = 64 * 1024
INPUT_AUDIO_S = 2.0


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"),
        module_redis.url,
        max_sessions=8,
        max_conversation_bytes=CONVERSATION_BYTES,
        max_instructions_bytes=INSTRUCTIONS_BYTES,
        max_input_audio_s=INPUT_AUDIO_S,
        audio_ms=80,
        engine_options={"fail_on": "EXPLODE"},
    ) as live:
        yield live


async def expect_error(
    conn: Conn, code: str, *, event_id: str | None, param: str | None = None
) -> dict[str, Any]:
    """The next `error` carries `code` (and `param`, `event_id`); the session still answers."""
    error = (await conn.events.wait_for("error", within_s=10)).raw["error"]
    assert error["type"] == "invalid_request_error", error
    assert (error["code"], error["event_id"]) == (code, event_id), error
    if param is not None:
        assert error["param"] == param, error
    await still_answers(conn)
    return dict(error)


async def still_answers(conn: Conn) -> None:
    """A well-formed event that changes nothing is answered."""
    await conn.send({"type": "session.update", "session": {"type": "realtime"}, "event_id": "evt_ping"})
    await conn.events.wait_for("session.updated", within_s=10)


async def stored_items(server: LiveServer, session_id: str) -> list[dict[str, Any]]:
    host = server.ctx.host
    hs = host.sessions[session_id]
    await on_server_async(server, hs.writer.flush())
    return await on_server_async(server, host.store.list_items(session_id))


def item_event(text: str, **item: Any) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
            **item,
        },
    }


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


# --- point 3: strings that are not Unicode scalar values, refused at the edge -------------------


@pytest.mark.parametrize(
    "field, event",
    [
        ("item.id", item_event("hi", id="\ud800x")),
        ("item.content[0].text", item_event("bad \udfff text")),
        (
            "session.instructions",
            {"type": "session.update", "session": {"type": "realtime", "instructions": "\ud83d"}},
        ),
        (
            "item.name",
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call", "name": "f\ud800", "arguments": "{}"},
            },
        ),
        ("event_id_key", {"type": "input_audio_buffer.clear", "\ud800": 1}),
    ],
)
async def test_lone_surrogates_are_refused_at_the_edge(
    server: LiveServer, field: str, event: dict[str, Any]
) -> None:
    async with opened(server) as conn:
        event = {**event, "event_id": "evt_bad_unicode"}
        # ensure_ascii: the frame carries "\ud800" escapes, legal JSON, as an attacker sends it
        await conn.ws.send(json.dumps(event))
        error = await expect_error(conn, "invalid_value", event_id="evt_bad_unicode")
        assert "Unicode" in error["message"]
        good = await user_text(conn, "still here")
        items = await stored_items(server, conn.session_id)
        assert [i["id"] for i in items] == [good]  # the bad one never reached the session or Redis


# --- point 7: deep JSON, at parse time, on every endpoint ----------------------------------------


async def test_deep_json_frame_is_invalid_json_not_1011(server: LiveServer) -> None:
    async with opened(server) as conn:
        await conn.ws.send('{"type":"session.update","session":' + "[" * 1000 + "]" * 1000 + "}")
        await expect_error(conn, "invalid_json", event_id=None)


@pytest.mark.parametrize("where", ["tools", "tracing", "truncation"])
async def test_deep_values_never_reach_the_session_config(server: LiveServer, where: str) -> None:
    deep = nested(600)
    session: dict[str, Any] = {"type": "realtime"}
    if where == "tools":
        session["tools"] = [{"type": "function", "name": "f", "description": "", "parameters": deep}]
    else:
        session[where] = deep
    async with opened(server) as conn:
        await conn.send({"type": "session.update", "session": session, "event_id": "evt_deep"})
        await expect_error(conn, "invalid_json", event_id="evt_deep")
        reply = await turn(conn, "after the deep one", audio=False)
        assert reply[-1].raw["response"]["status"] == "completed"
        token, last = conn.resume_token, conn.last_event_id
        conn.abort()
    async with resumed(server, conn.session_id, token, last) as again:  # not broken after a resume
        reply = await turn(again, "resumed fine", audio=False)
        assert reply[-1].raw["response"]["status"] == "completed"


async def test_deep_json_on_the_video_socket_is_an_error_event(server: LiveServer) -> None:
    async with websockets.connect(f"{server.ws_url}/v1/realtime/video", open_timeout=20) as ws:
        await ws.send('{"type":"session.start","extra_params":' + "[" * 1000 + "]" * 1000 + "}")
        error = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert error["type"] == "error" and error["code"] == "invalid_json", error
        await ws.send(json.dumps({"type": "session.ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "session.pong"


async def test_client_secrets_body_depth_unicode_and_size(server: LiveServer) -> None:
    url = f"{server.http_url}/v1/realtime/client_secrets"
    async with httpx.AsyncClient(timeout=30) as http:
        deep = await http.post(url, content='{"session":' + "[" * 1000 + "]" * 1000 + "}")
        assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
        bad = await http.post(url, content='{"session": {"type": "realtime", "instructions": "\\ud800"}}')
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
        big = await http.post(url, content=b'{"session": {"instructions": "' + b"x" * (20 << 20) + b'"}}')
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        async def chunked() -> Any:
            yield b'{"session": {"instructions": "'
            for _ in range(40):
                yield b"x" * (512 << 10)
            yield b'"}}'

        streamed = await http.post(url, content=chunked())
        assert streamed.status_code == 413
        ok = await http.post(url, json={"session": {"type": "realtime"}})
        assert ok.status_code == 200 and ok.json()["value"].startswith("ek_")


def _rss_peak_while(action: Any) -> int:
    """Peak RSS growth of this process (the server runs in it) while `action()` runs."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return peak - base


def test_chunked_sdp_offer_is_refused_while_reading(server: LiveServer) -> None:
    """64 MB of chunked SDP: 413 after the limit, with no body-sized growth of the server."""
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"v" * (1 << 20))
    answer = bytearray()

    def attack() -> None:
        with socket.create_connection(("127.0.0.1", server.settings.port), timeout=20) as sock:
            sock.sendall(
                b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            try:
                for _ in range(64):
                    sock.sendall(chunk)
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the server may stop reading once it has answered
            while b"\r\n\r\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    break
                answer.extend(data)

    growth = _rss_peak_while(attack)
    assert answer.startswith(b"HTTP/1.1 413"), bytes(answer[:200])
    assert growth < 32 << 20, f"RSS grew by {growth >> 20} MB while refusing a 64 MB body"


# --- point 6: per-session budgets -----------------------------------------------------------------


async def test_conversation_text_budget(server: LiveServer) -> None:
    async with opened(server) as conn:
        text = "y" * (300 * 1024)
        ids = [await user_text(conn, text) for _ in range(3)]
        await conn.send({**item_event(text), "event_id": "evt_over"})
        error = await expect_error(conn, "conversation_too_large", event_id="evt_over", param="item")
        assert str(CONVERSATION_BYTES) in error["message"]
        assert len(await stored_items(server, conn.session_id)) == 3
        await conn.send({"type": "conversation.item.delete", "item_id": ids[0]})
        await conn.events.wait_for("conversation.item.deleted")
        await user_text(conn, text)  # room again once an item is gone


async def test_instructions_budget(server: LiveServer) -> None:
    async with opened(server) as conn:
        long = "z" * (INSTRUCTIONS_BYTES + 1)
        update = {"type": "session.update", "session": {"type": "realtime", "instructions": long}}
        await conn.send({**update, "event_id": "evt_long"})
        await expect_error(conn, "string_above_max_length", event_id="evt_long", param="session.instructions")
        await conn.send({"type": "response.create", "response": {"instructions": long}, "event_id": "evt_r"})
        await expect_error(conn, "string_above_max_length", event_id="evt_r", param="response.instructions")


async def test_uncommitted_input_audio_budget(server: LiveServer) -> None:
    async with opened(server) as conn:
        await conn.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        await conn.events.wait_for("session.updated")
        second = base64.b64encode(np.zeros(24000, dtype="<i2").tobytes()).decode()
        await conn.send({"type": "input_audio_buffer.append", "audio": second})
        await conn.send({"type": "input_audio_buffer.append", "audio": second})
        await conn.send({"type": "input_audio_buffer.append", "audio": second, "event_id": "evt_third"})
        error = await expect_error(conn, "input_audio_buffer_too_large", event_id="evt_third", param="audio")
        assert "commit or clear" in error["message"]
        await conn.send({"type": "input_audio_buffer.commit"})  # the 2 s it kept are intact
        committed = await conn.events.wait_for("input_audio_buffer.committed", "error")
        assert committed.type == "input_audio_buffer.committed", committed.raw
        item = await conn.events.wait_for("conversation.item.done")
        assert item.raw["item"]["id"] == committed.raw["item_id"]
        await conn.send({"type": "input_audio_buffer.append", "audio": second})  # room again
        await still_answers(conn)


# --- point 12: internal failures reach the client as a reference, not their text --------------------


async def test_internal_failure_text_stays_in_the_log(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="session.driver")
    async with opened(server) as conn:
        events = await turn(conn, "EXPLODE now", audio=False)
        done = events[-1].raw["response"]
        assert done["status"] == "failed"
        message = done["status_details"]["error"]["message"]
        assert "secret internal detail" not in message and "RuntimeError" not in message
        assert message.startswith("The server had an error") and "ref err_" in message
        ref = message.split("ref ")[1].rstrip(").")
        lines = [r.getMessage() for r in caplog.records if ref in r.getMessage()]
        assert lines and "secret internal detail" in lines[0]
        await still_answers(conn)
