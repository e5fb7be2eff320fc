"""semantic_vad's words cue on virtual time: a sentence the end-of-turn model left open is asked
about once more by its words (`ScoreWords`), and a language model's "the message ends here"
(given by hand, as the stage's `TurnScore` would bring it) ends the turn at the pause."""

from __future__ import annotations

import math
from typing import Any

import pytest

from session.realtime.effects import DropTranscript, LiveControl, NeedTranscript, PrepareTranscript
from session.realtime.input_audio import SAMPLES_PER_MS
from session.realtime.semantic_turn import EndTurn, ScoreTurn, SemanticTurn, WordsAwaited
from session.realtime.words_turn import WORDS_BARS, ScoreWords, WordsCue
from tests.session.realtime_harness import Harness, silence, tone, types

pytestmark = pytest.mark.unit

MS = SAMPLES_PER_MS
ENDS = math.exp(WORDS_BARS["auto"] + 1)  # the language model: the message ends here
GOES_ON = math.exp(WORDS_BARS["auto"] - 1)


def _asked(turn: SemanticTurn, at_ms: int, item: str = "item_1") -> ScoreTurn:
    ask = turn.on_frame(item, 0, at_ms * MS, (at_ms + 32) * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    return ask


def test_closed_words_the_model_left_open_are_scored_and_may_end_the_turn() -> None:
    turn = SemanticTurn(words=WordsCue())
    ask = _asked(turn, 1000)
    # Below every bar of the audio model: the words are still awaited (they may end it now).
    assert turn.on_score(ask.ref, 0.02, "item_1", 1000 * MS, 1032 * MS) == WordsAwaited(("item_1", 1000 * MS))
    words = turn.on_transcript(("item_1", 1000 * MS), "Moved to Thursday.", "item_1", 1000 * MS, 1300 * MS)
    assert isinstance(words, ScoreWords) and words.text == "Moved to Thursday."
    end = turn.on_score(words.ref, ENDS, "item_1", 1000 * MS, 1300 * MS)
    assert end == EndTurn("item_1", 1000 * MS, 0.02)
    # Words the language model reads as going on leave the maximum pause to end it.
    ask = _asked(turn, 3000)
    turn.on_score(ask.ref, 0.02, "item_1", 3000 * MS, 3032 * MS)
    words = turn.on_transcript(("item_1", 3000 * MS), "I want a flight.", "item_1", 3000 * MS, 3200 * MS)
    assert isinstance(words, ScoreWords)
    assert turn.on_score(words.ref, GOES_ON, "item_1", 3000 * MS, 3250 * MS) is None


def test_open_words_stale_answers_and_no_cue_ask_nothing_more() -> None:
    turn = SemanticTurn(words=WordsCue())
    ask = _asked(turn, 1000)
    turn.on_score(ask.ref, 0.02, "item_1", 1000 * MS, 1032 * MS)
    # Mid-clause words: vetoed as ever, nothing to score.
    assert turn.on_transcript(("item_1", 1000 * MS), "A flight to", "item_1", 1000 * MS, 1300 * MS) is None
    # The user speaks again before the words' answer: it is stale.
    ask = _asked(turn, 2000)
    turn.on_score(ask.ref, 0.02, "item_1", 2000 * MS, 2032 * MS)
    words = turn.on_transcript(("item_1", 2000 * MS), "Done.", "item_1", 2000 * MS, 2200 * MS)
    assert isinstance(words, ScoreWords)
    assert turn.on_score(words.ref, ENDS, "item_1", None, 2250 * MS) is None
    assert turn.on_score(words.ref, ENDS, "item_1", 2000 * MS, 2300 * MS) is None  # answered once
    # Without the cue (no words model in the pipeline) closed words under the bar do nothing.
    plain = SemanticTurn()
    ask = _asked(plain, 1000)
    plain.on_score(ask.ref, 0.02, "item_1", 1000 * MS, 1032 * MS)
    assert plain.on_transcript(("item_1", 1000 * MS), "Done.", "item_1", 1000 * MS, 1300 * MS) is None


def test_a_words_answer_sooner_than_the_shortest_pause_ends_on_the_frame_that_gets_there() -> None:
    turn = SemanticTurn(words=WordsCue(), ask_ms=32, min_pause_ms=96)
    ask = _asked(turn, 1000)
    words = turn.on_transcript(("item_1", 1000 * MS), "Done.", "item_1", 1000 * MS, 1032 * MS)
    assert words is None  # the words came first: kept for the score
    words = turn.on_score(ask.ref, 0.1, "item_1", 1000 * MS, 1040 * MS)
    assert isinstance(words, ScoreWords)
    assert turn.on_score(words.ref, ENDS, "item_1", 1000 * MS, 1060 * MS) is None  # 60 ms: too short
    assert turn.on_frame("item_1", 0, 1000 * MS, 1096 * MS) == EndTurn("item_1", 1000 * MS, 0.1)


def test_eagerness_sets_the_words_bar() -> None:
    cue = WordsCue()
    for eagerness, bar in WORDS_BARS.items():
        cue.configure(eagerness)
        assert cue.finished(math.exp(bar + 0.01)) and not cue.finished(math.exp(bar - 0.01)), eagerness
    assert WORDS_BARS["low"] > WORDS_BARS["auto"] == WORDS_BARS["medium"] > WORDS_BARS["high"]
    assert not cue.finished(0.0)


def _semantic(**options: Any) -> Harness:
    h = Harness(scores_turn_ends=True, pipeline_transcribes_input=True, **options)
    h.update(audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "auto"}}})
    return h


def _controls(h: Harness, kind: str) -> list[LiveControl]:
    return [e for e in h.effects if isinstance(e, LiveControl) and e.kind == kind]


def _left_open(h: Harness) -> PrepareTranscript:
    """A second of speech, a pause, and Smart Turn's "unfinished" (0.03) for it: the pause's
    words ask (`PrepareTranscript`)."""
    h.append(tone(1.0))
    h.append(silence(0.4))
    (prepare,) = [e for e in h.effects if isinstance(e, PrepareTranscript)]
    (ask,) = _controls(h, "score_turn")
    h.take(h.core.on_turn_score(ask.params["ref"], 0.03, h.now))
    return prepare


def test_core_ends_a_sentence_the_model_left_open_when_its_words_end_the_message() -> None:
    h = _semantic(scores_turn_words=True)
    prepare = _left_open(h)
    # The words may still end it: they are made first, not given up.
    assert [e for e in h.effects if isinstance(e, NeedTranscript)] == [NeedTranscript(prepare.key)]
    assert not [e for e in h.effects if isinstance(e, DropTranscript)]
    h.take(h.core.on_turn_transcript(prepare.key, "It was moved to Thursday afternoon.", h.now))
    (words,) = _controls(h, "score_words")
    assert words.params["text"] == "It was moved to Thursday afternoon."
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
    out = h.take(h.core.on_turn_score(words.params["ref"], ENDS, h.now))
    kinds = types(out)
    assert kinds[0] == "input_audio_buffer.speech_stopped" and "response.created" in kinds
    assert abs(out.events[0]["audio_end_ms"] - 1000) <= 64  # at the pause, not 4 s later


def test_core_without_a_words_model_asks_no_words() -> None:
    h = _semantic()
    prepare = _left_open(h)
    assert [e for e in h.effects if isinstance(e, DropTranscript)] == [DropTranscript(prepare.key)]
    h.take(h.core.on_turn_transcript(prepare.key, "It was moved to Thursday afternoon.", h.now))
    assert not _controls(h, "score_words")
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
