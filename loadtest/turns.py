"""What one client turn measured, and the per-turn metrics derived from it (pure data).

Times are client monotonic seconds. A turn starts when the client starts speaking and ends
with the server's ``response.done`` (or a timeout). *End of speech* is when the last speech
sample of the utterance left the client (audio is streamed in real time, so that is when a
real microphone would have captured it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadtest.playout import PlayoutBuffer


@dataclass(slots=True)
class TurnRecord:
    session: int
    turn: int
    spoke_at: float  # speech onset sent
    speech_ms: float  # utterance length
    speech_end: float | None = None  # last speech sample sent (or commit, client turns)
    response_id: str | None = None
    created_at: float | None = None
    first_audio_at: float | None = None
    last_audio_at: float | None = None
    done_at: float | None = None
    status: str | None = None  # completed | cancelled | failed | incomplete | timeout | no_response
    audio_ms: float = 0.0
    deltas: int = 0
    max_gap_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # intervals between output deltas
    barge_in_at: float | None = None  # the client interrupted (speech onset or response.cancel)
    barge_in_done_at: float | None = None  # response.done after the interruption
    errors: dict[str, int] = field(default_factory=dict)
    # WebRTC: digitally silent 20 ms frames between audible frames of the reply (the server's
    # track ran dry and sent silence: its pipeline or its pacer fell behind real time).
    silent_frames: int = 0
    playout: PlayoutBuffer = field(default_factory=PlayoutBuffer)

    def on_audio(self, now: float, audio_ms: float) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = now
        elif self.last_audio_at is not None:
            gap = now - self.last_audio_at
            self.gaps_s.append(gap)
            self.max_gap_s = max(self.max_gap_s, gap)
        self.last_audio_at = now
        self.audio_ms += audio_ms
        self.deltas += 1
        if self.barge_in_at is None:
            self.playout.push(now, audio_ms)

    # --- derived -------------------------------------------------------------------------

    @property
    def ttfa_ms(self) -> float | None:
        """End of speech → first output audio."""
        return _span_ms(self.speech_end, self.first_audio_at)

    @property
    def stream_ms(self) -> float | None:
        """First → last output audio."""
        return _span_ms(self.first_audio_at, self.last_audio_at)

    @property
    def rtf(self) -> float | None:
        """Real-time factor: (end of speech → last audio) / audio duration (< 1: faster)."""
        if self.last_audio_at is None or self.speech_end is None or self.audio_ms <= 0:
            return None
        return (self.last_audio_at - self.speech_end) * 1000.0 / self.audio_ms

    @property
    def barge_in_stop_ms(self) -> float | None:
        """Interruption → the server's ``response.done`` for the interrupted response."""
        return _span_ms(self.barge_in_at, self.barge_in_done_at)

    @property
    def underruns(self) -> int:
        return self.playout.underruns

    def to_json(self) -> dict[str, Any]:
        def r(value: float | None, digits: int = 1) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "session": self.session,
            "turn": self.turn,
            "status": self.status,
            "response_id": self.response_id,
            "speech_ms": r(self.speech_ms),
            "ttfa_ms": r(self.ttfa_ms),
            "stream_ms": r(self.stream_ms),
            "rtf": r(self.rtf, 3),
            "audio_ms": r(self.audio_ms),
            "deltas": self.deltas,
            "max_delta_gap_ms": r(self.max_gap_s * 1000.0),
            "underruns": self.underruns,
            "silent_frames": self.silent_frames,
            "stall_ms": r(self.playout.stall_s * 1000.0),
            # client monotonic seconds (CLOCK_MONOTONIC: the same clock as other processes on
            # the host), to line stalls up with server or host timelines
            "underrun_at": [round(t, 3) for t in self.playout.underrun_at],
            "barge_in": self.barge_in_at is not None,
            "barge_in_stop_ms": r(self.barge_in_stop_ms),
            "errors": dict(self.errors),
        }


def _span_ms(start: float | None, end: float | None) -> float | None:
    """Milliseconds from ``start`` to ``end`` (None unless both happened)."""
    return None if start is None or end is None else (end - start) * 1000.0
