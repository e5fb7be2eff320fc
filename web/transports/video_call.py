"""One WebRTC connection of a world session: the ``controls`` channel and the video track.

A :class:`VideoCall` is one answered :class:`~media.video_rtc.VideoPeer` seen as a connection
of a world session, as a WebSocket is one: its ``transport`` (JSON events on ``controls``),
its ``outlets`` (chunks onto its video track; aiortc encodes them) and :meth:`VideoCall.serve`
(control messages into the session's driver until the peer or the session ends). It never ends
the session itself: web/transports/video.py hands the end to the host, which detaches or ends it.

How a call ended (``disconnect_code``): the client closed the ``controls`` channel while the
peer connection was up, a deliberate goodbye like a WebSocket close 1000; anything else (ICE
consent lost, DTLS gone, ``pc.close()``, a closed tab) is a drop, like a WebSocket 1006.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from aiortc.mediastreams import MediaStreamError

from media.video import EncodedChunk
from media.video_rtc import FrameTrack, VideoPeer
from session.world.core import StartGeneration
from session.world.driver import OutletFactory, TransportClosed, VideoSessionDriver
from session.world.outlets import ChunkOutlet

log = logging.getLogger(__name__)

CLEAN_CLOSE = 1000
CALL_PREFIX = "vrtc_"


class PeerVideoTransport:
    """The ``controls`` data channel as the driver's transport (JSON text only)."""

    kind = "webrtc"

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

    async def restart(self) -> None:
        pass  # a track carries one stream; a resuming call brings its own track (and outlet)

    def close(self) -> None:
        pass


class VideoCall:
    """One answered peer as a connection of a world session (see the module docstring)."""

    INBOX = 1024  # control messages waiting for the driver; past that the call is flooding

    def __init__(self, call_id: str, peer: VideoPeer, track: FrameTrack) -> None:
        self.call_id = call_id
        self.peer = peer
        self.transport = PeerVideoTransport(peer)
        self._track = track
        # One factory object for the call's life: a resumed world compares it to the one
        # that built its outlet (session/world/outlets.py ConnectionOutlet).
        self.outlets: OutletFactory = self._outlet
        self._inbox: asyncio.Queue[str] = asyncio.Queue(self.INBOX)
        peer.on_message = self._on_message

    async def _outlet(self, start: StartGeneration) -> ChunkOutlet:
        return TrackOutlet(self._track)

    @property
    def disconnect_code(self) -> int | None:
        """CLEAN_CLOSE when the client closed the channel itself; None for a drop."""
        return CLEAN_CLOSE if self.peer.closed_by_peer else None

    def _on_message(self, text: str) -> None:
        try:
            self._inbox.put_nowait(text)
        except asyncio.QueueFull:
            log.warning("video call %s: control messages flooding, closing", self.call_id)
            self.peer.end("control message flood")

    async def connected(self, within_s: float) -> bool:
        """True once ICE/DTLS connected and ``controls`` opened; False on timeout or end."""
        if await self.peer.wait_ready(within_s):
            return True
        log.info("video call %s: never connected (%s)", self.call_id, self.peer.end_reason or "timeout")
        return False

    async def serve(self, driver: VideoSessionDriver) -> None:
        """Control messages into ``driver`` until the peer ends or the session does (a hosted
        one also when another connection replaced this one: that closes this peer)."""
        async with asyncio.TaskGroup() as group:
            feeder = group.create_task(self._feed(driver), name=f"video-call-feed-{self.call_id}")
            ended = group.create_task(self.peer.ended.wait(), name=f"video-call-ended-{self.call_id}")
            closed = group.create_task(driver.wait_closed(), name=f"video-call-closed-{self.call_id}")
            await asyncio.wait({feeder, ended, closed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (feeder, ended, closed):
                task.cancel()

    async def _feed(self, driver: VideoSessionDriver) -> None:
        while True:
            await driver.handle_text(await self._inbox.get())
