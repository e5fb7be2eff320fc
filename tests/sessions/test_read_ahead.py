"""The WebSocket protocol's read-ahead (web/edge/uvicorn_guards.py): received messages queue for the
app up to READ_AHEAD_BYTES before reading pauses, and reading resumes once the app has taken
them down to half of that, binary messages counted as text ones are; one read of many deflated
frames is inflated a few frames at a time, not all before the first is handled. (A text frame that is not
UTF-8 closing 1007 is checked end to end in test_abuse_connections.)"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState
from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.protocol import State
from websockets.uri import parse_uri

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


def deflated(proto: GuardedWebSocketProtocol) -> ClientProtocol:
    """Open ``proto`` as if the handshake had agreed on permessage-deflate; the client end."""
    proto.conn.state = State.OPEN
    proto.conn.extensions = [PerMessageDeflate(False, False, 15, 15)]
    proto.conn.parser = proto.conn.parse()  # frames now, not the HTTP request
    next(proto.conn.parser)
    proto.handshake_complete = True
    client = ClientProtocol(parse_uri("ws://test/"), max_size=None)
    client.state = State.OPEN
    client.extensions = [PerMessageDeflate(False, False, 15, 15)]
    return client


async def test_one_read_of_deflated_frames_is_inflated_a_few_frames_at_a_time() -> None:
    """40 texts of 1.9 MB of one letter deflate to ~75 KB: one read. Parsed whole, all 40 were
    inflated (~76 MB) before the first reached the app (issue 33's lone fuzzer held ~12 MB so);
    now the app gets each while at most a few others are inflated, and every one intact."""
    proto, _ = protocol()
    client = deflated(proto)
    text = "h" * 1_900_000
    for _ in range(40):
        client.send_text(text.encode())
    wire = b"".join(client.data_to_send())
    assert len(wire) < 256 * 1024  # one read of the event loop's transport
    got: list[int] = []
    held: list[int] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]

        def receiver(message: str | bytes) -> None:
            held.append(tracemalloc.get_traced_memory()[0] - base)
            got.append(len(message) if message == text else -1)

        proto.set_receiver(receiver)
        proto.data_received(wire)
    finally:
        tracemalloc.stop()
    assert got == [1_900_000] * 40
    assert max(held) < 16 << 20, f"{max(held) >> 20} MB inflated and not yet handled"
