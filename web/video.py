"""Routes of world-model video sessions: the ``/v1/realtime/video`` WebSocket and the ``/world`` demo.

I/O only: bytes in and out of the socket. The protocol lives in :mod:`session.video.core`,
generation pacing and runtime calls in :mod:`session.video.driver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from session.video.config import VideoConfig
from session.video.core import VideoSessionCore
from session.video.driver import RuntimeProvider, TransportClosed, VideoSessionDriver

log = logging.getLogger(__name__)

STATIC_WORLD = Path(__file__).with_name("static") / "world"


class WebSocketVideoTransport:
    """A starlette WebSocket as the driver's :class:`~session.video.driver.VideoTransport`."""

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket

    async def send_text(self, text: str) -> None:
        try:
            await self._ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:  # peer gone, or closed by us
            raise TransportClosed(str(exc)) from exc

    async def send_bytes(self, data: bytes) -> None:
        try:
            await self._ws.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise TransportClosed(str(exc)) from exc

    async def close(self, code: int, reason: str) -> None:
        try:
            await self._ws.close(code, reason[:120])  # a close reason must fit in 123 bytes
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise TransportClosed(str(exc)) from exc


class VideoService:
    """Live world-model video sessions of this process, and their routes."""

    def __init__(self, runtimes: RuntimeProvider, config: VideoConfig | None = None) -> None:
        self.runtimes = runtimes
        self.config = config or VideoConfig()
        self.sessions: dict[str, VideoSessionDriver] = {}

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/realtime/video", self.websocket, name="realtime_video"),
            Route("/world", _world_redirect, name="world_demo"),
            Mount("/world", StaticFiles(directory=STATIC_WORLD, html=True), name="world_static"),
        ]

    async def websocket(self, websocket: WebSocket) -> None:
        await websocket.accept()
        driver = VideoSessionDriver(
            VideoSessionCore(self.config), WebSocketVideoTransport(websocket), self.runtimes
        )
        session_id = driver.core.session_id
        self.sessions[session_id] = driver
        try:
            async with asyncio.TaskGroup() as group:
                receiver = group.create_task(_receive(websocket, driver), name=f"video-receive-{session_id}")
                await driver.wait_closed()
                receiver.cancel()
        finally:
            self.sessions.pop(session_id, None)
            await driver.close()

    async def close(self) -> None:
        """Server shutdown: end every live session."""
        await asyncio.gather(
            *(driver.close() for driver in list(self.sessions.values())), return_exceptions=True
        )


async def _receive(websocket: WebSocket, driver: VideoSessionDriver) -> None:
    """Client frames into the driver until the client goes away; then close the driver."""
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is not None:
                await driver.handle_text(text)
            elif message.get("bytes") is not None:
                await driver.handle_binary(message["bytes"])
    except WebSocketDisconnect:
        pass
    except RuntimeError as exc:  # receive after the socket closed (we closed it after a stall)
        log.debug("video session %s: receive ended: %s", driver.core.session_id, exc)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(driver.close())


async def _world_redirect(request: Request) -> Response:
    return RedirectResponse(url=str(request.url.replace(path="/world/")))


def video_routes(runtimes: RuntimeProvider, config: VideoConfig | None = None) -> list[BaseRoute]:
    """The routes for a starlette app; ``runtimes`` is e.g. a
    :class:`~session.video.runtimes.OrchestratorPool`."""
    return VideoService(runtimes, config).routes()
