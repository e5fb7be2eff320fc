"""semantic_vad's end-of-turn decisions on virtual time: the decision object alone, and the
core that uses it (a synthetic VAD; the model's answers are given by hand, as the live
request's `TurnScore` would bring them)."""

from __future__ import annotations

from typing import Any

import pytest

from session.realtime import LiveControl
from session.realtime.input_audio import SAMPLES_PER_MS
from session.realtime.semantic_turn import MAX_PAUSE_MS, EndTurn, ScoreTurn, SemanticTurn
from tests.session.realtime_harness import Harness, silence, tone, types

pytestmark = pytest.mark.unit

MS = SAMPLES_PER_MS


def test_asks_once_per_pause_after_the_candidate_window() -> None:
    turn = SemanticTurn(candidate_ms=200)
    assert turn.on_frame("item_1", 0, None, 3200 * MS) is None  # speaking
    assert turn.on_frame("item_1", 0, 3000 * MS, 3190 * MS) is None  # a 190 ms pause: not yet
    ask = turn.on_frame("item_1", 0, 3000 * MS, 3200 * MS)
    assert ask == ScoreTurn("item_1@48000", 0, 3200 * MS)
    assert turn.on_frame("item_1", 0, 3000 * MS, 3400 * MS) is None  # once per pause
    again = turn.on_frame("item_1", 0, 4000 * MS, 4300 * MS)  # a later pause is asked afresh
    assert again is not None and again.ref != ask.ref
    assert turn.on_frame(None, 0, 4000 * MS, 4300 * MS) is None  # no item being spoken


def test_a_finished_score_of_the_current_pause_ends_the_turn() -> None:
    turn = SemanticTurn(candidate_ms=200, threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1200 * MS)
    assert ask is not None
    assert turn.on_score(ask.ref, 0.93, "item_1", 1000 * MS) == EndTurn("item_1", 1000 * MS, 0.93)
    assert turn.on_score(ask.ref, 0.93, "item_1", 1000 * MS) is None  # answered once


def test_unfinished_stale_and_unknown_scores_leave_the_turn_open() -> None:
    turn = SemanticTurn(candidate_ms=200, threshold=0.5)
    ask = turn.on_frame("item_1", 0, 1000 * MS, 1200 * MS)
    assert ask is not None
    assert turn.on_score(ask.ref, 0.2, "item_1", 1000 * MS) is None  # unfinished: wait
    ask = turn.on_frame("item_1", 0, 2000 * MS, 2200 * MS)
    assert ask is not None
    assert turn.on_score(ask.ref, 0.9, "item_1", None) is None  # they spoke again meanwhile
    assert turn.on_score("item_9@1", 0.9, "item_1", 2000 * MS) is None  # not asked
    assert turn.scores == [0.2, 0.9]


def _semantic(eagerness: str = "auto", **options: Any) -> Harness:
    h = Harness(scores_turn_ends=True, **options)
    h.update(audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": eagerness}}})
    return h


def _asks(h: Harness) -> list[LiveControl]:
    return [e for e in h.effects if isinstance(e, LiveControl) and e.kind == "score_turn"]


def test_core_ends_a_finished_turn_on_the_score_not_on_silence() -> None:
    h = _semantic()
    h.append(silence(0.2))
    h.append(tone(1.0))
    h.append(silence(0.3))  # past the 200 ms candidate window: asked, not ended
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


def test_core_waits_for_the_eagerness_maximum_on_an_unfinished_turn() -> None:
    for eagerness, max_ms in (("high", 2000), ("medium", 4000), ("auto", 4000)):
        h = _semantic(eagerness)
        h.append(tone(1.0))
        h.append(silence(0.3))
        (ask,) = _asks(h)
        h.take(h.core.on_turn_score(ask.params["ref"], 0.1, h.now))  # unfinished
        h.append(silence(max_ms / 1000 - 0.45))
        assert "input_audio_buffer.speech_stopped" not in types(h.events), eagerness
        h.append(silence(0.3))
        stopped = [e for e in h.events if e["type"] == "input_audio_buffer.speech_stopped"]
        assert len(stopped) == 1, eagerness
        assert "response.created" in types(h.events)
    assert MAX_PAUSE_MS["low"] == 8000


def test_core_speech_after_the_pause_makes_its_score_stale() -> None:
    h = _semantic()
    h.append(tone(1.0))
    h.append(silence(0.3))
    (ask,) = _asks(h)
    h.append(tone(0.5))  # the user goes on
    h.take(h.core.on_turn_score(ask.params["ref"], 0.99, h.now))
    assert "input_audio_buffer.speech_stopped" not in types(h.events)
    h.append(silence(0.3))
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
    h.append(silence(0.3))
    (ask,) = _asks(h)
    h.take(h.core.on_turn_score(ask.params["ref"], 0.9, h.now))
    assert h.core.active_response_id is not None
    h.append(tone(0.3))
    assert "input_audio_buffer.speech_started" in types(h.events[-10:])
    done = [e for e in h.events if e["type"] == "response.done"]
    assert done and done[-1]["response"]["status"] == "cancelled"
