"""WebRTC for world-model video: a paced outbound video track and one answered peer.

:class:`FrameTrack` is the track aiortc's sender pulls from: frames are pushed a chunk at a
time (``push`` waits while more than about a chunk is queued: backpressure for generation)
and ``recv`` releases them one per ``1/fps`` on a monotonic clock; aiortc encodes them
(VP8 or H.264, in its own worker thread). :class:`VideoPeer` answers an SDP offer with one
video section (the client receives) and a ``controls`` data channel (JSON text both ways).
Nothing here knows about sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import av
import numpy as np
from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription

from media.webrtc import ChannelPeer, IceServer, OfferError, parse_offer, peer_connection

log = logging.getLogger(__name__)

CONTROLS_CHANNEL = "controls"
VIDEO_CODECS = ("vp8", "h264")  # what aiortc can encode
VIDEO_CLOCK = 90_000
CHANNEL_HIGH_WATER = 256 << 10


class FrameTrack(MediaStreamTrack):
    """Outbound video: chunks in (``push``), paced frames out (``recv``)."""

    kind = "video"

    def __init__(self, *, max_queued: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.max_queued = max_queued  # frames; about one chunk plus the one being sent
        self._queue: deque[tuple[np.ndarray, float]] = deque()
        self._clock = clock
        self._changed = asyncio.Event()
        self._sent = 0  # frames handed to the encoder
        self._pts = 0  # 90 kHz
        self._next_at: float | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def push(self, frames: np.ndarray, fps: float) -> None:
        """Queue a chunk's frames; waits while more than ``max_queued`` frames wait to be sent."""
        while len(self._queue) >= self.max_queued and self.readyState == "live":
            self._changed.clear()
            await self._changed.wait()
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        for frame in frames:
            self._queue.append((frame, fps))
        self._changed.set()

    async def recv(self) -> av.VideoFrame:
        while not self._queue:
            if self.readyState != "live":
                raise MediaStreamError("track ended")
            self._changed.clear()
            await self._changed.wait()
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        array, fps = self._queue[0]
        now = self._clock()
        if self._next_at is not None and self._next_at > now:
            await asyncio.sleep(self._next_at - now)
        self._queue.popleft()
        self._changed.set()
        start, period = self._clock(), 1.0 / fps
        if self._next_at is None or start - self._next_at > period:
            self._next_at = start + period  # late by more than a frame: the timeline moves
        else:
            self._next_at += period
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, VIDEO_CLOCK)
        self._pts += round(VIDEO_CLOCK / fps)
        self._sent += 1
        return frame

    def stop(self) -> None:
        super().stop()
        self._changed.set()


def check_video_offer(sdp: str) -> SessionDescription:
    """An offer with exactly one video section we can send and, optionally, a data channel."""
    parsed = parse_offer(sdp, "video", "offer one video section and a data channel.")
    video = [m for m in parsed.media if m.kind == "video"]
    if len(video) != 1:
        raise OfferError(f"The SDP offer must have exactly one video section, it has {len(video)}.")
    if video[0].direction not in ("recvonly", "sendrecv"):
        raise OfferError(
            f"The video section must let the client receive (recvonly), not {video[0].direction}."
        )
    names = {c.mimeType.split("/")[-1].lower() for c in video[0].rtp.codecs}
    if not names & set(VIDEO_CODECS):
        raise OfferError(
            f"No supported video codec in the offer ({', '.join(sorted(names)) or 'none'}); use VP8."
        )
    return parsed


class VideoPeer(ChannelPeer):
    """One answered peer connection: the outbound video track and the ``controls`` channel."""

    channel_label = CONTROLS_CHANNEL
    channel_name = "controls"
    channel_high_water = CHANNEL_HIGH_WATER
    channel_low_water = CHANNEL_HIGH_WATER // 4

    def __init__(self, pc: RTCPeerConnection, track: FrameTrack) -> None:
        super().__init__(pc)
        self.track = track

    @classmethod
    async def answer(
        cls, offer_sdp: str, *, ice_servers: Sequence[IceServer], track: FrameTrack
    ) -> tuple[VideoPeer, str]:
        """Check ``offer_sdp`` and answer it; raises ``OfferError`` (and leaves nothing open)."""
        check_video_offer(offer_sdp)
        peer = cls(peer_connection(ice_servers), track)
        # The track is added after the remote description: it binds to the offered section.
        return peer, await peer._answer(offer_sdp, lambda: peer.pc.addTrack(track))

    async def wait_ready(self, within_s: float) -> bool:
        """True once connected with the controls channel open; False on timeout or end."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self.connected.wait()
                await self._channel_open.wait()
        channel = self.channel
        return channel is not None and channel.readyState == "open" and not self.ended.is_set()

    async def _release(self) -> None:
        self.track.stop()
