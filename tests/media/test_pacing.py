"""The outbound pacing on virtual time: the frame schedule stays on the 20 ms grid whatever
the timers and the per-frame work do, and a producer that keeps ahead of real time never
causes an underrun frame (while one that falls behind does, and is counted)."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from media.audio import StreamingResampler, float32_to_int16
from media.pacing import EARLY_OK_S, MIN_RESLEEP_S, FramePacer, PlayoutBuffer
from media.tracks import OutboundAudioTrack

pytestmark = pytest.mark.unit

FRAME = 0.020
RATE = 48_000
N = RATE // 50  # samples per frame


class JitteryTime:
    """A virtual monotonic clock whose timers fire early (up to `early_s`, like uvloop's
    millisecond timers) or late (up to `late_s`, a busy loop), at random."""

    def __init__(self, seed: int, *, early_s: float = 0.0, late_s: float = 0.0) -> None:
        self.now = 50.0
        self.rng = random.Random(seed)
        self.early_s = early_s
        self.late_s = late_s
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        error = self.rng.uniform(-self.early_s, self.late_s)
        self.now += max(seconds + error, 0.0)


async def test_pacer_stays_on_the_grid_with_early_and_late_timers_and_work() -> None:
    vt = JitteryTime(1, early_s=0.0012, late_s=0.004)
    pacer = FramePacer(FRAME, clock=vt.clock, sleep=vt.sleep)
    start = vt.now
    for n in range(2000):
        assert await pacer.next_frame() == n
        offset = vt.now - (start + n * FRAME)
        # Never early by more than EARLY_OK_S (an early timer sleeps the rest), late by one
        # timer's error plus a second sleep's at most: lateness never accumulates (40 s).
        assert -EARLY_OK_S <= offset <= 0.004 + MIN_RESLEEP_S + 1e-9
        vt.now += vt.rng.uniform(0.0, 0.003)  # building and encoding a frame takes time
    assert pacer.resyncs == 0
    assert vt.sleeps <= 2 * 2000  # an early wake-up sleeps once more, not in a spin
    assert max(pacer.lateness) <= 0.005 + 1e-9 and min(pacer.lateness) >= -EARLY_OK_S


async def test_pacer_records_a_stall_at_its_size_and_reanchors() -> None:
    vt = JitteryTime(2)
    pacer = FramePacer(FRAME, clock=vt.clock, sleep=vt.sleep, max_lag_frames=5)
    for _ in range(3):
        await pacer.next_frame()
    vt.now += 0.5  # the loop stalled for 25 frames
    assert await pacer.next_frame() == 3
    assert pacer.resyncs == 1
    assert pacer.lateness[-1] == pytest.approx(0.48)  # 0.5 s after frame 2, due 20 ms after it
    before = vt.now
    await pacer.next_frame()
    assert vt.now - before == pytest.approx(FRAME)  # then on a new grid, no catch-up burst


async def test_track_reports_hand_on_time_against_the_grid() -> None:
    vt = JitteryTime(3)
    track = OutboundAudioTrack(clock=vt.clock, sleep=vt.sleep)
    for _ in range(10):
        await track.recv()
        vt.now += 0.002  # what aiortc does with the frame before it asks for the next one
    stats = track.stats()
    assert stats["late_max_ms"] == pytest.approx(0.0, abs=1e-6)
    assert stats["sent_max_ms"] == pytest.approx(0.0, abs=1e-6)  # recv() itself adds no delay
    assert stats["frames"] == 10


# --- producers against the track -------------------------------------------------------------


@dataclass(order=True)
class Chunk:
    at: float
    samples: np.ndarray = field(compare=False)


class Simulation:
    """The track's recv loop and a producer on one virtual clock: whenever the pacer sleeps,
    the chunks that arrive before it wakes are pushed at their arrival times."""

    def __init__(self, track_kwargs: dict[str, float] | None = None) -> None:
        self.now = 10.0
        self.pending: list[Chunk] = []
        self.track = OutboundAudioTrack(clock=self.clock, sleep=self.sleep, **(track_kwargs or {}))
        self.finish_at: float | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.advance(self.now + seconds)

    def advance(self, until: float) -> None:
        while self.pending and self.pending[0].at <= until:
            chunk = heapq.heappop(self.pending)
            self.now = max(self.now, chunk.at)
            self.track.play("r1", chunk.samples, RATE)
        if self.finish_at is not None and not self.pending and self.finish_at <= until:
            self.now = max(self.now, self.finish_at)
            self.track.finish("r1")
            self.finish_at = None
        self.now = max(self.now, until)

    async def run(self, chunks: list[Chunk], finish_at: float) -> list[np.ndarray]:
        for chunk in chunks:
            heapq.heappush(self.pending, chunk)
        self.finish_at = finish_at
        frames = []
        while self.pending or self.finish_at is not None or self.track.buffer.buffered_samples:
            frame = await self.track.recv()
            frames.append(frame.to_ndarray().reshape(-1))
        return frames


def producer(rng: random.Random, speed: float, *, start: float, max_chunk_ms: int) -> list[Chunk]:
    """About 3 s of speech-like noise in chunks of random length (any sample count), chunk k
    arriving at start + (its offset in the audio) / speed: `speed` ≥ 1 keeps ahead of real time."""
    chunks, offset = [], 0
    while offset < 3 * RATE:
        length = rng.randint(RATE // 1000, max_chunk_ms * RATE // 1000)
        samples = rng.uniform(0.05, 0.5) * np.sign(np.sin(np.arange(length) * 0.05 + 0.3)) + 0.001
        chunks.append(Chunk(start + offset / RATE / speed, samples.astype(np.float32)))
        offset += length
    return chunks


SPEEDS = [(1.0, 150), (1.0, 60), (1.1, 1000), (1.5, 800), (4.0, 1500), (30.0, 400)]


@pytest.mark.parametrize(("speed", "max_chunk_ms"), SPEEDS)
@pytest.mark.parametrize("seed", range(12))
async def test_a_producer_ahead_of_real_time_never_underruns(
    speed: float, max_chunk_ms: int, seed: int
) -> None:
    rng = random.Random(seed * 100 + int(speed * 10))
    sim = Simulation()
    for _ in range(rng.randint(1, 30)):  # idle silence first: the first chunk lands anywhere in a tick
        await sim.track.recv()
    start = sim.now + rng.uniform(0.0, FRAME)
    chunks = producer(rng, speed, start=start, max_chunk_ms=max_chunk_ms)
    frames = await sim.run(chunks, finish_at=chunks[-1].at + rng.uniform(0.0, 0.3))
    out = np.concatenate(frames)
    expected = float32_to_int16(np.concatenate([c.samples for c in chunks]))
    audible = np.flatnonzero(out)
    # Every sample, in order and contiguous: no silence inside the response, nothing lost.
    assert audible[-1] - audible[0] + 1 == len(expected)
    np.testing.assert_array_equal(out[audible[0] : audible[-1] + 1], expected)
    assert sim.track.underrun_frames == 0
    # What it costs: the first audio leaves within two frames of its arrival.
    first_frame = audible[0] // N
    assert first_frame * FRAME <= (start - 10.0) + 2 * FRAME + 1e-9


async def test_a_producer_behind_real_time_underruns_and_is_counted() -> None:
    sim = Simulation()
    await sim.track.recv()
    chunk = np.full(RATE // 10, 0.25, dtype=np.float32)  # 100 ms chunks every 160 ms
    chunks = [Chunk(sim.now + 0.005 + k * 0.16, chunk) for k in range(5)]
    frames = await sim.run(chunks, finish_at=chunks[-1].at + 0.01)
    silent_inside = [k for k, f in enumerate(frames) if not np.all(f)]
    audible = [k for k, f in enumerate(frames) if np.any(f)]
    gaps = [k for k in silent_inside if audible[0] < k < audible[-1]]
    # Each 60 ms gap is 2-3 frames (pre-roll again before the next chunk, unless it is the
    # last: `finish` starts it at once); every one of them is counted.
    assert len(gaps) == 11
    assert sim.track.underrun_frames == len(gaps)


async def test_preroll_waits_one_frame_for_a_small_first_chunk_and_none_for_a_lead() -> None:
    for seconds, waited in ((0.05, 1), (0.25, 0)):
        sim = Simulation()
        await sim.track.recv()
        sim.now += 0.005  # the chunk lands 5 ms after a tick: the next one is 15 ms away
        sim.track.play("r1", np.full(int(seconds * RATE), 0.25, np.float32), RATE)
        frames = [(await sim.track.recv()).to_ndarray() for _ in range(3)]
        assert [bool(np.any(f)) for f in frames] == [waited == 0, True, True]
        assert sim.track.stats()["preroll_frames"] == waited


async def test_finish_starts_a_short_response_at_once() -> None:
    sim = Simulation()
    await sim.track.recv()
    sim.track.play("r1", np.full(RATE // 100, 0.25, np.float32), RATE)  # 10 ms, all of it
    sim.track.finish("r1")
    assert np.any((await sim.track.recv()).to_ndarray())


def test_buffer_rejects_a_negative_preroll() -> None:
    with pytest.raises(ValueError, match="pre-roll"):
        PlayoutBuffer(RATE, preroll_s=-0.01)


# --- resampling a block at a time ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_lazy_resampling_equals_resampling_it_all_at_once(seed: int) -> None:
    """Pushes resample only their start; the rest is resampled a block per pulled frame. What
    comes out is what resampling the whole stream at once gives, and the counts add up."""
    rng = random.Random(seed)
    rate = rng.choice([16_000, 22_050, 24_000])
    chunks = [rng.randint(1, 3 * rate) for _ in range(rng.randint(1, 6))]
    audio = np.sin(np.arange(sum(chunks)) * 0.01).astype(np.float32) * 0.5
    buf = PlayoutBuffer(RATE)
    offset = 0
    out = []
    for length in chunks:
        buf.push("r1", audio[offset : offset + length], rate)
        offset += length
        ahead = buf.buffered_samples // N - 3  # pull only what is surely there: no gaps
        out += [buf.pull(N).samples for _ in range(min(rng.randint(0, 30), ahead))]
    buf.finish("r1")
    expected_ms = len(audio) * 1000 / rate
    assert buf.played_ms("r1") + buf.buffered_ms == pytest.approx(expected_ms, abs=0.1)
    while buf.holds("r1"):
        out.append(buf.pull(N).samples)
    assert buf.buffered_samples == 0
    reference = StreamingResampler(rate, RATE)
    expected = float32_to_int16(np.concatenate([reference.process(audio), reference.flush()]))
    got = np.concatenate(out)
    got = got[: np.flatnonzero(got)[-1] + 1] if np.any(got) else got
    assert abs(len(got) - len(expected)) <= 1
    n = min(len(got), len(expected))
    assert np.max(np.abs(got[:n].astype(np.int32) - expected[:n])) <= 1


def test_a_long_chunk_is_resampled_a_block_per_frame() -> None:
    buf = PlayoutBuffer(RATE)
    buf.push("r1", np.full(3 * 22_050, 0.25, np.float32), 22_050)  # a 3 s clause
    # Counted in full at once (up to what the filter holds until `finish`) ...
    assert buf.buffered_ms == pytest.approx(3000, abs=50)
    # ... but resampled a block (two frames of source) at a time, not all 3 s at once (that
    # held the event loop 3-6 ms): never more than a few frames are ready.
    for _ in range(100):
        assert sum(seg.remaining for seg in buf._segments) <= 4 * N
        assert buf.pull(N).filled == N
    buf.finish("r1")
    assert buf.played_ms("r1") + buf.buffered_ms == pytest.approx(3000, abs=0.1)
