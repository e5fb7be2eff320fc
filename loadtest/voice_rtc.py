"""Scenario ``voice-webrtc``: one full-duplex voice session as a WebRTC call (aiortc peer).

The same workload as ``voice-ws`` (utterances in real time, pauses, optional barge-in) over
``POST /v1/realtime/calls``: the microphone is the call's audio track (48 kHz, 20 ms frames,
paced by aiortc's sender; silence between utterances), events travel on the ``oai-events``
data channel, and the answer comes back on the server's audio track.

Measures per turn, on the client's monotonic clock:

* **end of speech**: the utterance's last sample left the mic track;
* **first audio**: arrival of the first inbound RTP packet of the answer with energy (decoded
  peak > ``AUDIBLE``). RTP arrivals are tapped before aiortc's jitter buffer (which holds a few
  packets back) and matched to the decoded frames by RTP timestamp;
* **first → last audio**, **RTF**, **frame gaps**: over the answer's non-silent frames
  (20 ms each). The track plays in real time, so RTF ≥ 1 here by construction;
* **underruns**: the playout buffer model (:mod:`loadtest.playout`) fed with the answer's
  non-silent frames at their arrival; digital silence the server's track sends while the
  pipeline is behind real time is *missing* audio, so the next audible frame arrives late;
* **barge-in stop**: the interruption (speech onset with server VAD; ``response.cancel`` +
  ``output_audio_buffer.clear`` with manual turns) → ``output_audio_buffer.cleared``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
from aiortc import RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from loadtest.speech import SpeechBank, rtc_speech
from loadtest.turns import TurnRecord
from loadtest.voice_common import LiveCounters, SessionResult, VoiceSession, session_update
from loadtest.webrtc_client import RealtimeCallClient, audio_frames
from loadtest.workload import Workload
from media.audio import OPUS_RATE
from media.tracks import frame_to_mono

AUDIBLE = 0.02  # first audio: a decoded peak above this (full scale 1.0)
# A frame whose decoded peak is below this is digital silence: Opus decodes zeros to exact
# zeros, while the quietest stretches of speech (Piper's pauses, ~1e-4) stay above one LSB.
SILENT = 1e-5
FRAME_MS = 20.0
class _Mic:
    """Replaces the client's mic observer: when each utterance's first / last sample left."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started: dict[str, float] = {}
        self.ended: dict[str, asyncio.Future[float]] = {}

    def playout(self, response_id: str, played_ms: float) -> None:
        self.started.setdefault(response_id, self.clock())

    def playout_finished(self, response_id: str) -> None:
        fut = self.ended.get(response_id)
        if fut is not None and not fut.done():
            fut.set_result(self.clock())


class CallClient(RealtimeCallClient):
    """A call that hands events and received frames to callbacks instead of keeping them."""

    def __init__(
        self,
        http_url: str,
        on_event: Callable[[dict[str, Any], float], None],
        on_frame: Callable[[float, float], None],
        *,
        api_key: str | None = None,
    ) -> None:
        super().__init__(http_url, api_key=api_key, keep_audio=False, tap_rtp=True, max_frames=8)
        self.on_event = on_event
        self.on_frame = on_frame
        # RTP timestamp relative to the first packet's (as aiortc's decoded frames' pts are)
        # → arrival, until the frame is decoded.
        self.arrivals: dict[int, float] = {}
        self._origin: int | None = None
        self.unmatched = 0  # decoded frames whose packet arrival was not found

    async def open(self, timeout_s: float = 30.0) -> str | None:
        """Offer → answer → data channel open; the refusal's error code, or None when admitted."""
        sdp = await self.offer()
        headers = {"Content-Type": "application/sdp"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            resp = await http.post(f"{self.http_url}/v1/realtime/calls", content=sdp, headers=headers)
        if resp.status_code != 201:
            try:
                return str(resp.json()["error"]["code"])
            except (ValueError, KeyError, TypeError):
                return f"http_{resp.status_code}"
        location = resp.headers["location"]
        from loadtest.webrtc_client import CallInfo

        self.call = CallInfo(location.rsplit("/", 1)[-1], location, resp.text, resp.status_code)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=resp.text, type="answer"))
        async with asyncio.timeout(timeout_s):
            await self._open.wait()
        return None

    def _on_message(self, message: str | bytes) -> None:
        text = message if isinstance(message, str) else message.decode()
        self.on_event(json.loads(text), self.clock())

    def _tapped(self, handle: Callable[[Any, int], Awaitable[None]]) -> Callable[[Any, int], Awaitable[None]]:
        async def tapped(packet: Any, arrival_time_ms: int) -> None:
            if self._origin is None:
                self._origin = packet.timestamp
            self.arrivals[(packet.timestamp - self._origin) & 0xFFFFFFFF] = self.clock()
            if len(self.arrivals) > 256:  # never decoded (lost in the jitter buffer)
                for key in list(self.arrivals)[:128]:
                    del self.arrivals[key]
            await handle(packet, arrival_time_ms)

        return tapped

    async def _listen(self, track: MediaStreamTrack) -> None:
        async for frame in audio_frames(track):
            at = self.arrivals.pop(frame.pts, None) if frame.pts is not None else None
            if at is None:
                self.unmatched += 1
                at = self.clock()
            samples = frame_to_mono(frame)
            self.on_frame(at, float(np.abs(samples).max()) if len(samples) else 0.0)


class VoiceRtcSession(VoiceSession[np.ndarray]):
    def __init__(
        self,
        index: int,
        base_url: str,
        workload: Workload,
        bank: SpeechBank,
        counters: LiveCounters,
        *,
        clock: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
    ) -> None:
        super().__init__(index, workload, bank, counters, clock)
        self.base_url = base_url
        self.speech = rtc_speech(bank)
        self.api_key = api_key
        self._client: CallClient | None = None
        self._mic = _Mic(clock)
        self._current: TurnRecord | None = None  # the turn whose answer arriving frames belong to
        self._audio_started: set[str] = set()
        self._audio_ended: set[str] = set()  # output_audio_buffer.stopped or .cleared
        self._silent_since: float | None = None  # after a barge-in: first frame of the silence
        self._silent_run = 0  # silent frames since the current reply's last audible one
        self._cleared_at: dict[str, float] = {}  # output_audio_buffer.cleared arrival
        self._closing = False
        self._said = 0

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self, end_at: float) -> SessionResult:
        client = CallClient(self.base_url, self._on_event, self._on_frame, api_key=self.api_key)
        self._client = client
        client.mic.observer = self._mic
        client.pc.on("connectionstatechange", self._on_state)
        try:
            refusal = await client.open()
        except (OSError, TimeoutError, httpx.HTTPError) as exc:
            await client.close()
            return self._connect_failed(exc)
        if refusal is not None:
            await client.close()
            return self._refused(refusal)
        self._admitted()
        try:
            await self._conversation(end_at)
        finally:
            self._closing = True
            self.counters.live -= 1
            if not self._closed:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(10.0):
                        await client.hangup()
            await client.close()
        return self.result

    def _on_state(self) -> None:
        assert self._client is not None
        state = self._client.pc.connectionState
        if state in ("failed", "closed") and not self._closing and not self._closed:
            self._closed = True
            self.result.close = f"peer connection {state}"
            self._count_error("connection_closed")
            self._changed.set()

    async def _send_event(self, event: dict[str, Any]) -> None:
        assert self._client is not None
        self._client.send(event)

    def _session_update(self) -> dict[str, Any]:
        event = session_update(self.w)
        audio = event["session"]["audio"]
        audio["input"].pop("format"), audio["output"].pop("format")  # the track's codec decides
        return event

    # --- microphone ----------------------------------------------------------------------

    def _speak(self, speech: np.ndarray) -> asyncio.Future[float]:
        """Queue an utterance on the mic track; the future gets its end-of-speech time."""
        assert self._client is not None
        self._said += 1
        name = f"utt-{self._said}"
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._mic.ended[name] = fut
        self._client.mic.play(name, speech, OPUS_RATE)
        self._client.mic.finish(name)
        return fut

    # --- server events and frames ----------------------------------------------------------

    def _on_frame(self, at: float, peak: float) -> None:
        turn = self._current
        if turn is None or turn.speech_end is None or at < turn.speech_end:
            return
        if turn.barge_in_at is not None and at >= turn.barge_in_at:
            # Interrupted: when did the answer stop arriving (silence from here on)?
            if peak < SILENT:
                if self._silent_since is None:
                    self._silent_since = at
                    self._changed.set()
            else:
                self._silent_since = None
        if peak < SILENT:
            if turn.first_audio_at is not None and turn.barge_in_at is None:
                self._silent_run += 1
            return
        if turn.first_audio_at is None and peak < AUDIBLE:
            return
        if self._silent_run and turn.barge_in_at is None:
            turn.silent_frames += self._silent_run  # silence *inside* the reply: the track ran dry
        self._silent_run = 0
        turn.on_audio(at, FRAME_MS)
        if turn is self._barge_watch and turn.audio_ms >= self.w.barge_in_after_ms:
            self._changed.set()

    def _on_event(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("type")
        rid = str(event.get("response_id", ""))
        if kind == "output_audio_buffer.started":
            self._audio_started.add(rid)
        elif kind in ("output_audio_buffer.stopped", "output_audio_buffer.cleared"):
            self._audio_ended.add(rid)
            if kind.endswith("cleared"):
                self._cleared_at[rid] = now
        else:
            self._on_response_event(kind, event, now)
            return
        self._changed.set()

    # --- turns ---------------------------------------------------------------------------

    def _played_out(self, turn: TurnRecord) -> bool:
        """The reply is done and its audio has left the server's track (or it had none)."""
        if turn.done_at is None or turn.response_id is None:
            return False
        rid = turn.response_id
        return rid in self._audio_ended or rid not in self._audio_started

    def _reply_over(self, turn: TurnRecord) -> bool:
        return self._played_out(turn)

    def _new_turn(self, number: int) -> tuple[TurnRecord, np.ndarray]:
        k = self._rng.randrange(len(self.speech))
        return self._turn_record(number, self.bank.utterances[k].speech_ms), self.speech[k]

    def _on_spoken(self, turn: TurnRecord) -> None:
        self._current, self._silent_run = turn, 0

    async def _await_reply(self, turn: TurnRecord) -> None:
        """Until the reply has left the server's track (and, after a barge-in, its silence)."""
        assert turn.speech_end is not None
        deadline = turn.speech_end + self.w.response_timeout_s
        await self._wait(lambda: self._played_out(turn), deadline)
        if turn.barge_in_at is not None:  # the silent frames follow the cleared event
            await self._wait(lambda: self._silent_since is not None, self.clock() + 0.5)

    def _on_barge_in(self, turn: TurnRecord) -> None:
        self._silent_since = None

    async def _interrupt_manual(self, turn: TurnRecord) -> None:
        if turn.done_at is None:
            await self._send_event({"type": "response.cancel"})
        await self._send_event({"type": "output_audio_buffer.clear"})

    def _close_turn(self, turn: TurnRecord) -> None:
        if turn.barge_in_at is not None and turn.response_id in self._cleared_at:
            # The audio stopped: the first frame of the silence that followed the interruption
            # (the server's `cleared` event when frames did not show it, e.g. a late turn).
            cleared = self._cleared_at.pop(turn.response_id)
            turn.barge_in_done_at = self._silent_since if self._silent_since is not None else cleared
        if not self._expire_turn(turn) and not self._played_out(turn):
            self._count_error("playout_timeout", turn)
        if turn.response_id is not None:
            self._by_response.pop(turn.response_id, None)
            self._audio_started.discard(turn.response_id)
            self._audio_ended.discard(turn.response_id)
        self._record_turn(turn)
