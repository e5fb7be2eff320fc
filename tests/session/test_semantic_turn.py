"""semantic_vad's end-of-turn decisions on virtual time: the decision object alone, and the
core that uses it (a synthetic VAD; the model's answers are given by hand, as the live
request's `TurnScore` would bring them)."""

from __future__ import annotations

from typing import Any

import pytest

from session.realtime.effects import DropTranscript, LiveControl, NeedTranscript, PrepareTranscript
from session.realtime.input_audio import SAMPLES_PER_MS
from session.realtime.semantic_turn import (
    CLOSED_THRESHOLDS,
    MAX_PAUSE_MS,
    MIN_PAUSE_MS,
    THRESHOLDS,
    EndTurn,
    ScoreTurn,
    SemanticTurn,
    TurnCues,
    WordsAwaited,
    WordsUnneeded,
    transcript_cue,
)
from tests.session.realtime_harness import Harness, silence, tone, types

pytestmark = pytest.mark.unit

MS = SAMPLES_PER_MS


def test_asks_once_per_pause_after_the_candidate_window() -> None:
    turn = SemanticTurn(ask_ms=64, tail_ms=32)
    assert turn.on_frame("item_1", 0, None, 3200 * MS) is None  # speaking
    assert turn.on_frame("item_1", 0, 3000 * MS, 3060 * MS) is None  # a 60 ms pause: not yet
    ask = turn.on_frame("item_1", 0, 3000 * MS, 3064 * MS)
    # The model hears the speech and the first 32 ms of the pause (it tells finished turns
    # from first halves best on the speech just after the silence onset).
    assert ask == ScoreTurn("item_1@48000", 0, 3032 * MS)
    assert turn.on_frame("item_1", 0, 3000 * MS, 3400 * MS) is None  # once per pause
    again = turn.on_frame("item_1", 0, 4000 * MS, 4100 * MS)  # a later pause is asked afresh
    assert isinstance(again, ScoreTurn) and again.ref != ask.ref
    assert turn.on_frame(None, 0, 4000 * MS, 4300 * MS) is None  # no item being spoken


def test_a_finished_score_of_the_current_pause_ends_the_turn() -> None:
    turn = SemanticTurn(threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1064 * MS)
    assert isinstance(ask, ScoreTurn)
    end = turn.on_score(ask.ref, 0.93, "item_1", 1000 * MS, 1300 * MS)
    assert end == EndTurn("item_1", 1000 * MS, 0.93)
    assert turn.on_score(ask.ref, 0.93, "item_1", 1000 * MS, 1300 * MS) is None  # answered once


def test_a_score_sooner_than_the_shortest_pause_ends_the_turn_on_the_frame_that_gets_there() -> None:
    turn = SemanticTurn(ask_ms=64, min_pause_ms=96, threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1064 * MS)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.9, "item_1", 1000 * MS, 1064 * MS) is None  # 64 ms: too short
    assert turn.on_frame("item_1", 0, 1000 * MS, 1090 * MS) is None
    assert turn.on_frame("item_1", 0, 1000 * MS, 1096 * MS) == EndTurn("item_1", 1000 * MS, 0.9)
    # Speech resuming before that makes the decision stale.
    ask = turn.on_frame("item_1", 0, 2000 * MS, 2064 * MS)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.9, "item_1", 2000 * MS, 2064 * MS) is None
    assert turn.on_frame("item_1", 0, None, 2096 * MS) is None  # speaking again
    later = turn.on_frame("item_1", 0, 2200 * MS, 2300 * MS)  # the next pause: asked afresh
    assert isinstance(later, ScoreTurn)


def test_unfinished_stale_and_unknown_scores_leave_the_turn_open() -> None:
    turn = SemanticTurn(threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1300 * MS)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.2, "item_1", 1000 * MS, 1300 * MS) is None  # unfinished: wait
    ask = turn.on_frame("item_1", 0, 2000 * MS, 2200 * MS)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.9, "item_1", None, 2200 * MS) is None  # they spoke again
    assert turn.on_score("item_9@1", 0.9, "item_1", 2000 * MS, 2200 * MS) is None  # not asked
    assert turn.scores == [0.2, 0.9]


def test_eagerness_sets_the_threshold() -> None:
    turn = SemanticTurn()
    for eagerness, threshold in (("low", 0.9), ("medium", 0.7), ("auto", 0.7), ("high", 0.5)):
        turn.configure(eagerness)
        assert turn.threshold == THRESHOLDS[eagerness] == threshold
        ask = turn.on_frame("item_1", 0, 1000 * MS, 1064 * MS)
        assert isinstance(ask, ScoreTurn)
        below = turn.on_score(ask.ref, threshold - 0.01, "item_1", 1000 * MS, 1300 * MS)
        assert below is None, eagerness
        turn.reset()
        ask = turn.on_frame("item_1", 0, 1000 * MS, 1064 * MS)
        assert isinstance(ask, ScoreTurn)
        assert turn.on_score(ask.ref, threshold, "item_1", 1000 * MS, 1300 * MS) is not None, eagerness


def _semantic(eagerness: str = "auto", **options: Any) -> Harness:
    options.setdefault("pipeline_transcribes_input", False)  # no transcript: the model decides
    h = Harness(scores_turn_ends=True, **options)
    h.update(audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": eagerness}}})
    return h


def _asks(h: Harness) -> list[LiveControl]:
    return [e for e in h.effects if isinstance(e, LiveControl) and e.kind == "score_turn"]


def test_core_ends_a_finished_turn_on_the_score_not_on_silence() -> None:
    h = _semantic()
    h.append(silence(0.2))
    h.append(tone(1.0))
    h.append(silence(0.4))  # past the 32 ms candidate window: asked, not ended
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
    (ask,) = _asks(h)
    assert ask.params["start"] == 0 and ask.params["end"] > ask.params["start"]
    out = h.take(h.core.on_turn_score(ask.params["ref"], 0.9, h.now))
    kinds = types(out)
    assert kinds[:3] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
    ]
    assert "response.created" in kinds
    stopped = out.events[0]
    assert abs(stopped["audio_end_ms"] - 1200) <= 64  # where the pause began


def test_core_asks_early_and_ends_no_sooner_than_the_eagerness_shortest_pause() -> None:
    assert (MIN_PAUSE_MS["auto"], MIN_PAUSE_MS["high"]) == (256, 96)
    for eagerness in ("auto", "high"):
        h = _semantic(eagerness)
        h.append(tone(1.0))
        while not _asks(h):  # 20 ms appends until the VAD has scored a silent frame
            h.append(silence(0.02))
        (ask,) = _asks(h)
        pause = int(ask.params["ref"].split("@")[1])
        # Asked at the first silent frame: the speech and the first 32 ms of the pause.
        assert ask.params["end"] == pause + 32 * MS
        assert h.core.user.input.first_unscored - pause == 32 * MS  # nothing more scored yet
        h.take(h.core.on_turn_score(ask.params["ref"], 0.9, h.now))  # finished, but only 32 ms
        while h.core.user.input.first_unscored - pause < MIN_PAUSE_MS[eagerness] * MS:
            assert "input_audio_buffer.speech_stopped" not in types(h.events), eagerness
            h.append(silence(0.02))
        # The frame that makes the silence the eagerness's shortest pause ends the turn.
        kinds = types(h.events)
        assert kinds.count("input_audio_buffer.speech_stopped") == 1, eagerness
        assert "response.created" in kinds


def test_core_a_comma_pause_the_model_calls_finished_does_not_end_an_auto_turn() -> None:
    # "We need to buy eggs, | milk and ...": the model says finished 32 ms into a 224 ms pause;
    # auto holds that for 256 ms of silence and the speech goes on first; high ends at 96 ms.
    for eagerness, ends in (("auto", False), ("high", True)):
        h = _semantic(eagerness)
        h.append(tone(1.0))
        while not _asks(h):
            h.append(silence(0.02))
        (ask,) = _asks(h)
        h.take(h.core.on_turn_score(ask.params["ref"], 0.95, h.now))
        h.append(silence(0.18))  # ~224 ms of silence in all
        h.append(tone(0.8))  # the rest of the sentence
        stopped = types(h.events).count("input_audio_buffer.speech_stopped")
        assert stopped == (1 if ends else 0), eagerness
        if not ends:  # the sentence's end is asked afresh and ends the turn once
            h.append(silence(0.4))
            last = _asks(h)[-1]
            assert last.params["ref"] != ask.params["ref"]
            h.take(h.core.on_turn_score(last.params["ref"], 0.95, h.now))
            assert types(h.events).count("input_audio_buffer.speech_stopped") == 1
            assert types(h.events).count("input_audio_buffer.committed") == 1


def test_core_eagerness_sets_how_sure_the_model_must_be() -> None:
    for eagerness, ends in (("high", True), ("auto", False), ("low", False)):
        h = _semantic(eagerness)
        h.append(tone(1.0))
        h.append(silence(0.2))
        (ask,) = _asks(h)
        h.take(h.core.on_turn_score(ask.params["ref"], 0.6, h.now))  # >= 0.5, < 0.7
        stopped = "input_audio_buffer.speech_stopped" in types(h.events)
        assert stopped == ends, eagerness


def test_core_waits_for_the_eagerness_maximum_on_an_unfinished_turn() -> None:
    for eagerness, max_ms in (("high", 2000), ("medium", 4000), ("auto", 4000)):
        h = _semantic(eagerness)
        h.append(tone(1.0))
        h.append(silence(0.4))
        (ask,) = _asks(h)
        h.take(h.core.on_turn_score(ask.params["ref"], 0.1, h.now))  # unfinished
        h.append(silence(max_ms / 1000 - 0.45))
        assert "input_audio_buffer.speech_stopped" not in types(h.events), eagerness
        h.append(silence(0.4))
        stopped = [e for e in h.events if e["type"] == "input_audio_buffer.speech_stopped"]
        assert len(stopped) == 1, eagerness
        assert "response.created" in types(h.events)
    assert MAX_PAUSE_MS["low"] == 8000


def test_core_speech_after_the_pause_makes_its_score_stale() -> None:
    h = _semantic()
    h.append(tone(1.0))
    h.append(silence(0.4))
    (ask,) = _asks(h)
    h.append(tone(0.5))  # the user goes on
    h.take(h.core.on_turn_score(ask.params["ref"], 0.99, h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
    h.append(silence(0.4))
    first, second = _asks(h)
    assert second.params["ref"] != first.params["ref"]
    out = h.take(h.core.on_turn_score(second.params["ref"], 0.8, h.now))
    assert types(out)[0] == "input_audio_buffer.speech_stopped"
    assert out.events[0]["audio_end_ms"] > 1700  # one item with both stretches of speech
    assert [e["type"] for e in h.events].count("input_audio_buffer.committed") == 1


def test_without_a_model_semantic_vad_is_server_vad_with_an_eagerness_silence() -> None:
    h = Harness()  # scores_turn_ends False: no end-of-turn stage in the pipeline
    h.update(audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}})
    h.append(tone(1.0))
    h.append(silence(0.4))
    assert not _asks(h)
    assert "input_audio_buffer.speech_stopped" in types(h.events)  # 250 ms of silence


def test_server_vad_never_asks_the_model() -> None:
    h = Harness(scores_turn_ends=True)
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}})
    h.append(tone(1.0))
    h.append(silence(0.7))
    assert not _asks(h)
    assert "input_audio_buffer.speech_stopped" in types(h.events)


def test_barge_in_still_cancels_the_answer() -> None:
    h = _semantic()
    h.append(tone(1.0))
    h.append(silence(0.4))
    (ask,) = _asks(h)
    h.take(h.core.on_turn_score(ask.params["ref"], 0.9, h.now))
    assert h.core.active_response_id is not None
    h.append(tone(0.3))
    assert "input_audio_buffer.speech_started" in types(h.events[-10:])
    done = [e for e in h.events if e["type"] == "response.done"]
    assert done and done[-1]["response"]["status"] == "cancelled"


# --- the transcript of the turn so far as a second cue (TurnCues) ----------------------------


def test_transcript_cue_reads_where_the_words_stop() -> None:
    assert transcript_cue("I would like to book a flight to") == "open"  # a preposition
    assert transcript_cue("Could you play some relaxing music while I finish my...") == "open"
    assert transcript_cue("We need eggs, milk and") == "open"
    assert transcript_cue("We need eggs,") == "open"
    assert transcript_cue("Book a flight to Madrid.") == "closed"
    assert transcript_cue("Is it raining?") == "closed"
    assert transcript_cue("book a flight to Madrid") == "plain"
    assert transcript_cue(None) == "unknown" and transcript_cue("  ") == "unknown"


def test_a_pronoun_after_a_preposition_at_the_end_reads_as_mid_clause() -> None:
    # How Whisper completes a first half that stops on a preposition: the pronoun may be its own.
    assert transcript_cue("I want to send a message to them.") == "open"
    assert transcript_cue("Tell me a short story about it.") == "open"
    assert transcript_cue("What is the difference between it?") == "open"
    # A pronoun after a verb is an ordinary end; so is a noun after a preposition.
    assert transcript_cue("I left my keys in the kitchen, but I cannot find them.") == "closed"
    assert transcript_cue("Tell me a story about a dragon.") == "closed"


def test_words_that_end_a_sentence_lower_the_models_bar_one_rung() -> None:
    cues = TurnCues.for_eagerness("auto")
    assert cues.threshold == THRESHOLDS["auto"] and cues.closed_threshold == CLOSED_THRESHOLDS["auto"]
    between = (CLOSED_THRESHOLDS["auto"] + THRESHOLDS["auto"]) / 2
    assert cues.finished(between, "Book a flight to Madrid.")  # the words end a sentence
    assert not cues.finished(CLOSED_THRESHOLDS["auto"] - 0.01, "Book a flight to Madrid.")
    assert not cues.finished(between, "book a flight to Madrid")  # no sentence end: the model's bar
    assert not cues.finished(between, None)  # no words: the model alone
    assert cues.finished(THRESHOLDS["auto"], None)
    assert not cues.finished(0.99, "I want to send a message to them.")  # a guessed pronoun
    for eagerness in ("low", "medium", "high", "auto"):
        assert CLOSED_THRESHOLDS[eagerness] < THRESHOLDS[eagerness], eagerness
    assert CLOSED_THRESHOLDS["high"] < CLOSED_THRESHOLDS["auto"] < CLOSED_THRESHOLDS["low"]


def test_cues_the_model_decides_and_words_mid_clause_veto_it() -> None:
    cues = TurnCues(threshold=0.7, closed_threshold=0.7)
    assert not cues.finished(0.99, "I would like to book a flight to")  # open: vetoed
    assert cues.finished(0.75, "Book a flight to Madrid.")
    # Whisper completes first halves: "a flight to me." is read as mid-clause.
    assert not cues.finished(0.99, "I would like to book a flight to me.")
    assert cues.finished(0.7, "book a flight to Madrid") and not cues.finished(0.69, "book a flight")
    assert not cues.finished(0.69, None) and cues.finished(0.7, None)  # no words: the model alone


def test_a_score_waits_for_the_pause_transcript_which_may_veto_it() -> None:
    turn = SemanticTurn(threshold=0.7, closed_threshold=0.7)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1300 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    held = turn.on_score(ask.ref, 0.8, "item_1", 1000 * MS, 1300 * MS)
    assert held == WordsAwaited(("item_1", 1000 * MS))  # held for the words
    end = turn.on_transcript(("item_1", 1000 * MS), "Book it.", "item_1", 1000 * MS, 1300 * MS)
    assert end == EndTurn("item_1", 1000 * MS, 0.8)
    # An open transcript keeps a confident score from ending the turn.
    ask = turn.on_frame("item_1", 0, 2000 * MS, 2200 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.97, "item_1", 2000 * MS, 2200 * MS) == WordsAwaited(("item_1", 2000 * MS))
    words = "Book a flight to"
    assert turn.on_transcript(("item_1", 2000 * MS), words, "item_1", 2000 * MS, 2300 * MS) is None
    # Words with a period do not end a turn the model calls unfinished: decided without them.
    ask = turn.on_frame("item_1", 0, 3000 * MS, 3200 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.4, "item_1", 3000 * MS, 3200 * MS) == WordsUnneeded(("item_1", 3000 * MS))
    words = "I would like to book a flight to me."
    assert turn.on_transcript(("item_1", 3000 * MS), words, "item_1", 3000 * MS, 3300 * MS) is None


def test_words_are_unneeded_only_below_every_bar_they_could_lower_it_to() -> None:
    cues = TurnCues(threshold=0.7, closed_threshold=0.5)
    assert not cues.may_finish(0.49) and cues.may_finish(0.5) and cues.may_finish(0.9)
    for p in (0.0, 0.49):  # no words end the turn here: the decision needs none
        assert not any(cues.finished(p, w) for w in (None, "Book it.", "book it", "a flight to"))
    turn = SemanticTurn(threshold=0.7, closed_threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1032 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    held = turn.on_score(ask.ref, 0.55, "item_1", 1000 * MS, 1032 * MS)
    assert held == WordsAwaited(("item_1", 1000 * MS))  # words may end it: they are awaited
    # Words that came first, or none coming: nothing to give up.
    assert turn.on_transcript(("item_1", 2000 * MS), "Book it", "item_1", 2000 * MS, 2000 * MS) is None
    ask = turn.on_frame("item_1", 0, 2000 * MS, 2032 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.1, "item_1", 2000 * MS, 2032 * MS) is None
    ask = turn.on_frame("item_1", 0, 3000 * MS, 3032 * MS)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.1, "item_1", 3000 * MS, 3032 * MS) is None


def test_a_transcript_before_the_score_is_used_and_a_missing_one_leaves_the_model() -> None:
    turn = SemanticTurn(threshold=0.7, closed_threshold=0.7)
    assert turn.on_transcript(("item_1", 1000 * MS), "Book it.", "item_1", 1000 * MS, 1100 * MS) is None
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1300 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    end = turn.on_score(ask.ref, 0.75, "item_1", 1000 * MS, 1300 * MS)
    assert end == EndTurn("item_1", 1000 * MS, 0.75)
    ask = turn.on_frame("item_2", 0, 3000 * MS, 3200 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.8, "item_2", 3000 * MS, 3200 * MS) == WordsAwaited(("item_2", 3000 * MS))
    # Not transcribed (the ASR failed): the model decides alone.
    end = turn.on_transcript(("item_2", 3000 * MS), None, "item_2", 3000 * MS, 3300 * MS)
    assert end == EndTurn("item_2", 3000 * MS, 0.8)
    # The user spoke again before the words came: the held score is stale.
    ask = turn.on_frame("item_2", 0, 4000 * MS, 4200 * MS, transcript_coming=True)
    assert isinstance(ask, ScoreTurn)
    assert turn.on_score(ask.ref, 0.9, "item_2", 4000 * MS, 4200 * MS) == WordsAwaited(("item_2", 4000 * MS))
    assert turn.on_transcript(("item_2", 4000 * MS), "Done.", "item_2", None, 4300 * MS) is None


def _prepares(h: Harness) -> list[PrepareTranscript]:
    return [e for e in h.effects if isinstance(e, PrepareTranscript)]


def test_core_decides_on_the_score_and_the_prepared_transcript() -> None:
    h = _semantic(pipeline_transcribes_input=True)
    h.append(tone(1.0))
    h.append(silence(0.4))
    (prepare,) = _prepares(h)
    (ask,) = _asks(h)
    h.take(h.core.on_turn_score(ask.params["ref"], 0.95, h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)  # waits for the words
    h.take(h.core.on_turn_transcript(prepare.key, "I would like a flight to", h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)  # mid-clause: waits on
    h.append(tone(0.5))  # the user goes on
    h.append(silence(0.4))
    second = _prepares(h)[-1]
    ask = _asks(h)[-1]
    h.take(h.core.on_turn_transcript(second.key, "I would like a flight to Madrid.", h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)  # the model not yet
    out = h.take(h.core.on_turn_score(ask.params["ref"], 0.95, h.now))
    assert types(out)[0] == "input_audio_buffer.speech_stopped"
    assert [e["type"] for e in h.events].count("input_audio_buffer.committed") == 1


def test_core_prepares_the_words_with_the_ask_and_closed_words_lower_the_bar() -> None:
    h = _semantic(pipeline_transcribes_input=True)
    h.append(tone(1.0))
    while not _asks(h):
        h.append(silence(0.02))
    (prepare,) = _prepares(h)  # asked for at the same frame as the model
    (ask,) = _asks(h)
    assert prepare.key[1] == int(ask.params["ref"].split("@")[1])
    h.append(silence(0.3))
    # The model below its bar for words alone, above the one for words ending a sentence.
    between = (CLOSED_THRESHOLDS["auto"] + THRESHOLDS["auto"]) / 2
    h.take(h.core.on_turn_score(ask.params["ref"], between, h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)  # waits for the words
    out = h.take(h.core.on_turn_transcript(prepare.key, "Book a flight to Madrid.", h.now))
    assert types(out)[0] == "input_audio_buffer.speech_stopped"
    # The next turn: the model below the lower bar keeps it open whatever the words.
    h.append(tone(1.0))
    while len(_asks(h)) < 2:
        h.append(silence(0.02))
    prepare, ask = _prepares(h)[-1], _asks(h)[-1]
    h.append(silence(0.1))
    h.take(h.core.on_turn_transcript(prepare.key, "Book a flight to Madrid.", h.now))
    h.take(h.core.on_turn_score(ask.params["ref"], CLOSED_THRESHOLDS["auto"] / 2, h.now))
    assert types(h.events).count("input_audio_buffer.speech_stopped") == 1


def test_core_gives_up_the_words_of_a_pause_no_words_could_end() -> None:
    h = _semantic(pipeline_transcribes_input=True)
    h.append(tone(1.0))
    h.append(silence(0.2))
    (prepare,) = _prepares(h)
    (ask,) = _asks(h)
    h.take(h.core.on_turn_score(ask.params["ref"], CLOSED_THRESHOLDS["auto"] - 0.01, h.now))
    assert [e for e in h.effects if isinstance(e, DropTranscript)] == [DropTranscript(prepare.key)]
    h.take(h.core.on_turn_transcript(prepare.key, None, h.now))  # what a given-up ask answers
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
    # The maximum pause still ends the turn; its response transcribes the audio itself.
    h.append(silence(MAX_PAUSE_MS["auto"] / 1000))
    assert types(h.events).count("input_audio_buffer.speech_stopped") == 1
    assert h.started().params.get("audio") is not None
    # A score the words could still make finished keeps them coming, and says it waits.
    h.append(tone(1.0))
    h.append(silence(0.2))
    prepare, ask = _prepares(h)[-1], _asks(h)[-1]
    h.take(h.core.on_turn_score(ask.params["ref"], CLOSED_THRESHOLDS["auto"], h.now))
    assert len([e for e in h.effects if isinstance(e, DropTranscript)]) == 1
    assert [e for e in h.effects if isinstance(e, NeedTranscript)] == [NeedTranscript(prepare.key)]
