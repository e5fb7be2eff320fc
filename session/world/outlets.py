"""Where a session's chunks go: encoded bytes after their metadata, or raw frames onto a track.

A WebSocket session sends each chunk as ``video.chunk_metadata`` plus one binary frame (JPEG or
fMP4, encoded here in a worker thread). A WebRTC session sends the same metadata as a status
message on its data channel and hands the raw frames to a paced video track, which encodes
them itself. The driver does not care which: it asks the outlet to ``prepare`` a chunk, sends
the metadata (and, for ``kind == "media"``, the bytes), then lets the outlet ``play`` it.

A hosted world outlives its connections, and they need not be of one kind (a world started on
a WebRTC call may be resumed over a WebSocket, and the other way round), so the driver wraps
each generation's outlet in a :class:`ConnectionOutlet` that follows the attached connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from media.video import ChunkEncoder, EncodedChunk, make_encoder
from session.world.core import StartGeneration


class ChunkOutlet(Protocol):
    @property
    def kind(self) -> str:
        """``media``: the encoded bytes follow the metadata; ``rtp``: frames go to a track."""

    @property
    def mime_type(self) -> str: ...

    @property
    def queue_depth(self) -> int | None: ...

    async def prepare(self, frames: np.ndarray) -> EncodedChunk: ...

    async def play(self, frames: np.ndarray, fps: float) -> None: ...

    async def restart(self) -> None:
        """A new connection takes over the stream (a resumed session): the next chunk must
        decode on its own (m4s: carry a new init segment)."""

    def close(self) -> None: ...


OutletFactory = Callable[[StartGeneration], Awaitable[ChunkOutlet]]  # a connection's outlet


class ConnectionOutlet:
    """A generation's outlet that follows the session's connection: on :meth:`restart` (a
    new connection took over) it asks ``current()`` for that connection's outlet factory. The
    factory that built the outlet in use restarts it (a fresh m4s encoder for a WebSocket);
    another one (a new call's track, or a WebSocket after a call) replaces it. Factories are
    compared by identity: a connection hands out one factory object for its whole life."""

    def __init__(
        self, start: StartGeneration, current: Callable[[], OutletFactory], factory: OutletFactory
    ) -> None:
        self._start = start
        self._current = current
        self._factory = factory
        self._inner: ChunkOutlet | None = None

    @classmethod
    async def open(cls, start: StartGeneration, current: Callable[[], OutletFactory]) -> ConnectionOutlet:
        factory = current()
        outlet = cls(start, current, factory)
        outlet._inner = await factory(start)
        return outlet

    @property
    def inner(self) -> ChunkOutlet:
        assert self._inner is not None, "use ConnectionOutlet.open()"
        return self._inner

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def mime_type(self) -> str:
        return self.inner.mime_type

    @property
    def queue_depth(self) -> int | None:
        return self.inner.queue_depth

    async def prepare(self, frames: np.ndarray) -> EncodedChunk:
        return await self.inner.prepare(frames)

    async def play(self, frames: np.ndarray, fps: float) -> None:
        await self.inner.play(frames, fps)

    async def restart(self) -> None:
        factory = self._current()
        if factory is self._factory:
            await self.inner.restart()
            return
        fresh = await factory(self._start)
        self.inner.close()
        self._inner, self._factory = fresh, factory

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


class EncodedOutlet:
    """JPEG or fMP4 bytes for a WebSocket (encoding off the event loop)."""

    kind = "media"

    def __init__(self, encoder: ChunkEncoder, start: StartGeneration | None = None) -> None:
        self.encoder = encoder
        self._start = start

    @property
    def mime_type(self) -> str:
        return self.encoder.mime_type

    @property
    def queue_depth(self) -> int | None:
        return None

    async def prepare(self, frames: np.ndarray) -> EncodedChunk:
        return await asyncio.to_thread(self.encoder.encode, frames)

    async def play(self, frames: np.ndarray, fps: float) -> None:
        return None  # the bytes went out with the metadata

    async def restart(self) -> None:
        """JPEG chunks stand alone; an fMP4 stream starts over with a fresh encoder, so the
        resumed client's first chunk carries the init segment its new player needs."""
        start = self._start
        if start is None or start.format == "jpeg":
            return
        fresh = await asyncio.to_thread(
            make_encoder, start.format, start.width, start.height, start.fps, jpeg_quality=start.jpeg_quality
        )
        self.encoder.close()
        self.encoder = fresh

    def close(self) -> None:
        self.encoder.close()


async def encoded_outlet(start: StartGeneration) -> ChunkOutlet:
    """The WebSocket outlet for a generation (builds its encoder in a worker thread)."""
    encoder = await asyncio.to_thread(
        make_encoder, start.format, start.width, start.height, start.fps, jpeg_quality=start.jpeg_quality
    )
    return EncodedOutlet(encoder, start)
