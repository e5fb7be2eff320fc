"""Routes of world-model video sessions: ``/v1/realtime/video`` over a WebSocket and over WebRTC,
and the ``/world`` demo.

I/O only. Both transports run the same :class:`~session.video.core.VideoSessionCore` and
:class:`~session.video.driver.VideoSessionDriver`:

* WebSocket ``/v1/realtime/video``: JSON control in and out, each chunk as
  ``video.chunk_metadata`` + one binary frame (JPEG or fMP4).
* WebRTC ``POST /v1/realtime/video/calls`` (body: an SDP offer with one receive-only video
  section and a ``controls`` data channel; ``201`` with the SDP answer and ``Location``):
  the same JSON events on ``controls`` (``video.chunk_metadata`` with ``kind: "rtp"`` is the
  chunk status: index, frames, fps, queue depth) and the frames on the video track, which
  aiortc encodes (VP8/H.264). ``DELETE /v1/realtime/video/calls/{call_id}`` hangs up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aiortc.mediastreams import MediaStreamError
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from media.video import EncodedChunk
from media.video_rtc import FrameTrack, VideoPeer
from media.webrtc import IceServer, OfferError
from session.video.config import VideoConfig
from session.video.core import StartGeneration, VideoSessionCore
from session.video.driver import RuntimeProvider, TransportClosed, VideoSessionDriver
from session.video.outlets import ChunkOutlet

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


# ----------------------------------------------------------------------------------- WebRTC


class PeerVideoTransport:
    """The ``controls`` data channel as the driver's transport (JSON text only)."""

    def __init__(self, peer: VideoPeer) -> None:
        self._peer = peer

    async def send_text(self, text: str) -> None:
        if not await self._peer.send_text(text):
            raise TransportClosed(self._peer.end_reason or "controls channel closed")

    async def send_bytes(self, data: bytes) -> None:
        raise TransportClosed("a WebRTC call carries media on its track, not as binary messages")

    async def close(self, code: int, reason: str) -> None:
        await self._peer.close(f"{code} {reason}")


class TrackOutlet:
    """Chunks onto the call's video track; aiortc encodes them."""

    kind = "rtp"
    mime_type = "video/rtp"

    def __init__(self, track: FrameTrack) -> None:
        self.track = track

    @property
    def queue_depth(self) -> int | None:
        return self.track.queue_depth

    async def prepare(self, frames: np.ndarray) -> EncodedChunk:
        return EncodedChunk(b"", len(frames))

    async def play(self, frames: np.ndarray, fps: float) -> None:
        try:
            await self.track.push(frames, fps)
        except MediaStreamError as exc:
            raise TransportClosed(f"video track ended: {exc}") from exc

    def close(self) -> None:
        pass


class VideoCall:
    """One WebRTC world session: a :class:`VideoPeer` bound to a driver, served by ``run()``."""

    INBOX = 1024  # control messages waiting for the driver; past that the call is flooding

    def __init__(self, call_id: str, peer: VideoPeer, driver: VideoSessionDriver) -> None:
        self.call_id = call_id
        self.peer = peer
        self.driver = driver
        self._inbox: asyncio.Queue[str] = asyncio.Queue(self.INBOX)
        peer.on_message = self._on_message

    def _on_message(self, text: str) -> None:
        try:
            self._inbox.put_nowait(text)
        except asyncio.QueueFull:
            log.warning("video call %s: control messages flooding, closing", self.call_id)
            self.peer.end("control message flood")

    async def run(self, connect_timeout_s: float) -> None:
        try:
            if not await self.peer.wait_ready(connect_timeout_s):
                log.info(
                    "video call %s: never connected (%s)", self.call_id, self.peer.end_reason or "timeout"
                )
                return
            async with asyncio.TaskGroup() as group:
                feeder = group.create_task(self._feed(), name=f"video-call-feed-{self.call_id}")
                ended = group.create_task(self.peer.ended.wait(), name=f"video-call-ended-{self.call_id}")
                closed = group.create_task(
                    self.driver.wait_closed(), name=f"video-call-closed-{self.call_id}"
                )
                await asyncio.wait({feeder, ended, closed}, return_when=asyncio.FIRST_COMPLETED)
                for task in (feeder, ended, closed):
                    task.cancel()
        finally:
            await self.driver.close()
            await self.peer.close("call ended")

    async def _feed(self) -> None:
        while True:
            await self.driver.handle_text(await self._inbox.get())


# ---------------------------------------------------------------------------------- service


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a connection is refused before any session starts (HTTP status, error code, text)."""

    status: int
    code: str
    message: str

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"code": self.code, "message": self.message}}, status_code=self.status)


# Identity and admission live in the session layer; the app passes them in as a gate
# (e.g. API key → 401, tenant over quota → 429). None lets the connection in.
Gate = Callable[[HTTPConnection], Awaitable[Denial | None]]


class VideoService:
    """Live world-model video sessions of this process (WebSocket and WebRTC), and their routes."""

    def __init__(
        self,
        runtimes: RuntimeProvider,
        config: VideoConfig | None = None,
        *,
        ice_servers: Sequence[IceServer] = (),
        connect_timeout_s: float = 15.0,
        gate: Gate | None = None,
        max_sessions: int = 64,
    ) -> None:
        self.runtimes = runtimes
        self.gate = gate
        self.max_sessions = max_sessions
        self.config = config or VideoConfig()
        self.ice_servers = list(ice_servers)
        self.connect_timeout_s = connect_timeout_s
        self.sessions: dict[str, VideoSessionDriver] = {}
        self.calls: dict[str, VideoCall] = {}
        self._call_tasks: set[asyncio.Task[None]] = set()

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/realtime/video", self.websocket, name="realtime_video"),
            Route(
                "/v1/realtime/video/calls", self.create_call, methods=["POST"], name="realtime_video_calls"
            ),
            Route(
                "/v1/realtime/video/calls/{call_id}",
                self.hangup,
                methods=["DELETE"],
                name="realtime_video_call",
            ),
            Route("/world", _world_redirect, name="world_demo"),
            Mount("/world", StaticFiles(directory=STATIC_WORLD, html=True), name="world_static"),
        ]

    async def _admit(self, connection: HTTPConnection) -> Denial | None:
        """World sessions take slots like voice sessions: the gate first, then this process's cap."""
        if self.gate is not None:
            denial = await self.gate(connection)
            if denial is not None:
                return denial
        if len(self.sessions) >= self.max_sessions:
            return Denial(503, "server_busy", f"All {self.max_sessions} video session slots are in use.")
        return None

    async def create_call(self, request: Request) -> Response:
        """Answer an SDP offer; the call then runs until the peer or the session ends."""
        denial = await self._admit(request)
        if denial is not None:
            return denial.response()
        offer = (await request.body()).decode("utf-8", errors="replace")
        track = FrameTrack()
        try:
            peer, answer = await VideoPeer.answer(offer, ice_servers=self.ice_servers, track=track)
        except OfferError as exc:
            return Denial(400, "invalid_offer", str(exc)).response()
        call_id = f"vrtc_{secrets.token_hex(10)}"

        async def outlets(start: StartGeneration) -> ChunkOutlet:
            return TrackOutlet(track)

        driver = VideoSessionDriver(
            VideoSessionCore(self.config), PeerVideoTransport(peer), self.runtimes, outlets=outlets
        )
        call = VideoCall(call_id, peer, driver)
        self.calls[call_id] = call
        self.sessions[driver.core.session_id] = driver
        task = asyncio.create_task(self._serve_call(call), name=f"video-call-{call_id}")
        self._call_tasks.add(task)
        task.add_done_callback(self._call_tasks.discard)
        headers = {"Location": f"/v1/realtime/video/calls/{call_id}"}
        return Response(answer, status_code=201, media_type="application/sdp", headers=headers)

    async def _serve_call(self, call: VideoCall) -> None:
        try:
            await call.run(self.connect_timeout_s)
        except Exception:
            log.exception("video call %s failed", call.call_id)
        finally:
            self.calls.pop(call.call_id, None)
            self.sessions.pop(call.driver.core.session_id, None)

    async def hangup(self, request: Request) -> Response:
        call = self.calls.get(request.path_params["call_id"])
        if call is None:
            return Denial(404, "not_found", "no such call").response()
        await call.peer.close("hung up")
        return Response(status_code=204)

    async def websocket(self, websocket: WebSocket) -> None:
        denial = await self._admit(websocket)
        if denial is not None:
            await websocket.send_denial_response(denial.response())
            return
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
        """Server shutdown: end every live session and call."""
        for call in list(self.calls.values()):
            await call.peer.close("server shutting down")
        await asyncio.gather(
            *(driver.close() for driver in list(self.sessions.values())), return_exceptions=True
        )
        tasks = list(self._call_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


def video_routes(
    runtimes: RuntimeProvider, config: VideoConfig | None = None, *, ice_servers: Sequence[IceServer] = ()
) -> list[BaseRoute]:
    """The routes for a starlette app; ``runtimes`` is e.g. a
    :class:`~session.video.runtimes.OrchestratorPool`. (Keep the :class:`VideoService` to
    close its sessions at shutdown.)"""
    return VideoService(runtimes, config, ice_servers=ice_servers).routes()
