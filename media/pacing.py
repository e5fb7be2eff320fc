"""Real-time pacing of outbound audio: a frame clock and a bounded playout buffer.

No aiortc here: the outbound track (`media.tracks`) asks the `FramePacer` when its next frame
is due and pulls that frame's samples from the `PlayoutBuffer`. Both run on an injected
monotonic clock, so tests drive them on virtual time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from media.audio import StreamingResampler, float32_to_int16

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class FramePacer:
    """Releases frame n at `start + n * frame_s` on a monotonic clock.

    The schedule is anchored at the first frame and never drifts with the time spent
    producing frames. A consumer that falls more than `max_lag_frames` behind (the event loop
    stalled) is re-anchored at the current time instead of being sent a burst of catch-up
    frames; the frame index (and so the RTP timestamp) stays contiguous.
    """

    def __init__(
        self,
        frame_s: float = 0.020,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        max_lag_frames: int = 5,
        history: int = 3000,
    ) -> None:
        if frame_s <= 0:
            raise ValueError(f"frame duration must be positive, got {frame_s}")
        self.frame_s = frame_s
        self._clock = clock
        self._sleep = sleep
        self._max_lag_s = max_lag_frames * frame_s
        self._start: float | None = None
        self._index = -1
        self.resyncs = 0
        # Release time minus due time of recent frames, seconds (a bounded window for reports).
        self.lateness: deque[float] = deque(maxlen=history)

    @property
    def index(self) -> int:
        """The index of the frame released last (-1 before the first)."""
        return self._index

    def due(self, index: int) -> float:
        if self._start is None:
            raise RuntimeError("the pacer has not released a frame yet")
        return self._start + index * self.frame_s

    async def next_frame(self) -> int:
        """Wait until the next frame is due; return its index."""
        self._index += 1
        if self._start is None:
            self._start = self._clock()
            self.lateness.append(0.0)
            return self._index
        due = self.due(self._index)
        delay = due - self._clock()
        if delay > 0:
            await self._sleep(delay)
        late = self._clock() - due
        if late > self._max_lag_s:
            self._start = self._clock() - self._index * self.frame_s
            self.resyncs += 1
            late = 0.0
        self.lateness.append(late)
        return self._index


@dataclass(slots=True)
class _Segment:
    response_id: str
    samples: np.ndarray  # int16 at the buffer rate
    offset: int = 0

    @property
    def remaining(self) -> int:
        return len(self.samples) - self.offset


@dataclass(slots=True)
class PulledFrame:
    """One frame of output and what it did to the responses it carried."""

    samples: np.ndarray  # int16, exactly the requested length (silence-padded)
    played_ms: dict[str, float] = field(default_factory=dict)  # response → total played so far
    drained: list[str] = field(default_factory=list)  # responses with nothing left queued
    filled: int = 0  # samples of response audio in the frame (the rest is silence)

    @property
    def audible(self) -> bool:
        return self.filled > 0


class PlayoutBuffer:
    """Model audio queued for the outgoing track, per response, bounded in duration.

    `push` resamples each response's audio (one streaming resampler per response, so chunk
    boundaries leave no clicks) to the track rate and queues it as int16. `pull` takes one
    frame, padding with silence, and says how much of each response has been played.
    `clear` drops what is still queued (barge-in). Audio beyond `max_buffered_s` is dropped,
    newest first, and counted: the pipeline already stored it, the peer just never hears it.
    """

    def __init__(self, rate: int = 48_000, *, max_buffered_s: float = 120.0) -> None:
        self.rate = rate
        self.max_samples = int(max_buffered_s * rate)
        self._segments: deque[_Segment] = deque()
        self._buffered = 0
        self._resamplers: dict[str, StreamingResampler] = {}
        # Played samples of recent responses; a handful at most (older ones are forgotten).
        self._played: OrderedDict[str, int] = OrderedDict()
        self.dropped_samples = 0

    @property
    def buffered_samples(self) -> int:
        return self._buffered

    @property
    def buffered_ms(self) -> float:
        return self._buffered * 1000.0 / self.rate

    def holds(self, response_id: str) -> bool:
        return any(s.response_id == response_id for s in self._segments)

    def played_ms(self, response_id: str) -> float:
        return self._played.get(response_id, 0) * 1000.0 / self.rate

    def push(self, response_id: str, samples: np.ndarray, rate: int) -> None:
        """Queue float32 mono `samples` at `rate` for `response_id`."""
        resampler = self._resamplers.get(response_id)
        if resampler is None or resampler.src_rate != rate:
            resampler = StreamingResampler(rate, self.rate)
            self._resamplers[response_id] = resampler
            while len(self._resamplers) > 4:  # responses that never finished (cancelled)
                self._resamplers.pop(next(iter(self._resamplers)))
        self._append(response_id, resampler.process(samples))

    def finish(self, response_id: str) -> None:
        """No more audio for `response_id`: queue the resampler's tail."""
        resampler = self._resamplers.pop(response_id, None)
        if resampler is not None:
            self._append(response_id, resampler.flush())

    def clear(self, response_id: str | None = None) -> int:
        """Drop queued audio of `response_id` (all audio when None); return samples dropped."""
        kept: deque[_Segment] = deque()
        dropped = 0
        for seg in self._segments:
            if response_id is None or seg.response_id == response_id:
                dropped += seg.remaining
            else:
                kept.append(seg)
        self._segments = kept
        self._buffered -= dropped
        if response_id is None:
            self._resamplers.clear()
        else:
            self._resamplers.pop(response_id, None)
        return dropped

    def pull(self, n: int) -> PulledFrame:
        """The next `n` samples (silence where nothing is queued)."""
        out = np.zeros(n, dtype=np.int16)
        frame = PulledFrame(out)
        filled = 0
        while filled < n and self._segments:
            seg = self._segments[0]
            take = min(n - filled, seg.remaining)
            out[filled : filled + take] = seg.samples[seg.offset : seg.offset + take]
            seg.offset += take
            filled += take
            self._buffered -= take
            rid = seg.response_id
            self._played[rid] = self._played.get(rid, 0) + take
            self._played.move_to_end(rid)
            frame.played_ms[rid] = self._played[rid] * 1000.0 / self.rate
            if seg.remaining == 0:
                self._segments.popleft()
                if not self.holds(rid):
                    frame.drained.append(rid)
        while len(self._played) > 8:
            self._played.popitem(last=False)
        frame.filled = filled
        return frame

    def _append(self, response_id: str, samples: np.ndarray) -> None:
        if not len(samples):
            return
        room = self.max_samples - self._buffered
        if len(samples) > room:
            self.dropped_samples += len(samples) - max(room, 0)
            log.warning("playout buffer full (%.0f s): dropping model audio", self.max_samples / self.rate)
            samples = samples[: max(room, 0)]
            if not len(samples):
                return
        pcm = float32_to_int16(samples)
        self._segments.append(_Segment(response_id, pcm))
        self._buffered += len(pcm)
