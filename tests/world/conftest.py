"""A real server on loopback for world-model tests: starlette + uvicorn + the real orchestrator,
with the world sessions hosted as in ``omniduplex serve`` (a :class:`WorldHost` on the session
layer of :func:`web.server.context.server_context`, on the shared test redis-server), but with the test's
own :class:`VideoConfig` and socket buffers."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect

from session.world.config import VideoConfig, VideoLimits
from session.world.driver import VideoSessionDriver
from session.world.hosting import WorldHost
from session.world.runtimes import OrchestratorPool
from tests.conftest_redis import redis_server, redis_url  # noqa: F401  (shared redis-server fixtures)
from tests.peer_faults import fast_consent  # noqa: F401  (a fixture: ICE consent lost in ~2 s)
from web.server.context import server_context
from web.settings import ServerSettings
from web.transports.video import VideoService


@dataclass
class WorldServer:
    url: str  # http://127.0.0.1:PORT
    service: VideoService
    pool: OrchestratorPool
    host: WorldHost

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/realtime/video"

    def drivers(self) -> list[VideoSessionDriver]:
        """The drivers of the live world sessions (detached ones included)."""
        return [hosted.driver for hosted in self.host.sessions.values()]


async def serve(
    config: VideoConfig, *, store_url: str, data_dir: Path, sndbuf: int | None = None
) -> AsyncIterator[WorldServer]:
    """A server on a free loopback port. ``sndbuf``: a small, fixed kernel send buffer for every
    accepted connection (Linux copies it from the listening socket), so a stalled client blocks
    the server's sends after kilobytes instead of the megabytes autotuning allows. A dropped
    connection ends its world at once (no disconnect grace): tests of resume are elsewhere."""
    settings = ServerSettings(
        port=0,
        data_dir=str(data_dir),
        redis_url=store_url,
        pipeline="null",
        vad=False,
        disconnect_grace_s=0.0,
    )
    pool = OrchestratorPool()
    service = VideoService(pool, config)
    app = Starlette(routes=service.routes())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="websockets-sansio", lifespan="off"))
    async with server_context(settings) as ctx:
        host = service.host = WorldHost(ctx.host)
        await host.start()
        task = asyncio.create_task(server.serve(sockets=[sock]), name="test-uvicorn")
        try:
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            yield WorldServer(f"http://127.0.0.1:{port}", service, pool, host)
        finally:
            await host.close()  # as the app at shutdown: every world ends, then the calls
            await service.close()
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            await pool.close()
            sock.close()


@pytest.fixture
async def world_server(redis_url: str, tmp_path: Path) -> AsyncIterator[WorldServer]:  # noqa: F811
    async for server in serve(VideoConfig(), store_url=redis_url, data_dir=tmp_path):
        yield server


@pytest.fixture
async def stall_server(redis_url: str, tmp_path: Path) -> AsyncIterator[WorldServer]:  # noqa: F811
    """Short stall timeout and small socket buffers: a non-reading client blocks sends quickly."""
    limits = replace(VideoLimits(), stall_timeout_s=1.5, close_grace_s=3.0)
    async for server in serve(
        VideoConfig(limits=limits), store_url=redis_url, data_dir=tmp_path, sndbuf=16384
    ):
        yield server


@dataclass
class Chunk:
    meta: dict[str, Any]
    data: bytes
    events_before: list[dict[str, Any]] = field(default_factory=list)  # non-chunk events since the last chunk


class VideoClient:
    """A protocol-checking client: every chunk_metadata must be followed at once by its binary frame."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []  # every JSON event, in order
        self._since_chunk: list[dict[str, Any]] = []

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def event(self, limit_s: float = 10.0) -> dict[str, Any]:
        """The next JSON event (a binary frame here is a protocol violation)."""
        message = await asyncio.wait_for(self.ws.recv(), limit_s)
        assert isinstance(message, str), (
            f"binary frame without chunk_metadata before it ({len(message)} bytes)"
        )
        event = json.loads(message)
        self.events.append(event)
        return event

    async def expect(self, kind: str, limit_s: float = 10.0) -> dict[str, Any]:
        """Skip to the next event of ``kind`` (chunks in between are read and checked)."""
        while True:
            event = await self.event(limit_s)
            if event["type"] == "video.chunk_metadata":
                await self._binary_for(event, limit_s)
                continue
            if event["type"] == kind:
                return event

    async def chunk(self, limit_s: float = 10.0) -> Chunk:
        """The next chunk: its metadata and binary frame; other events seen on the way are kept."""
        while True:
            event = await self.event(limit_s)
            if event["type"] == "video.chunk_metadata":
                data = await self._binary_for(event, limit_s)
                chunk = Chunk(event, data, self._since_chunk)
                self._since_chunk = []
                return chunk
            if event["type"] in ("session.done", "error"):
                raise AssertionError(f"stream ended while waiting for a chunk: {event}")
            self._since_chunk.append(event)

    async def _binary_for(self, meta: dict[str, Any], limit_s: float) -> bytes:
        data = await asyncio.wait_for(self.ws.recv(), limit_s)
        assert isinstance(data, bytes), f"chunk_metadata not followed by a binary frame but by {data!r}"
        assert len(data) == meta["byte_length"]
        return data


async def open_client(server: WorldServer, *, rcvbuf: int | None = None, **kwargs: Any) -> VideoClient:
    """``rcvbuf``: a small, fixed kernel receive buffer (no autotuning), so a client that stops
    reading fills the path to the server after a few hundred kilobytes, not tens of megabytes."""
    if rcvbuf is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        host, port = server.url.removeprefix("http://").split(":")
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        kwargs["sock"] = sock
    ws = await connect(server.ws_url, max_size=2**24, **kwargs)
    return VideoClient(ws)
