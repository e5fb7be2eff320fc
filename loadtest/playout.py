"""A simulated client playout buffer: when would a listener have heard a gap?

Sans-I/O: fed arrival times (client monotonic seconds) and durations of output audio chunks.
Playback starts ``prebuffer_ms`` after the first chunk arrives and then consumes audio in real
time. A chunk that arrives after everything received before it has been played is an
*underrun*: the listener hears a stall until it arrives, and playback resumes at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PlayoutBuffer:
    prebuffer_ms: float = 100.0
    started_at: float | None = None  # playback start (first arrival + prebuffer)
    runs_dry_at: float = 0.0  # when the audio received so far will have been played out
    underruns: int = 0
    stall_s: float = 0.0
    received_ms: float = 0.0
    underrun_at: list[float] = field(default_factory=list)  # arrival time of each late chunk

    def push(self, now: float, audio_ms: float) -> None:
        if self.started_at is None:
            self.started_at = now + self.prebuffer_ms / 1000.0
            self.runs_dry_at = self.started_at
        elif now > self.runs_dry_at:
            self.underruns += 1
            self.underrun_at.append(now)
            self.stall_s += now - self.runs_dry_at
            self.runs_dry_at = now
        self.runs_dry_at += audio_ms / 1000.0
        self.received_ms += audio_ms

    def played_ms(self, now: float) -> float:
        """Audio the listener has heard by ``now`` (what a client truncates to on barge-in)."""
        if self.started_at is None or now <= self.started_at:
            return 0.0
        unplayed = max(0.0, self.runs_dry_at - now) * 1000.0
        return max(0.0, self.received_ms - unplayed)

    def finished_at(self) -> float | None:
        """When playback of everything received ends (None before any audio)."""
        return None if self.started_at is None else self.runs_dry_at
