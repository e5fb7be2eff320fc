"""One WebRTC call as a session transport: the `oai-events` channel and the audio tracks.

A :class:`RealtimeCall` is what the session host attaches (:class:`~session.link.Transport`),
like a WebSocket: JSON events on the data channel, mic audio from the inbound track into the
driver (`feed_input_audio`), and model audio out on the paced outbound track: the call's
``audio_sink`` makes the driver emit `PlayAudio` / `ClearAudioOutput` effects instead of
`response.output_audio.delta` events while this call is attached (playout is reported back
for truncation on barge-in).

How a call ends decides what happens to its session (see session/voice/hosting.py `_watch`):

* hangup (`POST …/hangup`): the session is deleted (web/transports/webrtc.py);
* the client closes the `oai-events` channel while the peer connection is up: a clean close,
  like a WebSocket close 1000 (``disconnect_code``): the session is parked;
* the peer vanishes (ICE consent lost, connection failed, DTLS/SCTP gone, `pc.close()` or a
  closed tab without a hangup): an unclean drop: the session is detached for the disconnect
  grace period and can be resumed over a WebSocket or a new call;
* a new session's call whose ICE never connects (or that ended before it did): nobody ever
  received its resume token, so it is deleted (``info.session_end``) and its slot freed after the
  connect timeout. A resuming call that never connects leaves its session detached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from media.tracks import OutboundAudioTrack
from media.webrtc import PeerLink
from session.link import ConnectionInfo
from session.realtime.effects import CoreOutput, PlayAudio
from session.realtime.ids import random_id
from session.store.event_ids import event_text
from session.voice.driver import RealtimeDriver
from web.transports.peer_call import PeerCall

log = logging.getLogger(__name__)

APPEND = "input_audio_buffer.append"
AUDIO_DELTA = "response.output_audio.delta"


def append_rejection(text: str) -> dict[str, Any] | None:
    """The `error` event for an `input_audio_buffer.append` sent on the events channel (mic
    audio belongs on the track), or None when `text` is another event."""
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):  # the core answers it (session/json_guard.py)
        return None
    if not isinstance(event, dict) or event.get("type") != APPEND:
        return None
    client_id = event.get("event_id")
    return {
        "type": "error",
        "event_id": random_id("event"),
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_event",
            "message": "input_audio_buffer.append is not supported on WebRTC calls: "
            "send microphone audio on the audio track.",
            "param": "type",
            "event_id": client_id if isinstance(client_id, str) else None,
        },
    }


def too_large(event: dict[str, Any], size: int, limit: int) -> dict[str, Any]:
    """What the peer gets instead of an event its data channel cannot carry."""
    return {
        "type": "error",
        "event_id": random_id("event"),
        "error": {
            "type": "server_error",
            "code": "event_too_large",
            "message": f"A {event.get('type')} event of {size} bytes exceeds this data channel's "
            f"{limit}-byte message limit and was not sent.",
            "param": None,
            "event_id": None,
        },
    }


class TrackAudioSink:
    """The driver's `AudioSink`: `PlayAudio` / `ClearAudioOutput` effects onto the track."""

    def __init__(self, track: OutboundAudioTrack) -> None:
        self.track = track

    def play(self, effect: PlayAudio) -> None:
        self.track.play(effect.response_id, effect.samples, effect.sample_rate)

    def clear(self, response_id: str) -> None:
        self.track.clear(response_id)


class RealtimeCall(PeerCall[PeerLink]):
    """One WebRTC call: a `PeerLink` as the `Transport` of a hosted session."""

    def __init__(
        self,
        call_id: str,
        tenant: str,
        session_id: str,
        link: PeerLink,
        *,
        connect_timeout_s: float,
        new_session: bool,
    ) -> None:
        # The track plays model audio (the driver reads it on attach); disconnect_code
        # CLEAN_CLOSE: the client closed the channel; session_end: (cause, delete) for the host.
        super().__init__(
            call_id,
            link,
            ConnectionInfo(audio_sink=TrackAudioSink(link.outbound)),
            connect_timeout_s=connect_timeout_s,
            new_session=new_session,
            inbox_max=256,
        )
        self.tenant = tenant
        self.session_id = session_id
        self.driver: RealtimeDriver | None = None

    def bind(self, driver: RealtimeDriver) -> None:
        """Route the peer's audio and playout reports to `driver` (before it attaches us)."""
        self.driver = driver
        self.link.outbound.observer = driver
        self.link.on_audio = driver.feed_input_audio
        self.link.on_message = self._on_message

    # --- Transport ----------------------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == AUDIO_DELTA:
            # Audio of a response that ran while the session was served over a WebSocket (or
            # replayed from then): it cannot be played on the track; its transcript is sent.
            return
        if kind == "response.done":
            # All of the response's audio has been queued on the track by now.
            self.link.outbound.finish(str(event.get("response", {}).get("id", "")))
        # A logged event carries the JSON text the log stored: no second serialization.
        text = event_text(event)
        size = len(text.encode())
        if size > self.link.max_message_size:
            text = json.dumps(too_large(event, size, self.link.max_message_size))
        await self.link.send_text(text)

    def _note_end(self) -> None:
        """Tell the host how the call ended (read by its `_watch` once the link is done)."""
        super()._note_end()
        if self.new_session and not self.link.opened:
            self.info.session_end = ("never_connected", True)

    def _on_message(self, text: str) -> None:
        if APPEND in text and self.driver is not None:
            rejection = append_rejection(text)
            if rejection is not None:
                self.driver.apply(CoreOutput(events=[rejection]))
                return
        try:
            self._inbox.put_nowait(text)
        except asyncio.QueueFull:
            if self.driver is not None:
                self.driver.request_close(1008, "client sends events faster than they are handled")

    # --- lifecycle ----------------------------------------------------------------------------

    async def watch_connect(self) -> None:
        """ICE that never connects (or no events channel): end the call. A new session ends
        with it (deleted: nobody has its resume token); a resumed one stays detached."""
        if await self.link.wait_ready(self.connect_timeout_s):
            return
        if not self.link.ended.is_set():
            log.info("call %s: not connected in %.0f s", self.call_id, self.connect_timeout_s)
        self._note_end()
        await self.link.close(self.link.end_reason or "ICE did not connect")

    async def finish(self) -> None:
        """After the host let go of this call: release the peer connection and say why."""
        await self.link.close("call ended")
        log.info(
            "call %s (session %s) ended (%s); outbound track %s",
            self.call_id,
            self.session_id,
            self.link.end_reason,
            json.dumps(self.link.outbound.stats()),
        )
