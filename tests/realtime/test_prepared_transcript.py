"""Transcribing ahead of the turn's end (sans-I/O core, virtual time): once a pause has run
`prepare_transcript_after_ms`, the core asks for the turn so far to be transcribed
(`PrepareTranscript`); the response that starts when the pause becomes the turn's end
carries the same key, so the driver can hand the pipeline that text instead of the audio."""

from __future__ import annotations

import numpy as np
import pytest

from session.realtime.effects import DropAhead, PrepareTranscript, RespondAhead, StartResponse
from session.voice.ahead import with_transcript
from tests.session.realtime_harness import Harness, silence, tone

pytestmark = pytest.mark.unit


def prepared(h: Harness) -> list[PrepareTranscript]:
    return [e for e in h.effects if isinstance(e, PrepareTranscript)]


def speech_item_id(h: Harness) -> str:
    started = [e for e in h.events if e["type"] == "input_audio_buffer.speech_started"]
    return str(started[-1]["item_id"])


def test_pause_is_transcribed_ahead_and_the_response_says_so() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.3), tone(1.0)]))
    assert prepared(h) == []
    h.append(silence(0.25))  # past 64 ms of pause, before the 500 ms that end the turn
    [ahead] = prepared(h)
    item_id = speech_item_id(h)
    assert ahead.key[0] == item_id
    # The turn so far: prefix padding (300 ms) + 1 s of speech, up to where the pause began.
    assert abs(len(ahead.audio) - 1.3 * 16_000) <= 2 * 512
    assert not any(isinstance(e, StartResponse) for e in h.effects)

    h.append(silence(0.4))
    start = h.started()
    assert start.transcript_key == ahead.key
    assert len(prepared(h)) == 1  # once per pause
    stopped = [e for e in h.events if e["type"] == "input_audio_buffer.speech_stopped"][-1]
    assert stopped["audio_end_ms"] == ahead.key[1] // 16


def test_speech_after_a_pause_prepares_again() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.25), tone(0.5)]))
    first = prepared(h)
    assert len(first) == 1
    h.append(silence(0.7))
    second = prepared(h)[-1]
    assert len(prepared(h)) == 2 and second.key[0] == first[0].key[0] and second.key[1] > first[0].key[1]
    assert h.started().transcript_key == second.key
    assert len(second.audio) > len(first[0].audio)


def test_no_transcript_ahead_without_a_response_to_feed() -> None:
    h = Harness()
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "create_response": False}}})
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.7)]))
    assert prepared(h) == []

    h = Harness(pipeline_transcribes_input=False)  # an audio-native pipeline: never
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.7)]))
    assert prepared(h) == []
    assert h.started().transcript_key is None


def test_no_key_when_the_prompt_holds_more_audio_than_was_transcribed() -> None:
    h = Harness()
    h.push_to_talk()
    h.append(tone(0.3))
    h.send({"type": "input_audio_buffer.commit"})  # an unanswered audio item
    h.update(audio={"input": {"turn_detection": {"type": "server_vad"}}})
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.7)]))
    assert len(prepared(h)) == 1
    start = h.started()
    assert start.transcript_key is None  # the response's audio is both items
    assert len(start.params["audio"]) > len(prepared(h)[0].audio) + 0.25 * 16_000


# --- the response started ahead (`RespondAhead` / `DropAhead`) ---------------------------------


def ahead_effects(h: Harness) -> list[RespondAhead]:
    return [e for e in h.effects if isinstance(e, RespondAhead)]


def dropped(h: Harness) -> list[DropAhead]:
    return [e for e in h.effects if isinstance(e, DropAhead)]


def test_a_long_pause_starts_the_response_ahead_with_the_params_of_the_turns_end() -> None:
    h = Harness()
    earlier = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "earlier"}]}
    h.send({"type": "conversation.item.create", "item": earlier})
    h.append(np.concatenate([silence(0.3), tone(1.0), silence(0.15)]))
    assert len(prepared(h)) == 1 and ahead_effects(h) == []  # 150 ms: transcribed only
    h.append(silence(0.2))
    [ahead] = ahead_effects(h)
    assert ahead.key == prepared(h)[0].key
    assert not any(isinstance(e, StartResponse) for e in h.effects)
    h.append(silence(0.4))
    start = h.started()
    assert start.transcript_key == ahead.key and dropped(h) == []
    # What the driver compares: both with the turn's audio replaced by the same transcript.
    assert with_transcript(ahead.params, "hi") == with_transcript(start.params, "hi")
    assert "earlier" in str(with_transcript(ahead.params, "hi")["history"])


def test_speech_after_the_pause_drops_the_response_started_ahead() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.3)]))
    [first] = ahead_effects(h)
    h.append(tone(0.5))
    assert [d.key for d in dropped(h)] == [first.key]
    h.append(silence(0.7))
    second = ahead_effects(h)[-1]
    assert len(ahead_effects(h)) == 2 and second.key != first.key
    assert h.started().transcript_key == second.key
    assert len(dropped(h)) == 1  # the one that became the turn's end is taken, not dropped


def test_no_response_ahead_while_one_is_active_or_when_none_would_start() -> None:
    h = Harness()
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "create_response": False}}})
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.7)]))
    assert ahead_effects(h) == []

    h = Harness()
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}})
    h.send({"type": "response.create"})  # active, not interrupted: the turn's end starts none
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.7)]))
    assert ahead_effects(h) == []


def test_a_cleared_buffer_drops_the_response_started_ahead() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.3)]))
    [ahead] = ahead_effects(h)
    h.send({"type": "input_audio_buffer.clear"})
    assert [d.key for d in dropped(h)] == [ahead.key]


def test_a_session_update_during_the_pause_changes_the_params() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.3), tone(0.5), silence(0.3)]))
    [ahead] = ahead_effects(h)
    h.update(instructions="Answer in French.")
    h.append(silence(0.4))
    start = h.started()
    assert start.transcript_key == ahead.key  # the driver finds the params differ and resubmits
    assert with_transcript(ahead.params, "x") != with_transcript(start.params, "x")


def test_a_pause_a_semantic_decision_waits_on_is_marked_so() -> None:
    """semantic_vad's decision waits for the pause's words: the live ASR makes them before the
    transcripts only a response reads (`decides`)."""
    semantic = Harness(scores_turn_ends=True)
    semantic.update(audio={"input": {"turn_detection": {"type": "semantic_vad"}}})
    semantic.append(np.concatenate([silence(0.3), tone(1.0), silence(0.25)]))
    assert [p.decides for p in prepared(semantic)] == [True]
    plain = Harness(scores_turn_ends=True)  # server_vad
    plain.append(np.concatenate([silence(0.3), tone(1.0), silence(0.25)]))
    assert [p.decides for p in prepared(plain)] == [False]
