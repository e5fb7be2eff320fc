"""A Python WebRTC client for `POST /v1/realtime/calls` (aiortc), for tests and benchmarks.

It offers one audio track (a paced `OutboundAudioTrack`: `say()` queues speech, silence
otherwise, and records when each utterance's last sample left), creates the `oai-events`
data channel, and records what comes back: every event with its arrival time, and the
server's audio track as decoded 20 ms frames. ICE servers are empty unless given, so nothing
outside the machine is contacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import av
import httpx
import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from media.tracks import OutboundAudioTrack, frame_to_mono
from media.webrtc import EVENTS_CHANNEL

Clock = Callable[[], float]


async def audio_frames(track: MediaStreamTrack) -> AsyncIterator[av.AudioFrame]:
    """The track's audio frames as they are received, until it ends (other frames skipped)."""
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if isinstance(frame, av.AudioFrame):
            yield frame


@dataclass(slots=True)
class HeardFrame:
    at: float  # client clock when the decoded frame came out of the receiver
    rms: float
    samples: np.ndarray | None  # float32 mono (kept while `keep_audio`)


@dataclass(slots=True)
class RtpArrival:
    at: float  # client clock when the packet reached the receiver (before its jitter buffer)
    timestamp: int
    payload: bytes


@dataclass(slots=True)
class Utterance:
    name: str
    duration_s: float
    started_at: float | None = None  # first sample left
    ended_at: float | None = None  # last sample left


class _MicObserver:
    def __init__(self, client: RealtimeCallClient) -> None:
        self._client = client

    def playout(self, response_id: str, played_ms: float) -> None:
        utt = self._client.utterances.get(response_id)
        if utt is not None and utt.started_at is None:
            utt.started_at = self._client.clock()

    def playout_finished(self, response_id: str) -> None:
        utt = self._client.utterances.get(response_id)
        if utt is not None and utt.ended_at is None:
            utt.ended_at = self._client.clock()


@dataclass(slots=True)
class CallInfo:
    call_id: str
    location: str
    answer_sdp: str
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)


class RealtimeCallClient:
    """One call. `async with RealtimeCallClient(url) as client:` connects (offer → answer)."""

    path = "/v1/realtime/calls"  # where the offer goes (a GPT-Live call: LiveCallClient)

    def __init__(
        self,
        http_url: str,
        *,
        api_key: str | None = None,
        session: dict[str, Any] | None = None,
        ice_servers: Sequence[RTCIceServer] = (),
        clock: Clock = time.monotonic,
        keep_audio: bool = True,
        tap_rtp: bool = False,
        max_frames: int = 30_000,
        extensions: bool = False,
    ) -> None:
        """`extensions`: ask for the server's `omni.*` events (`?omni_extensions=1`), e.g.
        `omni.session.resumable` on the data channel; a stock client does not."""
        self.http_url = http_url.rstrip("/")
        self.extensions = extensions
        self.api_key = api_key
        self.session = session
        self.clock = clock
        self.keep_audio = keep_audio
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=list(ice_servers)))
        self.mic = OutboundAudioTrack(_MicObserver(self))
        self.channel = self.pc.createDataChannel(EVENTS_CHANNEL)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.heard: deque[HeardFrame] = deque(maxlen=max_frames)
        self.rtp: deque[RtpArrival] = deque(maxlen=max_frames)
        self.utterances: dict[str, Utterance] = {}
        self.call: CallInfo | None = None
        self._tap_rtp = tap_rtp
        self._new_event = asyncio.Event()
        self._open = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.channel.on("open", self._open.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    async def __aenter__(self) -> RealtimeCallClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- signalling ---------------------------------------------------------------------------

    async def offer(self) -> str:
        self.pc.addTransceiver(self.mic, direction="sendrecv")
        await self.pc.setLocalDescription(await self.pc.createOffer())
        description = self.pc.localDescription
        assert description is not None
        return description.sdp

    async def connect(
        self,
        *,
        timeout_s: float = 20.0,
        resume: tuple[str, str, str | None] | None = None,
    ) -> CallInfo:
        """Offer, answer, wait for the events channel. `resume`: (session id, resume token,
        last event id) of a session to resume on this call."""
        sdp = await self.offer()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        params: dict[str, str] = {"omni_extensions": "1"} if self.extensions else {}
        if resume is not None:
            params["session_id"] = resume[0]
            headers["X-Omni-Resume-Token"] = resume[1]
            if resume[2] is not None:
                params["last_event_id"] = resume[2]
        url = f"{self.http_url}{self.path}"
        async with httpx.AsyncClient(timeout=30.0) as http:
            if self.session is None:
                headers["Content-Type"] = "application/sdp"
                resp = await http.post(url, content=sdp, headers=headers, params=params)
            else:
                files = {"sdp": (None, sdp), "session": (None, json.dumps(self.session))}
                resp = await http.post(url, files=files, headers=headers, params=params)
        if resp.status_code != 201:
            raise RuntimeError(f"call rejected: {resp.status_code} {resp.text}")
        location = resp.headers["location"]
        self.call = CallInfo(
            location.rsplit("/", 1)[-1], location, resp.text, resp.status_code, dict(resp.headers)
        )
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=resp.text, type="answer"))
        async with asyncio.timeout(timeout_s):
            await self._open.wait()
        return self.call

    async def hangup(self) -> int:
        assert self.call is not None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=10.0) as http:
            resp = await http.post(f"{self.http_url}{self.call.location}/hangup", headers=headers)
        return resp.status_code

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.mic.stop()
        await self.pc.close()

    # --- events -------------------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def send_raw(self, text: str) -> None:
        self.channel.send(text)

    def _on_message(self, message: str | bytes) -> None:
        text = message if isinstance(message, str) else message.decode()
        self.events.append((self.clock(), json.loads(text)))
        self._new_event.set()

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for _, e in self.events if e.get("type") == type_]

    async def wait_event(
        self,
        type_: str,
        *,
        timeout_s: float = 30.0,
        after: int = 0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[float, dict[str, Any]]:
        """The first event of `type_` at index ≥ `after` (matching `where`), waiting for it."""
        deadline = self.clock() + timeout_s
        index = after
        while True:
            while index < len(self.events):
                at, event = self.events[index]
                index += 1
                if event.get("type") == type_ and (where is None or where(event)):
                    return at, event
            remaining = deadline - self.clock()
            if remaining <= 0:
                seen = [e.get("type") for _, e in self.events[after:]]
                raise TimeoutError(f"no {type_} within {timeout_s} s; got {seen}")
            self._new_event.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._new_event.wait()

    # --- audio --------------------------------------------------------------------------------

    def say(self, name: str, samples: np.ndarray, rate: int) -> Utterance:
        """Queue speech on the mic track (played in real time after what is queued)."""
        utt = Utterance(name, len(samples) / rate)
        self.utterances[name] = utt
        self.mic.play(name, samples, rate)
        self.mic.finish(name)
        return utt

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio":
            return
        if self._tap_rtp:
            self._tap(track)
        task = asyncio.create_task(self._listen(track), name="client-listen")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tap(self, track: MediaStreamTrack) -> None:
        """Record RTP arrivals before aiortc's jitter buffer (it holds ~4 packets back)."""
        for transceiver in self.pc.getTransceivers():
            receiver = transceiver.receiver
            if receiver.track is not track:
                continue
            receiver._handle_rtp_packet = self._tapped(receiver._handle_rtp_packet)  # type: ignore[method-assign,assignment]

    def _tapped(self, handle: Callable[[Any, int], Awaitable[None]]) -> Callable[[Any, int], Awaitable[None]]:
        async def tapped(packet: Any, arrival_time_ms: int) -> None:
            self.rtp.append(RtpArrival(self.clock(), packet.timestamp, bytes(packet.payload)))
            await handle(packet, arrival_time_ms)

        return tapped

    async def _listen(self, track: MediaStreamTrack) -> None:
        async for frame in audio_frames(track):
            samples = frame_to_mono(frame)
            rms = float(np.sqrt(np.mean(samples**2))) if len(samples) else 0.0
            self.heard.append(HeardFrame(self.clock(), rms, samples if self.keep_audio else None))

    def heard_audio(self, since: float = 0.0) -> np.ndarray:
        """Decoded server audio (48 kHz mono) of frames that came out after `since`."""
        chunks = [f.samples for f in self.heard if f.at >= since and f.samples is not None]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def decode_opus_rms(packets: Sequence[RtpArrival]) -> list[float]:
    """RMS of each tapped Opus packet, decoded in order (for benchmarks)."""
    codec = av.CodecContext.create("opus", "r")
    out: list[float] = []
    for packet in packets:
        frames = codec.decode(av.Packet(packet.payload))
        samples = np.concatenate([frame_to_mono(f) for f in frames]) if frames else np.zeros(1, np.float32)
        out.append(float(np.sqrt(np.mean(samples**2))))
    return out
