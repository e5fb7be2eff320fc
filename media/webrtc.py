"""The aiortc side of a realtime call: ICE servers, offer checks, and one answered peer.

`PeerLink.answer(offer)` checks the offer, builds an `RTCPeerConnection` (ICE servers exactly
as configured: aiortc would otherwise add a public STUN server), binds the server's outbound
audio track to the offered audio section and returns the SDP answer. Afterwards the link
exposes the peer's inbound audio (`on_audio`), the `oai-events` data channel as text
messages in (`on_message`) and out (`send_text`, with backpressure), and its lifecycle
(`wait_ready`, `ended`, `close`). Nothing here knows about sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import unquote

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import InternalError, InvalidAccessError, InvalidStateError, OperationError
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtcdatachannel import RTCDataChannel
from aiortc.rtp import RtpPacket
from aiortc.sdp import SessionDescription
from aiortc.utils import uint16_add

from media.tracks import AudioCallback, InboundAudioPump, MediaStreamTrack, OutboundAudioTrack

log = logging.getLogger(__name__)

EVENTS_CHANNEL = "oai-events"
MAX_OFFER_BYTES = 64 * 1024
AUDIO_CODECS = ("opus", "pcmu", "pcma", "g722")  # what aiortc can decode
CHANNEL_HIGH_WATER = 1 << 20  # bytes queued on the data channel before `send_text` waits
CHANNEL_LOW_WATER = 256 << 10
DEFAULT_MAX_MESSAGE_SIZE = 65_536  # RFC 8841, when the offer has no a=max-message-size


# --- ICE servers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IceServer:
    url: str  # stun:host:port | turn:host:port?transport=udp | turns:host:port?transport=tcp
    username: str | None = None
    credential: str | None = None

    def to_aiortc(self) -> RTCIceServer:
        return RTCIceServer(urls=self.url, username=self.username, credential=self.credential)

    def to_browser(self) -> dict[str, Any]:
        """An entry of the browser's `RTCConfiguration.iceServers`."""
        entry: dict[str, Any] = {"urls": [self.url]}
        if self.username is not None:
            entry["username"] = self.username
            entry["credential"] = self.credential or ""
        return entry


def _split_userinfo(rest: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hostport = rest.rpartition("@")
    if not at:
        return None, None, rest
    user, _, password = userinfo.partition(":")
    return unquote(user), unquote(password), hostport


def parse_ice_servers(stun: Sequence[str] = (), turn: Sequence[str] = ()) -> list[IceServer]:
    """Configured STUN/TURN servers (`--stun`, `--turn`) → ICE servers; empty by default.

    STUN: `stun:host[:port]` or `host[:port]`. TURN: `turn[s]:[user:pass@]host[:port][?transport=udp|tcp]`
    or `[user:pass@]host[:port]`. Raises ValueError for an entry it cannot read.
    """
    servers: list[IceServer] = []
    for raw in stun:
        entry = raw.strip()
        hostport = entry.split(":", 1)[1] if entry.startswith("stun:") else entry
        if not hostport or "@" in hostport:
            raise ValueError(f"bad STUN server {raw!r} (want stun:host:port)")
        servers.append(IceServer(f"stun:{hostport}"))
    for raw in turn:
        entry = raw.strip()
        scheme = "turn"
        for prefix in ("turns:", "turn:"):
            if entry.startswith(prefix):
                scheme, entry = prefix[:-1], entry[len(prefix) :]
                break
        entry = entry.removeprefix("//")
        user, password, hostport = _split_userinfo(entry)
        if not hostport or hostport.startswith("?"):
            raise ValueError(f"bad TURN server {raw!r} (want turn:user:pass@host:port)")
        if "?transport=" not in hostport:
            hostport += "?transport=tcp" if scheme == "turns" else "?transport=udp"
        servers.append(IceServer(f"{scheme}:{hostport}", user, password))
    return servers


# --- offers --------------------------------------------------------------------------------


class OfferError(ValueError):
    """An SDP offer this server cannot answer; the message says why (sent back as a 400)."""


def parse_offer(sdp: str, media_kind: str, unsupported: str) -> SessionDescription:
    """The checks every offer gets: size, SDP syntax, and per section a kind this server takes
    (``media_kind`` or the data channel's ``application``; else ``unsupported`` says what to
    offer), ICE credentials and a DTLS fingerprint."""
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
    for media in parsed.media:
        if media.kind not in (media_kind, "application"):
            raise OfferError(f"Unsupported media section {media.kind!r}: {unsupported}")
        if media.ice is None or not media.ice.usernameFragment or not media.ice.password:
            raise OfferError(f"The {media.kind} section has no ICE credentials (a=ice-ufrag / a=ice-pwd).")
        if not media.dtls or not media.dtls.fingerprints:
            raise OfferError(f"The {media.kind} section has no DTLS fingerprint (a=fingerprint).")
    return parsed


def check_offer(sdp: str) -> SessionDescription:
    """Reject what aiortc would accept silently or fail on later (no audio, video, no DTLS)."""
    parsed = parse_offer(sdp, "audio", "offer one audio section (and the oai-events data channel) only.")
    if not parsed.media:
        raise OfferError("The SDP offer has no media sections (m= lines).")
    audio = [m for m in parsed.media if m.kind == "audio"]
    if len(audio) != 1:
        raise OfferError(f"The SDP offer must have exactly one audio section, it has {len(audio)}.")
    names = {c.mimeType.split("/")[-1].lower() for c in audio[0].rtp.codecs}
    if not names & set(AUDIO_CODECS):
        raise OfferError(
            f"No supported audio codec in the offer ({', '.join(sorted(names)) or 'none'}); use Opus."
        )
    if audio[0].direction in ("inactive",):
        raise OfferError("The audio section is inactive.")
    return parsed


# --- inbound audio latency -----------------------------------------------------------------


class ImmediateAudioBuffer(JitterBuffer):
    """aiortc's audio jitter buffer holds four packets back (~80 ms) for smooth playout; the
    server does not play mic audio, it scores and transcribes it, so every packet goes to the
    decoder on arrival. Duplicates and packets older than the newest are dropped."""

    def __init__(self) -> None:
        super().__init__(capacity=16)
        self._newest: int | None = None

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        seq = packet.sequence_number
        if self._newest is not None and not 0 < uint16_add(seq, -self._newest) < 0x8000:
            return False, None
        self._newest = seq
        data: bytes = getattr(packet, "_data", packet.payload)  # depayloaded by the receiver
        return False, JitterFrame(data=data, timestamp=packet.timestamp)


_JITTER_BUFFER_ATTR = "_RTCRtpReceiver__jitter_buffer"


def analyse_audio_on_arrival(pc: RTCPeerConnection) -> None:
    """Swap the audio receivers' jitter buffers for `ImmediateAudioBuffer` (before media flows)."""
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if transceiver.kind != "audio":
            continue
        if hasattr(receiver, _JITTER_BUFFER_ATTR):
            setattr(receiver, _JITTER_BUFFER_ATTR, ImmediateAudioBuffer())
        else:  # another aiortc layout: keep its buffer (80 ms more input latency)
            log.warning("cannot reach aiortc's audio jitter buffer; mic audio keeps its playout delay")


# --- one peer ------------------------------------------------------------------------------

MessageCallback = Callable[[str], None]


def peer_connection(ice_servers: Sequence[IceServer]) -> RTCPeerConnection:
    """A peer connection with exactly the configured ICE servers (aiortc would add a STUN one)."""
    return RTCPeerConnection(RTCConfiguration(iceServers=[s.to_aiortc() for s in ice_servers]))


class ChannelPeer:
    """What every answered peer shares: connection state, one text data channel (``channel_label``,
    with backpressure) and the answer/close lifecycle. Subclasses add their media."""

    channel_label: ClassVar[str]
    channel_name: ClassVar[str]  # in the end reason when the channel closes
    channel_high_water: ClassVar[int]  # bytes queued on the channel before `send_text` waits
    channel_low_water: ClassVar[int]
    send_errors: ClassVar[tuple[type[Exception], ...]] = (InvalidStateError,)

    def __init__(self, pc: RTCPeerConnection) -> None:
        self.pc = pc
        self.on_message: MessageCallback | None = None
        self.channel: RTCDataChannel | None = None
        self.connected = asyncio.Event()
        self.ended = asyncio.Event()
        self.end_reason = ""
        # The peer closed the channel itself (a stream reset while the SCTP association was
        # up): a deliberate goodbye, unlike a connection that failed or was torn down.
        self.closed_by_peer = False
        self.opened = False  # the channel has been open (ICE, DTLS and SCTP all got through)
        self._channel_open = asyncio.Event()
        self._drained = asyncio.Event()  # the channel's buffer fell below the low-water mark
        self._closed = False
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    async def _answer(self, offer_sdp: str, add_tracks: Callable[[], object]) -> str:
        """Answer the (checked) offer: ``add_tracks`` runs after the remote description, so
        tracks bind to the offered sections. Raises ``OfferError`` (and leaves nothing open)."""
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            add_tracks()
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except (ValueError, InternalError, InvalidAccessError, InvalidStateError, OperationError) as exc:
            await self.close("offer rejected")
            raise OfferError(f"Cannot answer the SDP offer: {exc}") from None
        except BaseException:
            await self.close("offer failed")
            raise
        description = self.pc.localDescription
        assert description is not None
        return description.sdp

    async def next_from(self, inbox: asyncio.Queue[str]) -> str | None:
        """The inbox's next message, or None once the link has ended first."""
        if not inbox.empty():
            return inbox.get_nowait()
        message = asyncio.ensure_future(inbox.get())
        ended = asyncio.ensure_future(self.ended.wait())
        try:
            await asyncio.wait({message, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not message.done():
                message.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ended
        if message.done() and not message.cancelled():
            return message.result()
        return None

    # --- aiortc callbacks (synchronous: pyee would run coroutines as unowned tasks) ---------

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != self.channel_label or self.channel is not None:
            log.info("closing unexpected data channel %r", channel.label)
            channel.close()
            return
        self.channel = channel
        channel.bufferedAmountLowThreshold = self.channel_low_water
        channel.on("message", self._on_message)
        channel.on("open", self._on_channel_open)
        channel.on("bufferedamountlow", self._drained.set)
        channel.on("close", self._on_channel_close)
        if channel.readyState == "open":
            self._on_channel_open()

    def _on_channel_open(self) -> None:
        self.opened = True
        self._channel_open.set()

    def _on_channel_close(self) -> None:
        # An SCTP ABORT (the peer's `pc.close()`), a lost connection or our own close mark
        # the association closed before its channels; a channel the peer closed alone does not.
        sctp = self.pc.sctp
        if not self.ended.is_set() and sctp is not None and sctp.state == "connected":
            self.closed_by_peer = True
            self.end(f"{self.channel_name} channel closed by the peer")
        else:
            self.end(f"{self.channel_name} channel closed")

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
        """Mark the peer ended (wakes every waiter; each checks `ended` after waking); ``close``
        releases it."""
        if not self.ended.is_set():
            self.end_reason = reason
            self.ended.set()
            self._channel_open.set()
            self._drained.set()

    # --- use --------------------------------------------------------------------------------

    async def send_text(self, text: str) -> bool:
        """Send one message on the channel, waiting for it to open and to drain below the
        high-water mark; False when the peer ended first."""
        await self._channel_open.wait()
        channel, high_water = self.channel, self.channel_high_water
        while not self.ended.is_set() and channel is not None and channel.bufferedAmount > high_water:
            self._drained.clear()
            await self._drained.wait()
        if self.ended.is_set() or channel is None or channel.readyState != "open":
            return False
        try:
            channel.send(text)
        except self.send_errors:
            log.warning("%s channel: could not send a %d-byte message", self.channel_name, len(text))
            return False
        return True

    async def _release(self) -> None:
        """Stop the subclass's media (once, from ``close``)."""

    async def close(self, reason: str = "closed") -> None:
        """Stop everything this peer holds (idempotent)."""
        self.end(reason)
        if self._closed:
            return
        self._closed = True
        await self._release()
        with contextlib.suppress(Exception):
            await self.pc.close()


class PeerLink(ChannelPeer):
    """One answered peer connection: audio in, the outbound track, the events channel."""

    channel_label = EVENTS_CHANNEL
    channel_name = "events"
    channel_high_water = CHANNEL_HIGH_WATER
    channel_low_water = CHANNEL_LOW_WATER
    send_errors = (InvalidStateError, ValueError)  # closed meanwhile; over the peer's size limit

    def __init__(
        self,
        pc: RTCPeerConnection,
        outbound: OutboundAudioTrack,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        super().__init__(pc)
        self.outbound = outbound
        self.max_message_size = max_message_size  # the largest message the peer accepts
        self.on_audio: AudioCallback | None = None
        self.pump: InboundAudioPump | None = None
        pc.on("track", self._on_track)

    @classmethod
    async def answer(
        cls, offer_sdp: str, *, ice_servers: Sequence[IceServer], outbound: OutboundAudioTrack
    ) -> tuple[PeerLink, str]:
        """Check `offer_sdp`, answer it; raises `OfferError` (and leaves nothing open)."""
        offer = check_offer(offer_sdp)
        caps = [m.sctpCapabilities for m in offer.media if m.sctpCapabilities is not None]
        max_size = caps[0].maxMessageSize if caps and caps[0].maxMessageSize else DEFAULT_MAX_MESSAGE_SIZE
        link = cls(peer_connection(ice_servers), outbound, max_message_size=max_size)

        def add_tracks() -> None:
            analyse_audio_on_arrival(link.pc)
            link.pc.addTrack(outbound)

        return link, await link._answer(offer_sdp, add_tracks)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio" or self.pump is not None:
            return
        self.pump = InboundAudioPump(track, self._deliver_audio)
        self.pump.start(name="webrtc:inbound-audio")

    def _deliver_audio(self, samples: Any, rate: int) -> None:
        if self.on_audio is not None:
            self.on_audio(samples, rate)

    async def wait_ready(self, within_s: float) -> bool:
        """True once ICE/DTLS connected and the events channel is open; False on timeout/end."""

        async def ready() -> None:
            await self.connected.wait()
            await self._channel_open.wait()

        waiter = asyncio.ensure_future(ready())
        ended = asyncio.ensure_future(self.ended.wait())
        try:
            await asyncio.wait({waiter, ended}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (waiter, ended):
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fut
        channel = self.channel
        open_channel = channel is not None and channel.readyState == "open"
        return open_channel and self.connected.is_set() and not self.ended.is_set()

    async def _release(self) -> None:
        if self.pump is not None:
            await self.pump.aclose()
        self.outbound.stop()
