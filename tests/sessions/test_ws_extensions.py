"""The guarded WebSocket protocol's scope extensions (web/edge/uvicorn_guards.py), on a real uvicorn
server and a real `websockets` client.

``send_text_nowait`` writes a text message at once once the handshake is done, and refuses
(writes nothing) before it and while writing is paused (the transport's buffer over its
high-water mark), so the caller falls back to the ASGI send, which waits for room. (The pause
is the transport's own call, made here by hand: this host's loopback takes hundreds of MB from
a peer that reads nothing before any buffer fills.)

``set_receiver`` hands messages (text as `str`, binary as `bytes`) to a callback as they are
parsed, those already queued first, in order, while the disconnect still comes from
``receive()``."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn
from websockets.asyncio.client import connect

from web.edge.uvicorn_guards import SEND_NOWAIT, SET_RECEIVER, GuardedWebSocketProtocol

pytestmark = pytest.mark.system


async def serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app=app, ws=GuardedWebSocketProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(250):
        if server.started:
            break
        await asyncio.sleep(0.02)
    return server, serving, port


async def test_send_text_nowait_writes_at_once_and_refuses_while_writing_is_paused() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "websocket"
        await receive()  # websocket.connect
        nowait = scope["extensions"][SEND_NOWAIT]
        protocol = nowait.__self__
        seen["before_accept"] = nowait("too early")
        await send({"type": "websocket.accept"})
        seen["first"] = nowait("hello")
        protocol.pause_writing()  # what the transport calls at its high-water mark
        seen["while_paused"] = nowait("dropped")
        waiting = asyncio.create_task(send({"type": "websocket.send", "text": "after the pause"}))
        await asyncio.sleep(0.05)
        seen["asgi_send_waited"] = not waiting.done()
        protocol.resume_writing()
        await waiting
        seen["after_resume"] = nowait("bye")
        await send({"type": "websocket.close", "code": 1000})

    server, serving, port = await serve(app)
    try:
        async with connect(f"ws://127.0.0.1:{port}/") as ws:
            messages = [await asyncio.wait_for(ws.recv(), 10) for _ in range(3)]
        assert messages == ["hello", "after the pause", "bye"]
        assert seen == {
            "before_accept": False,
            "first": True,
            "while_paused": False,
            "asgi_send_waited": True,
            "after_resume": True,
        }
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def test_a_receiver_gets_queued_then_new_messages_in_order() -> None:
    got: list[str | bytes] = []
    seen: dict[str, Any] = {}
    three_queued = asyncio.Event()
    receiving = asyncio.Event()
    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await three_queued.wait()
        await asyncio.sleep(0.05)  # the client's first three messages wait in the queue
        scope["extensions"][SET_RECEIVER](got.append)
        seen["at_once"] = list(got)
        receiving.set()
        seen["end"] = await receive()  # the disconnect still comes from receive()
        scope["extensions"][SET_RECEIVER](None)
        done.set()

    server, serving, port = await serve(app)
    try:
        async with connect(f"ws://127.0.0.1:{port}/") as ws:
            for text in ("a", "b", "c"):
                await ws.send(text)
            three_queued.set()
            await asyncio.wait_for(receiving.wait(), 10)
            await ws.send("d")
            await ws.send(b"\x01\x02")
            await ws.send("e")
            await asyncio.sleep(0.05)
        await asyncio.wait_for(done.wait(), 10)
        assert seen["at_once"] == ["a", "b", "c"]
        assert got == ["a", "b", "c", "d", b"\x01\x02", "e"]
        assert seen["end"]["type"] == "websocket.disconnect" and seen["end"]["code"] == 1000
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def test_a_receiver_that_raises_closes_the_connection_1011() -> None:
    seen: dict[str, Any] = {}
    done = asyncio.Event()

    def receiver(data: str | bytes) -> None:
        raise RuntimeError("a bug in the app")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        scope["extensions"][SET_RECEIVER](receiver)
        seen["end"] = await receive()
        done.set()

    server, serving, port = await serve(app)
    try:
        async with connect(f"ws://127.0.0.1:{port}/") as ws:
            await ws.send("boom")
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1011
        await asyncio.wait_for(done.wait(), 10)
        assert seen["end"]["type"] == "websocket.disconnect" and seen["end"]["code"] == 1011
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)

