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

EARLY_OK_S = 0.0003  # a frame released this much before its deadline counts as on time
MIN_RESLEEP_S = 0.001  # the shortest second sleep after an early wake-up (uvloop's resolution)


class FramePacer:
    """Releases frame n at `start + n * frame_s` on a monotonic clock.

    The schedule is anchored at the first frame: every wait targets an absolute deadline on
    the grid, so the time spent producing frames (or a late wake-up) never accumulates as
    drift. A consumer that falls more than `max_lag_frames` behind (the event loop stalled)
    is re-anchored at the current time instead of being sent a burst of catch-up frames; the
    frame index (and so the RTP timestamp) stays contiguous.

    Two measures, both against the grid: `lateness` (wake-up time − due time) and, when the
    caller reports it with `sent()`, `send_lateness` (the frame handed on − due time), whose
    difference is the per-frame work the caller does before returning the frame.
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
        # Release (resp. hand-on) time minus due time of recent frames, seconds: bounded
        # windows for reports. A stall that forces a re-anchor is recorded at its true size.
        self.lateness: deque[float] = deque(maxlen=history)
        self.send_lateness: deque[float] = deque(maxlen=history)

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
        # uvloop's timers count whole milliseconds from a cached loop time and fire up to
        # ~1.2 ms early; a wake-up short of the deadline by more than EARLY_OK_S sleeps again,
        # at least a millisecond (a shorter uvloop timer fires at once: the loop would spin).
        delay = due - self._clock()
        if delay > 0:
            await self._sleep(delay)
            while (delay := due - self._clock()) > EARLY_OK_S:
                await self._sleep(max(delay, MIN_RESLEEP_S))
        now = self._clock()
        late = now - due
        self.lateness.append(late)
        if late > self._max_lag_s:
            self._start = now - self._index * self.frame_s
            self.resyncs += 1
        return self._index

    def sent(self) -> None:
        """The frame released last has been handed on: record when, against its due time."""
        if self._start is not None:
            self.send_lateness.append(self._clock() - self.due(self._index))


@dataclass(slots=True)
class _Segment:
    """Queued audio of one response: int16 samples ready to go out, and (a lazy segment)
    float32 source still to resample, a block at a time as the frames reach it."""

    response_id: str
    samples: np.ndarray  # int16 at the buffer rate, ready
    offset: int = 0
    source: np.ndarray | None = None  # float32 at the resampler's input rate, not yet resampled
    source_offset: int = 0
    resampler: StreamingResampler | None = None
    estimate: int = 0  # output samples the unconverted source is counted as (buffered, lead)
    flush: bool = False  # the response's last audio: append the resampler's tail at the end

    @property
    def remaining(self) -> int:
        """Ready samples not yet pulled."""
        return len(self.samples) - self.offset

    @property
    def lazy(self) -> bool:
        return self.source is not None and self.source_offset < len(self.source)


@dataclass(slots=True)
class _Response:
    """Playout state of one response whose audio is (or was) queued."""

    queued: int = 0  # samples still queued (estimated for source not yet resampled)
    segments: int = 0  # its segments in the queue
    source_in: int = 0  # input samples its current resampler was given
    counted_before: int = 0  # output samples counted (played + queued) before that resampler
    played: int = 0  # samples handed out so far
    finished: bool = False  # all its audio is queued
    playing: bool = False  # the pre-roll gate is open
    since: float | None = None  # when audio came while the gate was shut (the pre-roll's start)
    dry_frames: int = 0  # short frames since it ran dry: an underrun if more of it plays


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

    Pre-roll: a response starts (and, after running dry, restarts) only once its audio has
    waited `preroll_s`, or `lead_s` of it is queued, or it is finished. Frame k of a response
    goes out at (start + k frames) but needs audio up to (k + 1) frames: starting on the first
    tick after the first chunk, a producer that keeps exactly to real time (its chunk at
    offset S arrives S after the first) misses that tick whenever a chunk boundary falls inside
    a frame. Waiting one frame closes the gap for every producer that is not behind real time;
    a first chunk of `lead_s` or more starts at once (it covers producers at least
    1 / (1 − frame / lead_s) times real time: 1.11× for 20 ms frames and 200 ms).

    Underruns: a short frame (silence inside it) while a response that has started playing
    has more to come is counted once more of that response plays; silence after its last
    queued sample is not, if the response then turns out to be complete (`finish` or `clear`).
    """

    def __init__(
        self,
        rate: int = 48_000,
        *,
        max_buffered_s: float = 120.0,
        preroll_s: float = 0.0,
        lead_s: float = 0.2,
    ) -> None:
        if preroll_s < 0 or lead_s < 0:
            raise ValueError(f"pre-roll and lead must not be negative, got {preroll_s}, {lead_s}")
        self.rate = rate
        self.max_samples = int(max_buffered_s * rate)
        self.preroll_s = preroll_s
        self.lead_samples = int(lead_s * rate)
        self._segments: deque[_Segment] = deque()
        self._buffered = 0
        self._resamplers: dict[str, StreamingResampler] = {}
        # Recent responses, oldest first; a handful at most (older ones are forgotten).
        self._responses: OrderedDict[str, _Response] = OrderedDict()
        self.dropped_samples = 0
        self.underrun_frames = 0
        self.preroll_frames = 0  # silent frames while a response waited to start

    @property
    def buffered_samples(self) -> int:
        return self._buffered

    @property
    def buffered_ms(self) -> float:
        return self._buffered * 1000.0 / self.rate

    def holds(self, response_id: str) -> bool:
        state = self._responses.get(response_id)
        return state is not None and state.segments > 0

    def played_ms(self, response_id: str) -> float:
        state = self._responses.get(response_id)
        return 0.0 if state is None else state.played * 1000.0 / self.rate

    def push(self, response_id: str, samples: np.ndarray, rate: int, now: float = 0.0) -> None:
        """Queue float32 mono `samples` at `rate` for `response_id`. `now` is the pacing
        clock's time: the pre-roll counts from it (pass it whenever `preroll_s` > 0)."""
        resampler = self._resamplers.get(response_id)
        state = self._state(response_id)
        if resampler is None or resampler.src_rate != rate:
            resampler = StreamingResampler(rate, self.rate)
            self._resamplers[response_id] = resampler
            while len(self._resamplers) > 4:  # responses that never finished (cancelled)
                self._resamplers.pop(next(iter(self._resamplers)))
            state.source_in, state.counted_before = 0, state.played + state.queued
        samples = np.asarray(samples, dtype=np.float32)
        state.source_in += len(samples)
        # Resample (and convert) only the start now: a 3 s clause at once held the event loop
        # for 3-6 ms, a late frame; the rest follows a block per frame, as `pull` reaches it.
        eager = 0 if self._lazy_tail(response_id) is not None else self._eager_samples(rate)
        if eager:
            self._append(response_id, resampler.process(samples[:eager]), now)
        if len(samples) > eager:
            self._append_lazy(response_id, samples[eager:], resampler, now)

    def finish(self, response_id: str, now: float = 0.0) -> None:
        """No more audio for `response_id`: queue the resampler's tail; it may start at once."""
        resampler = self._resamplers.pop(response_id, None)
        tail = self._lazy_tail(response_id)
        state = self._responses.get(response_id)
        if tail is not None and tail.resampler is not None:
            tail.flush = True  # resampled later: the tail goes out after it
            if state is not None and tail.resampler is resampler:
                # Count the whole stream's output now (what the filter holds included).
                total = state.counted_before + round(state.source_in * self.rate / resampler.src_rate)
                missing = total - state.played - state.queued
                tail.estimate += missing
                state.queued += missing
                self._buffered += missing
        elif resampler is not None:
            self._append(response_id, resampler.flush(), now)
        state = self._responses.get(response_id)
        if state is not None:
            state.finished = True  # short frames before this count only if more of it plays

    def clear(self, response_id: str | None = None) -> int:
        """Drop queued audio of `response_id` (all audio when None); return samples dropped."""
        kept: deque[_Segment] = deque()
        dropped = 0
        for seg in self._segments:
            if response_id is None or seg.response_id == response_id:
                dropped += seg.remaining + seg.estimate
            else:
                kept.append(seg)
        self._segments = kept
        self._buffered -= dropped
        for rid, state in self._responses.items():
            if response_id is None or rid == response_id:
                state.queued = 0
                state.segments = 0
                state.finished = True  # cut short: nothing more of it plays
                state.dry_frames = 0
        if response_id is None:
            self._resamplers.clear()
        else:
            self._resamplers.pop(response_id, None)
        return dropped

    def pull(self, n: int, now: float = 0.0) -> PulledFrame:
        """The next `n` samples (silence where nothing is queued or pre-roll holds it back)."""
        out = np.zeros(n, dtype=np.int16)
        frame = PulledFrame(out)
        filled = 0
        held = False
        while filled < n and self._segments:
            seg = self._segments[0]
            rid = seg.response_id
            state = self._state(rid)
            if not state.playing:
                if not self._ready(state, now):
                    held = True
                    break
                state.playing = True
            if seg.remaining == 0:
                if seg.lazy:
                    self._convert_block(seg, state)
                else:
                    self._pop_head(seg, state, frame)
                continue
            if state.dry_frames:
                self.underrun_frames += state.dry_frames  # more of it came after a gap
                state.dry_frames = 0
            take = min(n - filled, seg.remaining)
            out[filled : filled + take] = seg.samples[seg.offset : seg.offset + take]
            seg.offset += take
            filled += take
            self._buffered -= take
            state.queued -= take
            state.played += take
            frame.played_ms[rid] = state.played * 1000.0 / self.rate
            if seg.remaining == 0 and not seg.lazy:
                self._pop_head(seg, state, frame)
        frame.filled = filled
        if filled < n:
            self._count_short_frame(held)
        return frame

    def _pop_head(self, seg: _Segment, state: _Response, frame: PulledFrame) -> None:
        self._segments.popleft()
        state.segments -= 1
        if seg.estimate:  # resampling came out shorter than counted
            self._buffered -= seg.estimate
            state.queued -= seg.estimate
            seg.estimate = 0
        if state.segments == 0:
            self._buffered -= state.queued  # 0 unless an estimate was off
            state.queued = 0
            frame.drained.append(seg.response_id)

    def _convert_block(self, seg: _Segment, state: _Response) -> None:
        """Resample the next block of a lazy segment's source into its ready samples."""
        assert seg.source is not None and seg.resampler is not None
        resampler = seg.resampler
        block = self._eager_samples(resampler.src_rate)
        start = seg.source_offset
        seg.source_offset = min(start + block, len(seg.source))
        out = resampler.process(seg.source[start : seg.source_offset])
        left = len(seg.source) - seg.source_offset
        if not left:
            seg.source = None
            if seg.flush:
                out = np.concatenate([out, resampler.flush()])
        estimate = round(left * self.rate / resampler.src_rate)
        delta = len(out) + estimate - seg.estimate
        self._buffered += delta
        state.queued += delta
        seg.samples, seg.offset, seg.estimate = float32_to_int16(out), 0, estimate

    def _eager_samples(self, rate: int) -> int:
        """How much source (at `rate`) is resampled at a time: two frames' worth."""
        return max(1, rate // 25)

    def _lazy_tail(self, response_id: str) -> _Segment | None:
        """The response's segment whose source is still to resample, if any (always its last)."""
        for seg in reversed(self._segments):
            if seg.response_id == response_id:
                return seg if seg.lazy else None
        return None

    def _ready(self, state: _Response, now: float) -> bool:
        if state.finished or state.queued >= self.lead_samples:
            return True
        return state.since is not None and now - state.since >= self.preroll_s - 1e-9

    def _count_short_frame(self, held: bool) -> None:
        waiting = False
        for state in self._responses.values():
            if state.finished or state.played == 0:
                waiting = waiting or (held and state.segments > 0 and state.played == 0)
                continue
            state.dry_frames += 1  # started, more to come, and this frame was short of it
            if state.segments == 0:
                state.playing = False  # it ran dry: its next audio waits a pre-roll again
                state.since = None
        if waiting:
            self.preroll_frames += 1

    def _state(self, response_id: str) -> _Response:
        state = self._responses.get(response_id)
        if state is None:
            state = self._responses[response_id] = _Response()
            if len(self._responses) > 8:  # forget the oldest response with nothing queued
                stale = next((rid for rid, s in self._responses.items() if s.segments == 0), None)
                if stale is not None and stale != response_id:
                    del self._responses[stale]
        return state

    def _append(self, response_id: str, samples: np.ndarray, now: float) -> None:
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
        self._queue(_Segment(response_id, pcm), len(pcm), now)

    def _append_lazy(
        self, response_id: str, source: np.ndarray, resampler: StreamingResampler, now: float
    ) -> None:
        estimate = round(len(source) * self.rate / resampler.src_rate)
        room = self.max_samples - self._buffered
        if estimate > room:
            self.dropped_samples += estimate - max(room, 0)
            log.warning("playout buffer full (%.0f s): dropping model audio", self.max_samples / self.rate)
            source = source[: max(room, 0) * resampler.src_rate // self.rate]
            estimate = round(len(source) * self.rate / resampler.src_rate)
            if not len(source):
                return
        empty = np.zeros(0, dtype=np.int16)
        seg = _Segment(response_id, empty, source=source, resampler=resampler, estimate=estimate)
        self._queue(seg, estimate, now)

    def _queue(self, seg: _Segment, samples: int, now: float) -> None:
        self._segments.append(seg)
        self._buffered += samples
        state = self._state(seg.response_id)
        state.queued += samples
        state.segments += 1
        if not state.playing and state.since is None:
            state.since = now
