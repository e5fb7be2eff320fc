"""Where a session's chunks go: encoded bytes after their metadata, or raw frames onto a track.

A WebSocket session sends each chunk as ``video.chunk_metadata`` plus one binary frame (JPEG or
fMP4, encoded here in a worker thread). A WebRTC session sends the same metadata as a status
message on its data channel and hands the raw frames to a paced video track, which encodes
them itself. The driver does not care which: it asks the outlet to ``prepare`` a chunk, sends
the metadata (and, for ``kind == "media"``, the bytes), then lets the outlet ``play`` it.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np

from media.video import ChunkEncoder, EncodedChunk, make_encoder
from session.video.core import StartGeneration


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
