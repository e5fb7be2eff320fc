"""Server VAD turn detection on speech probabilities (one per 32 ms frame at 16 kHz).

Pure state machine: the driver runs silero off the event loop and the core feeds the
probabilities here. Hysteresis follows silero's `VADIterator`: speech starts on a frame
with p ≥ threshold; it ends after `silence_duration_ms` of frames with p < threshold - 0.15;
frames in between neither extend speech nor count as silence.
"""

from __future__ import annotations

from dataclasses import dataclass

from session.realtime.input_audio import FRAME, SAMPLES_PER_MS


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    start_sample: int  # first sample of the first speech frame


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    end_sample: int  # where the silence began (end of speech)
    commit_end: int  # end of the frame that completed the silence (buffer is committed to here)


class SpeechDetector:
    def __init__(self, threshold: float = 0.5, silence_ms: int = 500) -> None:
        self.threshold = threshold
        self.silence_ms = silence_ms
        self.speaking = False
        self._silence_start: int | None = None

    def configure(self, threshold: float, silence_ms: int) -> None:
        self.threshold = threshold
        self.silence_ms = silence_ms

    @property
    def silence_start(self) -> int | None:
        """While speaking: where the current run of silent frames began (None: no silence)."""
        return self._silence_start if self.speaking else None

    @property
    def negative_threshold(self) -> float:
        return max(self.threshold - 0.15, 0.01)

    def reset(self) -> None:
        self.speaking = False
        self._silence_start = None

    def feed(self, frame_start: int, probability: float) -> SpeechStarted | SpeechStopped | None:
        frame_end = frame_start + FRAME
        if not self.speaking:
            if probability >= self.threshold:
                self.speaking = True
                self._silence_start = None
                return SpeechStarted(frame_start)
            return None
        if probability >= self.threshold:
            self._silence_start = None
        elif probability < self.negative_threshold:
            if self._silence_start is None:
                self._silence_start = frame_start
            if frame_end - self._silence_start >= self.silence_ms * SAMPLES_PER_MS:
                end = self._silence_start
                self.reset()
                return SpeechStopped(end_sample=end, commit_end=frame_end)
        return None
