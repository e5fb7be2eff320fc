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
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import InternalError, InvalidAccessError, InvalidStateError, OperationError
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcdatachannel import RTCDataChannel
from aiortc.sdp import SessionDescription

from media.webrtc import MAX_OFFER_BYTES, IceServer, OfferError

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
    if not sdp.strip():
        raise OfferError("The body is empty: expected an SDP offer.")
    if len(sdp.encode()) > MAX_OFFER_BYTES:
        raise OfferError(f"The SDP offer is larger than {MAX_OFFER_BYTES} bytes.")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("Not an SDP offer: it must start with 'v=0'.")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # the parser raises whatever the bad line provokes
        raise OfferError(f"Malformed SDP: {type(exc).__name__}: {exc}") from None
    video = [m for m in parsed.media if m.kind == "video"]
    for media in parsed.media:
        if media.kind not in ("video", "application"):
            raise OfferError(
                f"Unsupported media section {media.kind!r}: offer one video section and a data channel."
            )
        if media.ice is None or not media.ice.usernameFragment or not media.ice.password:
            raise OfferError(f"The {media.kind} section has no ICE credentials (a=ice-ufrag / a=ice-pwd).")
        if not media.dtls or not media.dtls.fingerprints:
            raise OfferError(f"The {media.kind} section has no DTLS fingerprint (a=fingerprint).")
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


class VideoPeer:
    """One answered peer connection: the outbound video track and the ``controls`` channel."""

    def __init__(self, pc: RTCPeerConnection, track: FrameTrack) -> None:
        self.pc = pc
        self.track = track
        self.on_message: Callable[[str], None] | None = None
        self.channel: RTCDataChannel | None = None
        self.connected = asyncio.Event()
        self.ended = asyncio.Event()
        self.end_reason = ""
        self._channel_open = asyncio.Event()
        self._drained = asyncio.Event()
        self._closed = False
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    @classmethod
    async def answer(
        cls, offer_sdp: str, *, ice_servers: Sequence[IceServer], track: FrameTrack
    ) -> tuple[VideoPeer, str]:
        """Check ``offer_sdp`` and answer it; raises ``OfferError`` (and leaves nothing open)."""
        check_video_offer(offer_sdp)
        peer = cls(
            RTCPeerConnection(RTCConfiguration(iceServers=[s.to_aiortc() for s in ice_servers])), track
        )
        try:
            await peer.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            peer.pc.addTrack(track)  # after the remote description: binds to the offered section
            await peer.pc.setLocalDescription(await peer.pc.createAnswer())
        except (ValueError, InternalError, InvalidAccessError, InvalidStateError, OperationError) as exc:
            await peer.close("offer rejected")
            raise OfferError(f"Cannot answer the SDP offer: {exc}") from None
        except BaseException:
            await peer.close("offer failed")
            raise
        description = peer.pc.localDescription
        assert description is not None
        return peer, description.sdp

    # aiortc callbacks are synchronous (pyee would run coroutines as unowned tasks)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != CONTROLS_CHANNEL or self.channel is not None:
            log.info("closing unexpected data channel %r", channel.label)
            channel.close()
            return
        self.channel = channel
        channel.bufferedAmountLowThreshold = CHANNEL_HIGH_WATER // 4
        channel.on("message", self._on_message)
        channel.on("open", self._channel_open.set)
        channel.on("bufferedamountlow", self._drained.set)
        channel.on("close", lambda: self.end("controls channel closed"))
        if channel.readyState == "open":
            self._channel_open.set()

    def _on_message(self, message: str | bytes) -> None:
        text = message if isinstance(message, str) else message.decode("utf-8", errors="replace")
        if self.on_message is not None:
            self.on_message(text)

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.connected.set()
        elif state in ("failed", "closed"):
            self.end(f"connection {state}")

    def end(self, reason: str) -> None:
        """Mark the peer ended (wakes every waiter); ``close`` releases it."""
        if not self.ended.is_set():
            self.end_reason = reason
            self.ended.set()
            self._channel_open.set()
            self._drained.set()

    async def wait_ready(self, within_s: float) -> bool:
        """True once connected with the controls channel open; False on timeout or end."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self.connected.wait()
                await self._channel_open.wait()
        channel = self.channel
        return channel is not None and channel.readyState == "open" and not self.ended.is_set()

    async def send_text(self, text: str) -> bool:
        """One message on the controls channel, waiting while its buffer is over the high-water
        mark; False when the peer ended first."""
        await self._channel_open.wait()
        channel = self.channel
        while not self.ended.is_set() and channel is not None and channel.bufferedAmount > CHANNEL_HIGH_WATER:
            self._drained.clear()
            await self._drained.wait()
        if self.ended.is_set() or channel is None or channel.readyState != "open":
            return False
        try:
            channel.send(text)
        except InvalidStateError:
            return False
        return True

    async def close(self, reason: str = "closed") -> None:
        self.end(reason)
        if self._closed:
            return
        self._closed = True
        self.track.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()
