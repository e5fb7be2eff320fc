"""`semantic_vad`: when a pause ends the user's turn, decided with an end-of-turn model.

Sans-I/O, on the session's 16 kHz input timeline (the same clock as server VAD: samples of
scored audio, so a test drives it with frame positions alone). Server VAD ends a turn after a
fixed silence. Here the VAD's silence is only a *candidate* pause: once it has lasted
`candidate_ms` the turn so far is scored by the end-of-turn model (`ScoreTurn`; the pipeline's
end-of-turn stage answers with a probability). A turn the model calls finished
(p >= `threshold`) ends at once, on that answer; an unfinished one waits, and ends after the
eagerness's maximum pause anyway (OpenAI's: low 8 s, medium 4 s, high 2 s; auto = medium),
which the core's `SpeechDetector` counts as its silence duration (`max_pause_ms`). Speech
resuming during the wait makes the pause stale: its score is ignored, the next pause is scored
afresh. One score per pause; an answer that never comes (the stage failed) leaves the maximum.

Without an end-of-turn model in the pipeline, `semantic_vad` stays what it was before: server
VAD with an eagerness-based silence (`TurnDetection.effective_silence_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from session.realtime.input_audio import SAMPLES_PER_MS

# OpenAI's maximum pause per eagerness (docs: "low" waits up to 8 s, "medium" 4 s, "high" 2 s).
MAX_PAUSE_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}
CANDIDATE_MS = 200  # silence before the model is asked (pipecat's Smart Turn default: 200 ms)
FINISHED = 0.5  # P(finished) from which the turn ends at once (the model's own cut)


def max_pause_ms(eagerness: str) -> int:
    return MAX_PAUSE_MS.get(eagerness, MAX_PAUSE_MS["auto"])


@dataclass(frozen=True, slots=True)
class ScoreTurn:
    """Ask the end-of-turn model about the speech in [start, end) (timeline samples)."""

    ref: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class EndTurn:
    """The model called the turn finished: end it at the pause that began at `pause`."""

    item_id: str
    pause: int
    probability: float


class SemanticTurn:
    """One session's end-of-turn decisions (see the module docstring)."""

    def __init__(self, *, candidate_ms: int = CANDIDATE_MS, threshold: float = FINISHED) -> None:
        self.candidate_ms = candidate_ms
        self.threshold = threshold
        self._asked: tuple[str, int] | None = None  # (item id, pause start) being scored
        self._ref: str | None = None
        self.scores: list[float] = []  # the answers, in order (the last few)

    def on_frame(
        self, item_id: str | None, speech_start: int, pause: int | None, frame_end: int
    ) -> ScoreTurn | None:
        """A scored frame ending at `frame_end` while the user item `item_id` is spoken;
        `pause`: where the current silence began (None: they are speaking). Asks once per
        pause, when it has lasted `candidate_ms`."""
        if item_id is None or pause is None or frame_end - pause < self.candidate_ms * SAMPLES_PER_MS:
            return None
        key = (item_id, pause)
        if self._asked == key:
            return None
        self._asked = key
        self._ref = f"{item_id}@{pause}"
        return ScoreTurn(self._ref, speech_start, frame_end)

    def on_score(
        self, ref: str, probability: float, item_id: str | None, pause: int | None
    ) -> EndTurn | None:
        """The model's answer for `ref`; the turn ends now if it is the current pause's (still
        silent, same item) and finished."""
        if ref != self._ref or self._asked is None:
            return None  # an older pause's, or after a reset
        self.scores = [*self.scores[-15:], probability]
        asked_item, asked_pause = self._asked
        if item_id != asked_item or pause != asked_pause:
            return None  # the user went on speaking (or the turn already ended)
        if probability < self.threshold:
            return None  # unfinished: the maximum pause ends it, unless they go on
        self.reset()
        return EndTurn(asked_item, asked_pause, probability)

    def reset(self) -> None:
        self._asked = None
        self._ref = None
