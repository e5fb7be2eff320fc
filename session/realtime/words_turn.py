"""`semantic_vad`'s words cue: a turn whose words end a sentence ends when a language model agrees.

Sans-I/O, beside :mod:`session.realtime.semantic_turn`. There, Smart Turn's score of the pause and
the words of the turn so far decide together, and an unfinished score keeps the turn open up to
the maximum pause (4 s at auto). But the model hears only the last second or so of intonation: on
a third of the evaluation set's finished sentences it says "unfinished" 30 ms into the pause
(P < 0.1 on "The meeting with the marketing team has been moved to Thursday afternoon."), words and
all, and those answers come 4 s late. So when Whisper's words end a sentence ("closed", see
`semantic_turn.transcript_cue`) and the score leaves the turn open, the words are scored too (`ScoreWords`:
the pipeline's end-of-turn stage answers with a chat model's probability that the user's
message ends after them, :mod:`engines.speech.words_turn`), and a log-probability from the
eagerness's bar (`WORDS_BARS`) ends the turn.

Why these bars (docs/benchmarks.md, issue 30 twelfth round; `python -m loadtest.score_turns
--lm`): finished sentences the auto rule leaves open score log P(end) -15.0 to -5.4 (p50 -7.7);
first halves that Whisper closed with a period ("I would like to book a flight.", "... turn off
the lights in the light.") -17.2 to -15.9; a sentence's own comma pause ("... in the kitchen, |
but") -28.3 to -7.4. Tuned on s00-s09 (the most finished sentences ended at once with <= 5 %
false cut-offs and no more ended early), auto's bar is -7.5: finished at once 19/30 -> 25/30 on
that half, 16/30 -> 19/30 on s10-s19 (held out), false cut-offs and early ends unchanged. Low
waits more (a bar one nat higher), high less (two nats lower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# log P(the user's message ends after these words) from which a sentence the audio model left
# open ends the turn, per eagerness.
WORDS_BARS = {"low": -6.5, "medium": -7.5, "high": -9.5, "auto": -7.5}


@dataclass(frozen=True, slots=True)
class ScoreWords:
    """Ask the end-of-turn stage how likely the user's message ends after `text` (its answer:
    a `TurnScore` for `ref` whose probability is that likelihood)."""

    ref: str
    text: str


class WordsCue:
    """What the language model's score of a pause's words decides, at the session's eagerness."""

    def __init__(self, bar: float = WORDS_BARS["auto"]) -> None:
        self.bar = bar

    def configure(self, eagerness: str) -> None:
        self.bar = WORDS_BARS.get(eagerness, WORDS_BARS["auto"])

    def finished(self, probability: float) -> bool:
        """The message ends after the words (`probability`: the language model's)."""
        return probability > 0.0 and math.log(probability) >= self.bar
