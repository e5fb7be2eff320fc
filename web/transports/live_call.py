"""``POST /v1/live/sessions`` with an SDP offer: a GPT-Live session over WebRTC.

As ``/v1/realtime/calls`` does for Realtime sessions: the body is the offer
(``application/sdp``, Bearer key or ``ek_`` secret), the answer comes back as ``201`` with the
SDP answer, ``Location: /v1/live/sessions/<call id>`` and the resume data as headers. The
client's ``oai-events`` data channel carries the JSON events (``session.start`` first, as over a
WebSocket); the microphone is the audio track (``session.input_audio.append`` on the channel
is refused: ``invalid_event``) and the model's continuous output stream plays on the server's
track (no ``session.output_audio.delta`` on the channel). A :class:`LiveCall` is the session's
:class:`~session.link.Transport`, so the same host, driver and core serve both transports.

How a call ends: the channel closed by the client while the peer is up is a clean close (the
session ends), a peer that vanishes detaches the session for the grace (a resume over a
WebSocket or a new call continues it), a call that never connects ends its session.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack
from starlette.requests import Request
from starlette.responses import Response

from media.audio import StreamingResampler
from media.tracks import InboundAudioPump, OutboundAudioTrack
from media.webrtc import MAX_OFFER_BYTES, IceServer, OfferError, PeerLink, check_offer
from session.link import ConnectionInfo, LinkEnd
from session.live import events as ev
from session.live.core import Emit
from session.live.driver import LiveDriver
from web.edge.bodies import BodyRefused, read_body
from web.transports.peer_call import PeerCall

log = logging.getLogger(__name__)

RATE = 24_000
STREAM = "live"  # the one "response" of the outbound track: the continuous output stream
INBOX_MAX = 256


class LivePeerLink(PeerLink):
    """A peer link whose microphone track is read at the model's 24 kHz (the Realtime calls'
    links read it at the VAD's 16 kHz)."""

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio" or self.pump is not None:
            return
        self.pump = InboundAudioPump(track, self._deliver_audio, rate=RATE)
        self.pump.start(name="live:inbound-audio")


async def answer_offer(sdp: str, ice_servers: list[IceServer]) -> tuple[LivePeerLink, str]:
    link, answer = await LivePeerLink.answer(sdp, ice_servers=ice_servers, outbound=OutboundAudioTrack())
    assert isinstance(link, LivePeerLink)
    return link, answer


async def read_offer(request: Request) -> str | Response:
    """The SDP offer of the request (``application/sdp``), or the error response."""
    from web.edge.refusals import Denial

    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("application/sdp", "text/plain", ""):
        return Denial(
            415, "unsupported_content_type", f"Send the offer as application/sdp, not {kind!r}."
        ).response()
    try:
        body = await read_body(request, MAX_OFFER_BYTES)
    except BodyRefused as refused:
        return refused.response
    sdp = body.decode("utf-8", errors="replace")
    try:
        check_offer(sdp)
    except OfferError as exc:
        return Denial(400, "invalid_offer", str(exc)).response()
    return sdp


def new_call_id() -> str:
    return "rtc_live_" + secrets.token_hex(12)


class LiveCall(PeerCall[LivePeerLink]):
    """One WebRTC call as a live session's transport (module docstring)."""

    def __init__(
        self, call_id: str, link: LivePeerLink, *, connect_timeout_s: float, new_session: bool
    ) -> None:
        super().__init__(
            call_id,
            link,
            ConnectionInfo(),
            connect_timeout_s=connect_timeout_s,
            new_session=new_session,
            inbox_max=INBOX_MAX,
        )
        self.driver: LiveDriver | None = None
        self._resampler: StreamingResampler | None = None

    def bind(self, driver: LiveDriver) -> None:
        """Route the peer's audio and events to ``driver`` (before it attaches us)."""
        self.driver = driver
        self.link.on_audio = self._on_audio
        self.link.on_message = self._on_message

    def _on_audio(self, samples: Any, rate: int) -> None:
        driver = self.driver
        if driver is None:
            return
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if rate != RATE:
            if self._resampler is None or self._resampler.src_rate != rate:
                self._resampler = StreamingResampler(rate, RATE)
            samples = self._resampler.process(samples)
        if driver.link is not None and driver.link.transport is self:
            driver.feed_audio(samples)

    def _on_message(self, text: str) -> None:
        driver = self.driver
        if '"session.input_audio.append"' in text and driver is not None:
            refused = ev.error(
                "invalid_event",
                "session.input_audio.append is not taken on a WebRTC call: send microphone audio "
                "on the audio track.",
                param="type",
            )
            driver.apply([Emit(refused)])
            return
        try:
            self._inbox.put_nowait(text)
        except asyncio.QueueFull:
            if driver is not None and driver.link is not None:
                driver.link.finish(
                    LinkEnd.SLOW_CLIENT, 1008, "client sends events faster than they are handled"
                )

    # --- Transport ----------------------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        if event.get("type") == "session.output_audio.delta":
            pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")
            self.link.outbound.play(STREAM, pcm.astype(np.float32) / 32768.0, RATE)
            return
        await self.link.send_text(json.dumps(event))

    async def watch_connect(self) -> bool:
        """False (and the link closed) when ICE or the events channel never came up."""
        if await self.link.wait_ready(self.connect_timeout_s):
            return True
        self._note_end()
        await self.link.close(self.link.end_reason or "ICE did not connect")
        return False
