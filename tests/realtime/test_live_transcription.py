"""The core's side of transcription on the live request (a live ASR stage after the VAD):
it marks the user's turns there, sends the words of the item being spoken as deltas before
the item is committed, and makes the deltas add up to the completed transcript. With a
model that takes its own turns, the client's turn control goes into the live request."""

from __future__ import annotations

import numpy as np
import pytest

from session.realtime.effects import LiveControl, PrepareTranscript
from session.realtime.transcripts import remaining_words
from tests.session.realtime_harness import Harness, silence, tone, types

pytestmark = pytest.mark.unit

TRANSCRIBED = {"input": {"transcription": {"model": "whisper-1"}, "turn_detection": {"type": "server_vad"}}}


def controls(h: Harness) -> list[LiveControl]:
    return [e for e in h.effects if isinstance(e, LiveControl)]


def test_turns_are_marked_on_the_live_request_with_their_positions() -> None:
    h = Harness(live_transcribes_input=True)
    h.update(audio=TRANSCRIBED)
    h.append(np.concatenate([silence(0.5), tone(0.6), silence(0.8)]))
    started, stopped = controls(h)
    speech = next(e for e in h.events if e["type"] == "input_audio_buffer.speech_started")
    assert started.kind == "speech_started" and started.params["ref"] == speech["item_id"]
    assert started.params["partials"] is True
    assert started.params["start"] == speech["audio_start_ms"] * 16  # 16 kHz timeline samples
    assert stopped.kind == "speech_stopped" and stopped.params["ref"] == speech["item_id"]
    # The pause's transcript is asked for the same stretch: from the turn's start.
    (prepare,) = [e for e in h.effects if isinstance(e, PrepareTranscript)]
    assert prepare.start_sample == started.params["start"] and prepare.key[0] == speech["item_id"]


def test_no_deltas_asked_for_without_transcription_and_no_marks_without_a_live_asr() -> None:
    h = Harness(live_transcribes_input=True)
    h.append(np.concatenate([silence(0.5), tone(0.6), silence(0.8)]))
    assert [c.params["partials"] for c in controls(h) if c.kind == "speech_started"] == [False]
    plain = Harness()
    plain.update(audio=TRANSCRIBED)
    plain.append(np.concatenate([silence(0.5), tone(0.6), silence(0.8)]))
    assert controls(plain) == []


def test_a_clear_mid_speech_ends_the_marked_turn() -> None:
    h = Harness(live_transcribes_input=True)
    h.update(audio=TRANSCRIBED)
    h.append(np.concatenate([silence(0.5), tone(0.4)]))
    h.send({"type": "input_audio_buffer.clear"})
    assert [c.kind for c in controls(h)] == ["speech_started", "speech_stopped"]


def test_words_while_speaking_then_the_rest_at_the_final() -> None:
    h = Harness(live_transcribes_input=True)
    h.update(audio=TRANSCRIBED)
    h.append(np.concatenate([silence(0.5), tone(0.4)]))
    item_id = controls(h)[0].params["ref"]
    # Before the item exists (it is added at commit): deltas of the item being spoken.
    out = h.take(h.core.on_input_transcript(item_id, "The quick", final=False, now=h.now))
    assert types(out) == ["conversation.item.input_audio_transcription.delta"]
    assert out.events[0]["item_id"] == item_id and out.events[0]["delta"] == "The quick"
    h.take(h.core.on_input_transcript(item_id, " brown", final=False, now=h.now))
    h.append(silence(0.8))
    rid = h.started().response_id
    out = h.take(h.core.on_input_transcript(rid, "The quick brown fox.", now=h.now))
    assert [e.get("delta") for e in out.events] == [" fox.", None]
    assert out.events[1]["transcript"] == "The quick brown fox."


def test_deltas_of_a_stranger_item_are_not_sent() -> None:
    h = Harness(live_transcribes_input=True)
    h.update(audio=TRANSCRIBED)
    assert h.take(h.core.on_input_transcript("item_nope", "hi", final=False, now=h.now)).events == []


@pytest.mark.parametrize(
    ("streamed", "final", "rest"),
    [
        ("", "Hello there.", "Hello there."),
        ("Hello", "Hello there.", " there."),
        ("Hello there", "hello, there.", ""),
        ("Hello where", "Hello there.", ""),  # the deltas said something else: completed corrects
    ],
)
def test_remaining_words(streamed: str, final: str, rest: str) -> None:
    assert remaining_words(streamed, final) == rest


def test_a_model_that_takes_its_own_turns_gets_the_clients_turn_control() -> None:
    h = Harness(live_responses=True)
    h.append(tone(0.3))
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "input_audio_buffer.clear"})
    out = h.take(h.core.on_live_response_started(h.now)[1])
    rid = next(e for e in out.events if e["type"] == "response.created")["response"]["id"]
    h.send({"type": "response.cancel"})
    got = [(c.kind, c.response_id) for c in controls(h)]
    assert got == [("commit", None), ("clear", None), ("cancel", rid)]


def test_a_pause_spoken_past_is_said_so_once_and_a_pause_that_ends_the_turn_never() -> None:
    """The live ASR drops a pause's transcript it has not made yet once the user went on:
    `spoken_past` names the pause (the utterance's start and where the pause began), once."""
    h = Harness(live_transcribes_input=True)
    h.update(audio=TRANSCRIBED)
    h.append(np.concatenate([silence(0.5), tone(0.6), silence(0.25), tone(0.6), silence(0.25)]))
    first, second = [e for e in h.effects if isinstance(e, PrepareTranscript)]
    (past,) = [c for c in controls(h) if c.kind == "spoken_past"]  # not the second: still silent
    assert past.params == {"start": first.start_sample, "end": first.key[1]}
    h.append(silence(0.5))  # the second pause ends the turn: not spoken past
    assert [c.kind for c in controls(h)] == ["speech_started", "spoken_past", "speech_stopped"]
    assert second.key[1] > first.key[1]


def test_no_spoken_past_without_a_live_asr() -> None:
    h = Harness()
    h.update(audio=TRANSCRIBED)
    h.append(np.concatenate([silence(0.5), tone(0.6), silence(0.25), tone(0.6), silence(0.8)]))
    assert len([e for e in h.effects if isinstance(e, PrepareTranscript)]) == 2
    assert controls(h) == []
