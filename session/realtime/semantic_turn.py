"""`semantic_vad`: when a pause ends the user's turn, decided with an end-of-turn model.

Sans-I/O, on the session's 16 kHz input timeline (the same clock as server VAD: samples of
scored audio, so a test drives it with frame positions alone). Server VAD ends a turn after a
fixed silence. Here the VAD's silence is only a *candidate* pause: once it has lasted `ask_ms`
(the first silent VAD frame) the turn so far is scored by the end-of-turn model (`ScoreTurn`,
the speech up to `tail_ms` into the pause; the pipeline's end-of-turn stage answers with a
probability) and, where the pipeline transcribes, the words of the turn so far are transcribed
(the core's `PrepareTranscript`, asked at the same frame). The turn ends on both cues
(`TurnCues`): words ending mid-clause never end it; words ending a sentence end it from a bar
one rung lower (`CLOSED_THRESHOLDS`); without such words the model decides alone
(`THRESHOLDS`). Where the stage also scores words (`words`, :mod:`session.realtime.words_turn`),
a sentence the model left open is asked about once more (`ScoreWords`), and a language model's
"the message ends here" ends it. A score that comes before its pause's words waits for them. It never
ends on a silence shorter than `min_pause_ms` (per eagerness; a decision that comes sooner is held for the
frame that gets there). An unfinished turn waits, and ends after the eagerness's maximum pause
anyway (OpenAI's: low 8 s, medium 4 s, high 2 s; auto = medium), which the core's
`SpeechDetector` counts as its silence duration (`max_pause_ms`). Speech resuming during the
wait makes the pause stale: its score is ignored, the next pause is scored afresh. One score
per pause; an answer that never comes (the stage failed) leaves the maximum.

Why these numbers (docs/benchmarks.md, "End of turn"): Smart Turn separates finished sentences
from mid-clause first halves best on the speech *just* after the VAD's silence onset (with 32 ms
of it 34/60 finished >= 0.7 against 14/60 first halves; with 200 ms 42/60 against 26/60; with
800 ms the halves score as high as the sentences, so re-scoring a longer silence does not
help, and a second look at 150-300 ms raised the held-out cut-offs). Whisper ends every
finished sentence with sentence-final punctuation, so words that end a sentence lower the
model's bar one rung (auto: 0.7 -> 0.5); but Whisper tiny also completes a first half that stops
on a preposition with a pronoun of its own ("a message to them."), which the model may call
finished too: those words read as mid-clause (`transcript_cue`).

Without an end-of-turn model in the pipeline, `semantic_vad` stays what it was before: server
VAD with an eagerness-based silence (`TurnDetection.effective_silence_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from session.realtime.input_audio import SAMPLES_PER_MS
from session.realtime.words_turn import ScoreWords, WordsCue

# OpenAI's maximum pause per eagerness (docs: "low" waits up to 8 s, "medium" 4 s, "high" 2 s).
MAX_PAUSE_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}
# P(finished) from which a turn ends at once, per eagerness, when the words of the turn do not
# end a sentence (no transcript, or none with sentence-final punctuation): the model decides
# alone, on a ladder around its own cut (0.5), fewer cut-offs the lower the eagerness.
THRESHOLDS = {"low": 0.9, "medium": 0.7, "high": 0.5, "auto": 0.7}
# ... and when they do (Whisper's sentence-final punctuation, not a guessed last word): one rung
# lower. Medium / auto tuned on sentences s00-s09 of the evaluation set (`loadtest.score_turns`:
# the most finished sentences ended at once, and not at a comma, with <= 5 % false cut-offs,
# every pause of the speech counted; s10-s19 held out): the model's own cut.
CLOSED_THRESHOLDS = {"low": 0.7, "medium": 0.5, "high": 0.3, "auto": 0.5}
FINISHED = 0.5  # the model's own cut
ASK_MS = 32  # silence before the model is asked: the first silent VAD frame (the transcript too)
TAIL_MS = 32  # of that silence, what the model hears after the VAD's silence onset
# The shortest silence a turn ends on, per eagerness. A speaker's pause at a comma or between
# the items of a list ("We need to buy eggs, | milk and ...") is a few hundred milliseconds and
# sounds finished to the model (Smart Turn 0.86-0.97; Whisper writes a period there): on a host
# whose decision comes ~130 ms into the pause, ending turns from 96 ms answered 2-4 of the
# evaluation set's 30 finished sentences twice, ended at their comma (its comma pauses are
# 128-288 ms). From 256 ms none (docs/benchmarks.md, issue 30 fourteenth round), for 25-88 ms of
# p50 on that host and nothing where a decision takes longer than that anyway (pipecat asks Smart
# Turn after 200 ms of VAD silence). "high" keeps the earliest end: as soon as it can.
MIN_PAUSE_MS = {"low": 256, "medium": 256, "high": 96, "auto": 256}

# Words a clause cannot end on: articles/determiners, conjunctions, prepositions, auxiliaries
# and modals, "to" (a transcript ending on one is mid-clause, whatever the model says).
_OPEN = """
    a an the this that these those my your his her its our their some any every each no
    and or but nor so because if when while although though unless until since whether than
    to of in on at for from with by about into onto over under after before between through
    during without within like as per via
    is are was were be been being am do does did have has had can could will would shall
    should may might must i you he she we they it's i'm i'd i'll you're we're they're
    what which who whose where how very more most
"""
OPEN_WORDS = frozenset(_OPEN.split())
SENTENCE_END = (".", "?", "!")
# A preposition then an object pronoun at the very end ("a message to them."): how Whisper tiny
# completes a first half that stops on a preposition (its decoder is a language model: "a
# flight to me.", "the meeting with him.", "a story about it."), so the words may not be the
# speaker's. Read as mid-clause.
_PREP = """
    to of in on at for from with by about into onto over under after before between through
    during without within like as per via
"""
_PREPOSITIONS = frozenset(_PREP.split())
_OBJECT_PRONOUNS = frozenset(("me", "you", "him", "her", "it", "us", "them"))


def transcript_cue(text: str | None) -> str:
    """What the words of the turn so far say about its end: "open" (it ends on a word a clause
    cannot end on: see `OPEN_WORDS`; or on a preposition and an object pronoun, which may be
    the ASR's own completion of a dangling preposition), "closed" (sentence-final punctuation,
    as Whisper writes a finished sentence), "plain" (neither), "unknown" (no transcript)."""
    if text is None or not text.strip():
        return "unknown"
    stripped = text.strip().rstrip("\"')\u201d")
    words = [
        w.strip(".,;:!?-\u2014") for w in stripped.lower().replace("...", " ").replace("\u2026", " ").split()
    ]
    last = words[-1] if words else ""
    if not last or last in OPEN_WORDS or stripped.endswith(("...", "\u2026", ",", "-", "\u2014")):
        return "open"
    if len(words) >= 2 and last in _OBJECT_PRONOUNS and words[-2] in _PREPOSITIONS:
        return "open"
    return "closed" if stripped.endswith(SENTENCE_END) else "plain"


def max_pause_ms(eagerness: str) -> int:
    return MAX_PAUSE_MS.get(eagerness, MAX_PAUSE_MS["auto"])


def min_pause_for(eagerness: str) -> int:
    return MIN_PAUSE_MS.get(eagerness, MIN_PAUSE_MS["auto"])


def threshold_for(eagerness: str) -> float:
    return THRESHOLDS.get(eagerness, THRESHOLDS["auto"])


def closed_threshold_for(eagerness: str) -> float:
    return CLOSED_THRESHOLDS.get(eagerness, CLOSED_THRESHOLDS["auto"])


@dataclass(frozen=True, slots=True)
class TurnCues:
    """Whether a pause ends the turn, from the model's probability and the transcript of the
    turn so far. Words ending mid-clause ("open") never end it; words ending a sentence
    ("closed") end it from p >= `closed_threshold`, one rung below `threshold`, from which the
    model decides otherwise (no transcript, or words without a sentence end)."""

    threshold: float = FINISHED
    closed_threshold: float = FINISHED

    @staticmethod
    def for_eagerness(eagerness: str) -> TurnCues:
        return TurnCues(threshold_for(eagerness), closed_threshold_for(eagerness))

    def may_finish(self, probability: float) -> bool:
        """Whether some words could end the turn at `probability` (below both bars none can:
        the pause's transcript cannot change the decision)."""
        return probability >= min(self.threshold, self.closed_threshold)

    def finished(self, probability: float, transcript: str | None) -> bool:
        cue = transcript_cue(transcript)
        if cue == "open":
            return False
        bar = self.closed_threshold if cue == "closed" else self.threshold
        return probability >= bar


@dataclass(frozen=True, slots=True)
class ScoreTurn:
    """Ask the end-of-turn model about the speech in [start, end) (timeline samples)."""

    ref: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class WordsUnneeded:
    """The model's score leaves the pause `key` (item id, pause start) open whatever its words
    say (`TurnCues.may_finish`): the transcript still on its way need not be made for it."""

    key: tuple[str, int]


@dataclass(frozen=True, slots=True)
class WordsAwaited:
    """The model's score of the pause `key` ends the turn if its words allow it: the decision
    waits for the transcript on its way (the sooner it comes, the sooner the turn ends)."""

    key: tuple[str, int]


@dataclass(frozen=True, slots=True)
class EndTurn:
    """The model called the turn finished: end it at the pause that began at `pause`."""

    item_id: str
    pause: int
    probability: float


class SemanticTurn:
    """One session's end-of-turn decisions (see the module docstring). With `transcript_coming`
    at the ask (the pause is being transcribed ahead, `PrepareTranscript`), a score that comes
    before the words waits for them (they may veto it)."""

    def __init__(
        self,
        *,
        words: WordsCue | None = None,
        ask_ms: int = ASK_MS,
        tail_ms: int = TAIL_MS,
        min_pause_ms: int = MIN_PAUSE_MS["auto"],
        threshold: float = THRESHOLDS["auto"],
        closed_threshold: float = CLOSED_THRESHOLDS["auto"],
    ) -> None:
        self.ask_ms = ask_ms
        self.tail_ms = min(tail_ms, ask_ms)
        self.min_pause_ms = min_pause_ms
        self.cues = TurnCues(threshold, closed_threshold)
        self.words = words  # the words cue (session.realtime.words_turn), where the stage has one
        self._words_ref: str | None = None  # the asked pause's words being scored
        self._words_p = 0.0  # ... and the audio model's score of that pause
        self._asked: tuple[str, int] | None = None  # (item id, pause start) being scored
        self._ref: str | None = None
        self._coming = False  # the asked pause's transcript is on its way
        self._text: tuple[tuple[str, int], str | None] | None = None  # the last pause's words
        self._held: float | None = None  # the asked pause's score, waiting for its transcript
        self._due: EndTurn | None = None  # decided finished, waiting for `min_pause_ms`
        self.scores: list[float] = []  # the answers, in order (the last few)

    @property
    def threshold(self) -> float:
        return self.cues.threshold

    def configure(self, eagerness: str) -> None:
        """The session's eagerness (at the start and after each `session.update`): how sure
        the cues must be, and the shortest silence a turn ends on."""
        self.cues = TurnCues.for_eagerness(eagerness)
        self.min_pause_ms = min_pause_for(eagerness)
        if self.words is not None:
            self.words.configure(eagerness)

    def on_frame(
        self,
        item_id: str | None,
        speech_start: int,
        pause: int | None,
        frame_end: int,
        *,
        transcript_coming: bool = False,
    ) -> ScoreTurn | EndTurn | None:
        """A scored frame ending at `frame_end` while the user item `item_id` is spoken;
        `pause`: where the current silence began (None: they are speaking). Asks once per
        pause, when it has lasted `ask_ms`; ends a turn decided finished once the silence has
        lasted `min_pause_ms`."""
        if item_id is None or pause is None:
            return None
        key = (item_id, pause)
        due = self._due
        if due is not None and (due.item_id, due.pause) == key:
            return self._end() if frame_end - pause >= self.min_pause_ms * SAMPLES_PER_MS else None
        if frame_end - pause < self.ask_ms * SAMPLES_PER_MS or self._asked == key:
            return None
        self._asked = key
        self._ref = f"{item_id}@{pause}"
        self._coming = transcript_coming
        self._held = None
        self._due = None
        self._words_ref = None
        end = min(frame_end, pause + self.tail_ms * SAMPLES_PER_MS)
        return ScoreTurn(self._ref, speech_start, end)

    def on_score(
        self, ref: str, probability: float, item_id: str | None, pause: int | None, at: int
    ) -> EndTurn | ScoreWords | WordsUnneeded | WordsAwaited | None:
        """The model's answer for `ref` (`at`: the end of the audio scored by the VAD so far);
        the turn ends now if it is the current pause's (still silent, same item), finished by
        the cues (its transcript's, once it is there) and the silence long enough. A score no
        words could make finished while they are on their way: `WordsUnneeded` (the decision
        is made without them); any other then: `WordsAwaited` (it waits for them)."""
        if ref == self._words_ref and self._asked is not None:
            return self._decide_words(probability, item_id, pause, at)
        if ref != self._ref or self._asked is None:
            return None  # an older pause's, or after a reset
        self.scores = [*self.scores[-15:], probability]
        if (item_id, pause) != self._asked:
            return None  # the user went on speaking (or the turn already ended)
        text = self._words(self._asked)
        if text is _PENDING:
            if not self.cues.may_finish(probability) and self.words is None:
                self._coming = False  # unfinished: the maximum pause ends it, unless they go on
                return WordsUnneeded(self._asked)
            self._held = probability  # decided when the transcript comes
            return WordsAwaited(self._asked)
        return self._decide(probability, text if isinstance(text, str) else None, at)

    def on_transcript(
        self, key: tuple[str, int], text: str | None, item_id: str | None, pause: int | None, at: int
    ) -> EndTurn | ScoreWords | None:
        """The words of the turn up to the pause `key` (None: not transcribed); a score held
        for them is decided now if that pause is still the current one."""
        self._text = (key, text)
        if self._held is None or key != self._asked:
            return None
        probability, self._held = self._held, None
        if (item_id, pause) != key:
            return None
        return self._decide(probability, text, at)

    def _words(self, key: tuple[str, int]) -> object:
        if self._text is not None and self._text[0] == key:
            return self._text[1]
        return _PENDING if self._coming else None

    def _decide(self, probability: float, text: str | None, at: int) -> EndTurn | ScoreWords | None:
        if not self.cues.finished(probability, text):
            if self.words is not None and text is not None and transcript_cue(text) == "closed":
                # A sentence the audio model left open: its words are scored (words_turn).
                self._words_ref, self._words_p = f"{self._ref}/words", probability
                return ScoreWords(self._words_ref, text)
            return None  # unfinished: the maximum pause ends it, unless they go on
        return self._finish(probability, at)

    def _decide_words(
        self, probability: float, item_id: str | None, pause: int | None, at: int
    ) -> EndTurn | None:
        """The language model's answer for the asked pause's words."""
        self._words_ref = None
        if (item_id, pause) != self._asked or self.words is None or not self.words.finished(probability):
            return None  # they went on, or the words do not end the message either
        return self._finish(self._words_p, at)

    def _finish(self, probability: float, at: int) -> EndTurn | None:
        assert self._asked is not None
        item_id, pause = self._asked
        self._due = EndTurn(item_id, pause, probability)
        if at - pause < self.min_pause_ms * SAMPLES_PER_MS:
            return None  # the frame that makes the silence long enough ends it (`on_frame`)
        return self._end()

    def _end(self) -> EndTurn:
        due = self._due
        assert due is not None
        self.reset()
        return due

    def reset(self) -> None:
        self._asked = None
        self._ref = None
        self._words_ref = None
        self._held = None
        self._coming = False
        self._due = None


_PENDING = object()  # a transcript on its way
