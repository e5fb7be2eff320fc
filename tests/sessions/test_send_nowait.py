"""The guarded WebSocket protocol's ``send_text_nowait`` (web/uvicorn_guards.py), on a real
uvicorn server and a real `websockets` client: it writes a text message at once once the
handshake is done, and refuses (writes nothing) before it and while writing is paused (the
transport's buffer over its high-water mark), so the caller falls back to the ASGI send,
which waits for room. (The pause is the transport's own call, made here by hand: this host's
loopback takes hundreds of MB from a peer that reads nothing before any buffer fills.)"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from websockets.asyncio.client import connect

from web.uvicorn_guards import SEND_NOWAIT, GuardedWebSocketProtocol


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

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app=app, ws=GuardedWebSocketProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(250):
            if server.started:
                break
            await asyncio.sleep(0.02)
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
