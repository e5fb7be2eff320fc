"""A starlette WebSocket as the :class:`~session.frame_link.FrameTransport` of a world or robot
session: sends that find the peer gone raise :class:`~session.frame_link.TransportClosed`, and
the client's close code is kept for the session host (``disconnect_code``; 1006: no close frame)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from session.frame_link import TransportClosed

__all__ = ["WebSocketFrameTransport"]

# What a send or close raises when the peer is gone or the socket was closed by us.
_GONE = (WebSocketDisconnect, RuntimeError, OSError)


class WebSocketFrameTransport:
    """One WebSocket connection of a world or robot session."""

    kind = "websocket"

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self.disconnect_code: int | None = None  # how the client left (1006: no close frame)

    async def send_text(self, text: str) -> None:
        try:
            await self._ws.send_text(text)
        except _GONE as exc:
            raise TransportClosed(str(exc)) from exc

    async def send_bytes(self, data: bytes) -> None:
        try:
            await self._ws.send_bytes(data)
        except _GONE as exc:
            raise TransportClosed(str(exc)) from exc

    async def close(self, code: int, reason: str) -> None:
        try:
            await self._ws.close(code, reason[:120])  # a close reason must fit in 123 bytes
        except _GONE as exc:
            raise TransportClosed(str(exc)) from exc


async def serve_until_closed(
    receive: Coroutine[Any, Any, None], closed: Coroutine[Any, Any, Any], name: str
) -> None:
    """Run ``receive`` (the client's frames into the driver) until it ends or ``closed`` (the
    session's end) does; then stop both. ``name``: the tasks' names, ``{name}-rx`` and
    ``{name}-closed``."""
    receiver = asyncio.create_task(receive, name=f"{name}-rx")
    ended = asyncio.create_task(closed, name=f"{name}-closed")
    try:
        await asyncio.wait({receiver, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (receiver, ended):
            task.cancel()
        await asyncio.gather(receiver, ended, return_exceptions=True)
