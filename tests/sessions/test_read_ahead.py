"""The WebSocket protocol's read-ahead (web/edge/uvicorn_guards.py): received messages queue for the
app up to READ_AHEAD_BYTES before reading pauses, and reading resumes once the app has taken
them down to half of that, binary messages counted as text ones are. (A text frame that is not
UTF-8 closing 1007 is checked end to end in test_abuse_connections.)"""

from __future__ import annotations

from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from web.edge.uvicorn_guards import READ_AHEAD_BYTES, GuardedWebSocketProtocol

pytestmark = pytest.mark.system


class FakeTransport:
    """Records flow control (no socket: the protocol is driven by hand)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.written: list[bytes] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.calls.append("close")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never called
    raise AssertionError("not reached")


def protocol() -> tuple[GuardedWebSocketProtocol, FakeTransport]:
    config = uvicorn.Config(app=_app, ws=GuardedWebSocketProtocol, lifespan="off")
    config.load()
    proto = GuardedWebSocketProtocol(config=config, server_state=ServerState(), app_state={})
    transport = FakeTransport()
    proto.transport = transport  # type: ignore[assignment]
    return proto, transport


def receive_text(proto: GuardedWebSocketProtocol, size: int) -> None:
    proto.curr_msg_data_type = "text"
    proto.frames = [b"x" * size]
    proto.send_receive_event_to_app()


async def test_reading_pauses_past_the_read_ahead_and_resumes_at_half() -> None:
    proto, transport = protocol()
    size = 4096
    count = READ_AHEAD_BYTES // size
    for _ in range(count - 1):
        receive_text(proto, size)
    assert transport.calls == []  # 60 KiB queued: still reading (uvicorn pauses after each one)
    receive_text(proto, size)
    assert transport.calls == ["pause"]
    taken = 0
    while transport.calls == ["pause"]:
        message = await proto.receive()
        assert message == {"type": "websocket.receive", "text": "x" * size}
        taken += 1
    assert transport.calls == ["pause", "resume"]
    assert (count - taken) * size < READ_AHEAD_BYTES // 2 <= (count - taken + 1) * size
    assert proto.queue.qsize() == count - taken


async def test_binary_messages_count_too() -> None:
    proto, transport = protocol()
    proto.curr_msg_data_type = "bytes"
    proto.frames = [b"\x00" * (READ_AHEAD_BYTES + 1)]  # one large frame: paused at once
    proto.send_receive_event_to_app()
    assert transport.calls == ["pause"]
    assert (await proto.receive())["bytes"] == b"\x00" * (READ_AHEAD_BYTES + 1)
    assert transport.calls == ["pause", "resume"]
