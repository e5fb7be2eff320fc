"""The input audio buffer on one continuous 16 kHz timeline, and the VAD frame queue.

Every input sample (base64 appends in any wire format, or samples from a media track) is
resampled once, in a streaming resampler, to 16 kHz and placed on a session-wide timeline,
stored as PCM16 (half the memory of float32: a full-duplex client streams audio all the time,
so an uncommitted buffer can hold seconds of it in every session; readers get float32 back).
`audio_start_ms` / `audio_end_ms` in events are positions on the timeline. The buffer is the
uncommitted stretch [start, end) of that timeline. VAD frames (512 samples, 32 ms) are
cut from it and handed to the driver for scoring.

Appends are resampled in batches, not one call per 40 ms append (the per-call cost of the
resampler dominated at 25 appends/s per session): wire samples wait as int16 until a VAD
frame's worth is there (server VAD), or up to 1 s (no VAD), or until anything reads the
buffer (`end`, `slice`, commit, clear...). The streaming resampler gives the same samples
whatever the batching, so only the cost changes, never the audio or a position.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from media.audio import VAD_RATE, StreamingResampler, WireFormat, float32_to_int16_exact, int16_to_float32
from session.realtime.effects import DetectSpeech

FRAME = 512  # samples per VAD frame at 16 kHz (32 ms), silero's window
SAMPLES_PER_MS = VAD_RATE // 1000


def ms_of(sample: int) -> int:
    return sample // SAMPLES_PER_MS


class InputAudio:
    def __init__(self, fmt: WireFormat) -> None:
        self.format = fmt
        self._resampler = StreamingResampler(fmt.rate, VAD_RATE)
        self._track_resampler: StreamingResampler | None = None
        self._chunks: deque[np.ndarray] = deque()  # int16 16 kHz
        self._raw: list[np.ndarray] = []  # wire-rate int16 appends not resampled yet
        self._raw_samples = 0
        self.start = 0  # timeline sample of the first buffered sample
        self._end = 0  # timeline sample after the last resampled sample
        self.vad_enabled = False
        self._vad_cursor = 0  # next frame to hand out starts here
        self._vad_reset = True
        self._pending: deque[int] = deque()  # frame starts awaiting probabilities

    # --- writing -------------------------------------------------------------------------

    def set_format(self, fmt: WireFormat) -> None:
        if fmt == self.format:
            return
        self._settle()
        self._push(self._resampler.flush())
        self.format = fmt
        self._resampler = StreamingResampler(fmt.rate, VAD_RATE)

    def append_wire(self, data: bytes) -> np.ndarray:
        """Decode wire bytes (raises `AudioFormatError`) and append them (resampled later,
        in a batch: see the module docstring). Returns the decoded int16 samples."""
        pcm = self.format.decode_int16(data)
        if not len(pcm):
            return pcm
        self._raw.append(pcm)
        self._raw_samples += len(pcm)
        rate = self.format.rate
        if self._raw_samples >= rate or (self.vad_enabled and self._raw_samples * VAD_RATE >= FRAME * rate):
            self._settle()
        return pcm

    def _settle(self) -> None:
        """Resample the appends still waiting as int16 onto the timeline."""
        if not self._raw:
            return
        pcm = self._raw[0] if len(self._raw) == 1 else np.concatenate(self._raw)
        self._raw.clear()
        self._raw_samples = 0
        self._push(self._resampler.process(int16_to_float32(pcm)))

    def append_samples(self, samples: np.ndarray, rate: int) -> None:
        """Append float32 mono samples from a media track (any rate)."""
        self._settle()
        if self._track_resampler is None or self._track_resampler.src_rate != rate:
            if self._track_resampler is not None:
                self._push(self._track_resampler.flush())
            self._track_resampler = StreamingResampler(rate, VAD_RATE)
        self._push(self._track_resampler.process(samples))

    def flush(self) -> None:
        """Drain the resamplers (before a manual commit, so the last few ms are included)."""
        self._settle()
        self._push(self._resampler.flush())
        if self._track_resampler is not None:
            self._push(self._track_resampler.flush())

    def _push(self, samples: np.ndarray) -> None:
        if len(samples):
            self._chunks.append(float32_to_int16_exact(samples))
            self._end += len(samples)

    # --- reading -------------------------------------------------------------------------

    @property
    def end(self) -> int:
        """Timeline sample after the last buffered sample (resamples pending appends)."""
        self._settle()
        return self._end

    @property
    def buffered_ms(self) -> float:
        """Uncommitted audio, pending appends included, without resampling them (the input
        budget's check runs per append: it must not break the batching)."""
        pending = self._raw_samples * 1000 / self.format.rate
        return (self._end - self.start) / SAMPLES_PER_MS + pending

    @property
    def duration_ms(self) -> int:
        return ms_of(self.end - self.start)

    def slice(self, a: int, b: int) -> np.ndarray:
        """Timeline samples [a, b) that are still buffered, as float32."""
        a, b = max(a, self.start), min(b, self.end)
        end = self._end
        if b <= a:
            return np.zeros(0, dtype=np.float32)
        out: list[np.ndarray] = []
        if b - self.start <= end - a:
            pos = self.start
            for chunk in self._chunks:
                lo, hi = pos, pos + len(chunk)
                if hi > a and lo < b:
                    out.append(chunk[max(a - lo, 0) : min(b - lo, len(chunk))])
                pos = hi
                if pos >= b:
                    break
        else:
            # VAD frames are cut from the newest audio while a turn may hold seconds of it:
            # walk from the end so the cost does not grow with the buffered turn.
            pos = end
            for chunk in reversed(self._chunks):
                lo, hi = pos - len(chunk), pos
                if hi > a and lo < b:
                    out.append(chunk[max(a - lo, 0) : min(b - lo, len(chunk))])
                pos = lo
                if pos <= a:
                    break
            out.reverse()
        if not out:
            return np.zeros(0, dtype=np.float32)
        return int16_to_float32(out[0] if len(out) == 1 else np.concatenate(out))

    def take(self, a: int, b: int) -> np.ndarray:
        """Remove and return [a, b) as committed audio: the buffer then starts at `b`."""
        audio = self.slice(a, b)
        self.drop_before(b)
        return audio

    def drop_before(self, sample: int) -> None:
        """Forget buffered audio before `sample` (never audio that VAD still has to see)."""
        end = self.end
        if self.vad_enabled:
            sample = min(sample, self._vad_cursor)
        while self._chunks and self.start + len(self._chunks[0]) <= sample:
            self.start += len(self._chunks.popleft())
        if self._chunks and self.start < sample:
            self._chunks[0] = self._chunks[0][sample - self.start :]
            self.start = sample
        self.start = max(self.start, min(sample, end))

    def clear(self) -> None:
        """Empty the buffer; frames awaiting scores are forgotten (late scores are ignored)."""
        self._settle()
        self._chunks.clear()
        self.start = self._end
        self._vad_cursor = self._end
        self._pending.clear()
        self._vad_reset = True

    # --- VAD frames ----------------------------------------------------------------------

    def set_vad(self, enabled: bool) -> None:
        if enabled == self.vad_enabled:
            return
        self._settle()
        self.vad_enabled = enabled
        self._vad_cursor = self._end if enabled else 0
        self._pending.clear()
        self._vad_reset = True

    @property
    def first_unscored(self) -> int:
        """Timeline sample of the oldest frame without a probability yet."""
        return self._pending[0] if self._pending else self._vad_cursor

    def next_frames(self) -> DetectSpeech | None:
        """The whole frames not yet handed out for scoring, or None. Appends still waiting
        to be resampled (less than a frame's worth) wait for the next call."""
        if not self.vad_enabled:
            return None
        n = (self._end - self._vad_cursor) // FRAME
        if n <= 0:
            return None
        start = self._vad_cursor
        samples = self.slice(start, start + n * FRAME)
        self._pending.extend(range(start, start + n * FRAME, FRAME))
        self._vad_cursor += n * FRAME
        reset, self._vad_reset = self._vad_reset, False
        return DetectSpeech(start_sample=start, samples=samples, reset=reset)

    def claim_scored(self, count: int, start_sample: int | None) -> list[int]:
        """Match `count` probabilities to pending frames; return their start samples.

        With `start_sample`, probabilities for frames no longer pending (stale after a clear
        or a VAD reconfiguration) are skipped."""
        if start_sample is not None:
            while self._pending and self._pending[0] < start_sample:
                self._pending.popleft()
            if not self._pending or self._pending[0] != start_sample:
                return []
        n = min(count, len(self._pending))
        return [self._pending.popleft() for _ in range(n)]
