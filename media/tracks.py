"""aiortc audio tracks of a voice session: mic audio in, paced model audio out.

`InboundAudioPump` reads the peer's audio track (aiortc decodes Opus in its own thread),
mixes it to mono, resamples it to the session's input rate and hands it to a callback.
`OutboundAudioTrack` is the track aiortc's sender pulls from: one 20 ms frame per `recv()`,
released by a `FramePacer` on a monotonic clock, silence when nothing is queued, and a
playout report after every frame so the session knows what the peer has been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import time
from collections.abc import Callable
from typing import Protocol

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from media.audio import OPUS_RATE, VAD_RATE, StreamingResampler
from media.pacing import Clock, FramePacer, PlayoutBuffer, Sleep

log = logging.getLogger(__name__)

FRAME_MS = 20


def frame_to_mono(frame: av.AudioFrame) -> np.ndarray:
    """An audio frame (any sample format and layout) → float32 mono in [-1, 1)."""
    data = frame.to_ndarray()
    channels = len(frame.layout.channels)
    # Planar: one row per channel; packed: channels interleaved in one row.
    data = data.reshape(channels, -1) if frame.format.is_planar else data.reshape(-1, channels).T
    name = frame.format.name.rstrip("p")
    if name == "s16":
        mono = data.astype(np.float32).mean(axis=0) / 32768.0
    elif name == "s32":
        mono = data.astype(np.float32).mean(axis=0) / 2147483648.0
    elif name in ("flt", "dbl"):
        mono = data.astype(np.float32).mean(axis=0)
    else:
        raise ValueError(f"unsupported audio sample format {frame.format.name!r}")
    return np.ascontiguousarray(mono, dtype=np.float32)


AudioCallback = Callable[[np.ndarray, int], None]


class InboundAudioPump:
    """Drains a remote audio track into `on_audio(samples, rate)` (float32 mono at `rate`).

    The remote track's own queue is unbounded, so the pump reads it continuously from the
    moment it starts; `on_audio` may be swapped (or be None, dropping audio) at any time.
    """

    def __init__(
        self, track: MediaStreamTrack, on_audio: AudioCallback | None, *, rate: int = VAD_RATE
    ) -> None:
        self.track = track
        self.on_audio = on_audio
        self.rate = rate
        self._resampler: StreamingResampler | None = None
        self._task: asyncio.Task[None] | None = None
        self.frames = 0
        self.samples_in = 0

    def start(self, name: str = "inbound-audio") -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=name)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                frame = await self.track.recv()
            except MediaStreamError:
                return
            if not isinstance(frame, av.AudioFrame):
                continue
            try:
                samples = frame_to_mono(frame)
            except ValueError:
                log.warning("dropping inbound audio frame in format %s", frame.format.name)
                continue
            self.frames += 1
            self.samples_in += len(samples)
            src_rate = int(frame.sample_rate or OPUS_RATE)
            if self._resampler is None or self._resampler.src_rate != src_rate:
                self._resampler = StreamingResampler(src_rate, self.rate)
            out = self._resampler.process(samples)
            if len(out) and self.on_audio is not None:
                self.on_audio(out, self.rate)


class PlayoutObserver(Protocol):
    """Where the outbound track reports what it has sent (the session driver fits)."""

    def playout(self, response_id: str, played_ms: float) -> None: ...

    def playout_finished(self, response_id: str) -> None: ...


class OutboundAudioTrack(MediaStreamTrack):
    """The server's audio track: queued model audio, paced at 20 ms, silence when idle.

    `play` / `clear` / `finish` are called from the event loop (session effects); `recv` is
    called by aiortc's sender, which encodes each frame in a worker thread. A response starts
    playing after a pre-roll of `preroll_ms` (one frame) unless `lead_ms` of it is already
    queued (see `PlayoutBuffer`): no underrun while the pipeline keeps ahead of real time.
    """

    kind = "audio"

    def __init__(
        self,
        observer: PlayoutObserver | None = None,
        *,
        rate: int = OPUS_RATE,
        frame_ms: int = FRAME_MS,
        max_buffered_s: float = 120.0,
        preroll_ms: float = FRAME_MS,
        lead_ms: float = 200.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        super().__init__()
        self.observer = observer
        self.rate = rate
        self.frame_samples = rate * frame_ms // 1000
        self.buffer = PlayoutBuffer(
            rate, max_buffered_s=max_buffered_s, preroll_s=preroll_ms / 1000.0, lead_s=lead_ms / 1000.0
        )
        self.pacer = FramePacer(frame_ms / 1000.0, clock=clock, sleep=sleep)
        self._clock = clock
        self._time_base = fractions.Fraction(1, rate)
        self.frames_sent = 0
        self.audible_frames = 0

    @property
    def underrun_frames(self) -> int:
        """Silent frames sent inside a response (its audio came too late)."""
        return self.buffer.underrun_frames

    # --- control, from the session ---------------------------------------------------------

    def play(self, response_id: str, samples: np.ndarray, rate: int) -> None:
        self.buffer.push(response_id, np.asarray(samples, dtype=np.float32), rate, self._clock())

    def finish(self, response_id: str) -> None:
        """All audio of `response_id` is queued; report it finished once the peer has it."""
        self.buffer.finish(response_id, self._clock())
        if not self.buffer.holds(response_id):
            self._report_finished(response_id)

    def clear(self, response_id: str | None = None) -> None:
        """Drop queued audio now (barge-in): the next frame out is silence."""
        self.buffer.clear(response_id)

    # --- the media side --------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        index = await self.pacer.next_frame()
        pulled = self.buffer.pull(self.frame_samples, self._clock())
        frame = av.AudioFrame.from_ndarray(pulled.samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = index * self.frame_samples
        frame.time_base = self._time_base
        self.frames_sent += 1
        if pulled.audible:
            self.audible_frames += 1
        self._report(pulled.played_ms, pulled.drained)
        self.pacer.sent()
        return frame

    def stats(self) -> dict[str, float]:
        """Counters and pacing (ms) of this track, for logs and benchmarks: `late_*` is the
        wake-up against the 20 ms grid, `sent_*` the frame handed to the encoder against it."""
        out: dict[str, float] = {
            "frames": self.frames_sent,
            "audible_frames": self.audible_frames,
            "underrun_frames": self.underrun_frames,
            "preroll_frames": self.buffer.preroll_frames,
            "dropped_ms": round(self.buffer.dropped_samples * 1000.0 / self.rate, 1),
            "resyncs": self.pacer.resyncs,
        }
        for name, window in (("late", self.pacer.lateness), ("sent", self.pacer.send_lateness)):
            values = np.abs(np.asarray(window, dtype=np.float64)) * 1000.0
            for key, q in (("p50", 50), ("p99", 99)):
                out[f"{name}_{key}_ms"] = round(float(np.percentile(values, q)), 2) if len(values) else 0.0
            out[f"{name}_max_ms"] = round(float(values.max()), 2) if len(values) else 0.0
        # Hand-on interval − 20 ms between consecutive frames (the due times are 20 ms apart).
        gaps = np.abs(np.diff(np.asarray(self.pacer.send_lateness, dtype=np.float64))) * 1000.0
        out["gap_p99_ms"] = round(float(np.percentile(gaps, 99)), 2) if len(gaps) else 0.0
        return out

    def _report(self, played: dict[str, float], drained: list[str]) -> None:
        observer = self.observer
        if observer is None:
            return
        try:
            for rid, ms in played.items():
                observer.playout(rid, ms)
        except Exception:  # a failing observer must not stop the media
            log.exception("playout report failed")
        for rid in drained:
            # Reported on every drain: the session ignores it while the response still runs
            # (an underrun), and `finish` reports again once the response is complete.
            self._report_finished(rid)

    def _report_finished(self, response_id: str) -> None:
        if self.observer is None:
            return
        try:
            self.observer.playout_finished(response_id)
        except Exception:
            log.exception("playout report failed")
