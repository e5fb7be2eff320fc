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
import base64
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import av
import httpx
import numpy as np
from aiortc import RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from loadtest.playout import PlayoutBuffer
from loadtest.speech import RATE, SpeechBank
from loadtest.turns import TurnRecord
from loadtest.voice_ws import LiveCounters, SessionResult, reset_response, session_update
from loadtest.workload import Workload
from media.audio import OPUS_RATE, resample
from media.tracks import frame_to_mono
from media.webrtc_client import RealtimeCallClient

AUDIBLE = 0.02  # first audio: a decoded peak above this (full scale 1.0)
# A frame whose decoded peak is below this is digital silence: Opus decodes zeros to exact
# zeros, while the quietest stretches of speech (Piper's pauses, ~1e-4) stay above one LSB.
SILENT = 1e-5
FRAME_MS = 20.0
_SPEECH_48K: dict[int, tuple[SpeechBank, tuple[np.ndarray, ...]]] = {}


def rtc_speech(bank: SpeechBank) -> tuple[np.ndarray, ...]:
    """The bank's utterances as 48 kHz float32 (decoded from its append events once per bank)."""
    cached = _SPEECH_48K.get(id(bank))
    if cached is not None and cached[0] is bank:
        return cached[1]
    out = []
    for utterance in bank.utterances:
        pcm = b"".join(base64.b64decode(json.loads(frame)["audio"]) for frame in utterance.frames)
        samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        samples = samples[: round(utterance.speech_ms * RATE / 1000.0)]
        out.append(resample(samples, RATE, OPUS_RATE))
    speech = tuple(out)
    _SPEECH_48K[id(bank)] = (bank, speech)
    return speech


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
        from media.webrtc_client import CallInfo

        self.call = CallInfo(location.rsplit("/", 1)[-1], location, resp.text, resp.status_code)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=resp.text, type="answer"))
        await asyncio.wait_for(self._open.wait(), timeout_s)
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
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if not isinstance(frame, av.AudioFrame):
                continue
            at = self.arrivals.pop(frame.pts, None) if frame.pts is not None else None
            if at is None:
                self.unmatched += 1
                at = self.clock()
            samples = frame_to_mono(frame)
            self.on_frame(at, float(np.abs(samples).max()) if len(samples) else 0.0)


class VoiceRtcSession:
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
        self.index = index
        self.base_url = base_url
        self.w = workload
        self.bank = bank
        self.speech = rtc_speech(bank)
        self.counters = counters
        self.clock = clock
        self.api_key = api_key
        self.result = SessionResult(index)
        self._rng = random.Random(workload.seed * 100_003 + index)
        self._client: CallClient | None = None
        self._mic = _Mic(clock)
        self._awaiting: list[TurnRecord] = []  # spoken turns waiting for response.created
        self._by_response: dict[str, TurnRecord] = {}
        self._current: TurnRecord | None = None  # the turn whose answer arriving frames belong to
        self._receiving: TurnRecord | None = None  # the turn whose response runs (for errors)
        self._audio_started: set[str] = set()
        self._audio_ended: set[str] = set()  # output_audio_buffer.stopped or .cleared
        self._changed = asyncio.Event()
        self._barge_watch: TurnRecord | None = None
        self._silent_since: float | None = None  # after a barge-in: first frame of the silence
        self._silent_run = 0  # silent frames since the current reply's last audible one
        self._cleared_at: dict[str, float] = {}  # output_audio_buffer.cleared arrival
        self._closed = False
        self._closing = False
        self._updated = False
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
            self.result.admission = "connect_failed"
            self._count_error(f"connect_failed:{type(exc).__name__}")
            self.counters.refused += 1
            await client.close()
            return self.result
        if refusal is not None:
            self.result.admission = refusal
            self.counters.refused += 1
            await client.close()
            return self.result
        self.result.admission = "admitted"
        self.counters.admitted += 1
        self.counters.live += 1
        try:
            await self._conversation(end_at)
        finally:
            self._closing = True
            self.counters.live -= 1
            if not self._closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.hangup(), 10.0)
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

    def _count_error(self, code: str, turn: TurnRecord | None = None) -> None:
        target = turn.errors if turn is not None else self.result.errors
        target[code] = target.get(code, 0) + 1
        self.counters.errors += 1

    def _send(self, event: dict[str, Any]) -> None:
        assert self._client is not None
        self._client.send(event)

    # --- microphone ----------------------------------------------------------------------

    def _speak(self, samples: np.ndarray) -> asyncio.Future[float]:
        """Queue an utterance on the mic track; the future gets its end-of-speech time."""
        assert self._client is not None
        self._said += 1
        name = f"utt-{self._said}"
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._mic.ended[name] = fut
        self._client.mic.play(name, samples, OPUS_RATE)
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
        if kind == "response.created":
            rid = str(event["response"]["id"])
            turn = self._awaiting.pop(0) if self._awaiting else None
            if turn is None:
                self._count_error("unexpected_response")
                return
            turn.response_id, turn.created_at = rid, now
            self._by_response[rid] = turn
            self._receiving = turn
        elif kind == "response.done":
            self._on_done(event["response"], now)
        elif kind == "output_audio_buffer.started":
            self._audio_started.add(rid)
        elif kind in ("output_audio_buffer.stopped", "output_audio_buffer.cleared"):
            self._audio_ended.add(rid)
            if kind.endswith("cleared"):
                self._cleared_at[rid] = now
        elif kind == "error":
            code = str((event.get("error") or {}).get("code"))
            self._count_error(code, self._receiving)
        elif kind == "session.updated":
            self._updated = True
        else:
            return
        self._changed.set()

    def _on_done(self, response: dict[str, Any], now: float) -> None:
        rid = str(response.get("id"))
        turn = self._by_response.get(rid)
        if turn is None:
            return
        if self._receiving is turn:
            self._receiving = None
        status = str(response.get("status"))
        if status == "cancelled" and turn.barge_in_at is None:
            # Server VAD heard a pause inside our utterance (see voice_ws): wait for the next reply.
            self._by_response.pop(rid, None)
            self.result.vad_splits += 1
            self._awaiting.insert(0, reset_response(turn))
            return
        turn.status, turn.done_at = status, now

    # --- turns ---------------------------------------------------------------------------

    async def _wait(self, predicate: Callable[[], bool], deadline: float) -> bool:
        while not predicate():
            remaining = deadline - self.clock()
            if remaining <= 0 or self._closed:
                return predicate()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
        return True

    def _played_out(self, turn: TurnRecord) -> bool:
        """The reply is done and its audio has left the server's track (or it had none)."""
        if turn.done_at is None or turn.response_id is None:
            return False
        rid = turn.response_id
        return rid in self._audio_ended or rid not in self._audio_started

    def _new_turn(self, number: int) -> tuple[TurnRecord, np.ndarray]:
        k = self._rng.randrange(len(self.speech))
        samples = self.speech[k]
        speech_ms = self.bank.utterances[k].speech_ms
        turn = TurnRecord(self.index, number, spoke_at=self.clock(), speech_ms=speech_ms)
        turn.playout = PlayoutBuffer(float(self.w.prebuffer_ms))
        return turn, samples

    async def _conversation(self, end_at: float) -> None:
        event = session_update(self.w)
        audio = event["session"]["audio"]
        audio["input"].pop("format"), audio["output"].pop("format")  # the track's codec decides
        self._send(event)
        if not await self._wait(lambda: self._updated, self.clock() + 30):
            self._count_error("no_session_updated")
            return
        manual = self.w.turn_detection == "manual"
        carried: tuple[TurnRecord, asyncio.Future[float]] | None = None
        number = 0
        while not self._closed:
            if carried is None:
                if self.clock() >= end_at or (self.w.max_turns and number >= self.w.max_turns):
                    break
                if manual:
                    self._send({"type": "input_audio_buffer.clear"})
                turn, samples = self._new_turn(number)
                carried = (turn, self._speak(samples))
            turn, spoken = carried
            carried = None
            self._awaiting.append(turn)
            turn.speech_end = await spoken
            self._current, self._silent_run = turn, 0
            if manual:
                self._send({"type": "input_audio_buffer.commit"})
                create: dict[str, Any] = {"type": "response.create"}
                if self.w.max_output_tokens:
                    create["response"] = {"max_output_tokens": self.w.max_output_tokens}
                self._send(create)
                turn.speech_end = self.clock()
            number += 1
            if self._rng.random() < self.w.barge_in:
                carried = await self._barge_in(turn, number)
            deadline = turn.speech_end + self.w.response_timeout_s
            await self._wait(lambda t=turn: self._played_out(t), deadline)  # type: ignore[misc]
            if turn.barge_in_at is not None:  # the silent frames follow the cleared event
                await self._wait(lambda: self._silent_since is not None, self.clock() + 0.5)
            self._close_turn(turn)
            if carried is None:
                await asyncio.sleep(self.w.pause_s)

    async def _barge_in(
        self, turn: TurnRecord, number: int
    ) -> tuple[TurnRecord, asyncio.Future[float]] | None:
        """Interrupt ``turn``'s reply once ``barge_in_after_ms`` of it has arrived."""
        deadline = (turn.speech_end or self.clock()) + self.w.response_timeout_s
        enough = self.w.barge_in_after_ms

        def ready() -> bool:
            return self._played_out(turn) or turn.audio_ms >= enough

        self._barge_watch = turn
        try:
            await self._wait(ready, deadline)
        finally:
            self._barge_watch = None
        if self._played_out(turn) or turn.audio_ms < enough or turn.response_id is None:
            return None
        turn.barge_in_at = self.clock()
        self._silent_since = None
        if self.w.turn_detection == "manual":
            if turn.done_at is None:
                self._send({"type": "response.cancel"})
            self._send({"type": "output_audio_buffer.clear"})
            return None
        # Server VAD: speaking *is* the interruption, and it starts the next turn.
        nxt, samples = self._new_turn(number)
        return nxt, self._speak(samples)

    def _close_turn(self, turn: TurnRecord) -> None:
        if turn.barge_in_at is not None and turn.response_id in self._cleared_at:
            # The audio stopped: the first frame of the silence that followed the interruption
            # (the server's `cleared` event when frames did not show it, e.g. a late turn).
            cleared = self._cleared_at.pop(turn.response_id)
            turn.barge_in_done_at = self._silent_since if self._silent_since is not None else cleared
        if turn.done_at is None:
            turn.status = "timeout" if turn.response_id is not None else "no_response"
            self._count_error(turn.status, turn)
            with contextlib.suppress(ValueError):
                self._awaiting.remove(turn)
            if self._receiving is turn:
                self._receiving = None
        elif not self._played_out(turn):
            self._count_error("playout_timeout", turn)
        if turn.response_id is not None:
            self._by_response.pop(turn.response_id, None)
            self._audio_started.discard(turn.response_id)
            self._audio_ended.discard(turn.response_id)
        self.result.turns.append(turn)
        self.counters.turns += 1
