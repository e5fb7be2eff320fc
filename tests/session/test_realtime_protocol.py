"""Errors, conversation items and session.update of the realtime core."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from session.realtime.effects import ClearAudioOutput, PlayAudio
from tests.session.realtime_harness import Harness, pcm16_b64, silence, tone, types

pytestmark = pytest.mark.unit


def error_of(h: Harness, event: dict[str, Any] | str) -> dict[str, Any]:
    out = h.send(event)
    assert types(out) == ["error"], types(out)
    err: dict[str, Any] = out.events[0]["error"]
    assert err["type"] == "invalid_request_error"
    return err


def user_text(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}


# --- bad input ---------------------------------------------------------------------------


def test_invalid_json() -> None:
    err = error_of(Harness(), "{not json")
    assert err["code"] == "invalid_json" and err["event_id"] is None


def test_unknown_event_type_echoes_event_id() -> None:
    err = error_of(Harness(), {"type": "response.audio.delta", "event_id": "evt_1"})
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_event", "type", "evt_1")
    err = error_of(Harness(), {"event_id": "evt_2"})
    assert (err["code"], err["param"], err["event_id"]) == ("missing_required_parameter", "type", "evt_2")


def test_an_error_echoes_at_most_the_start_of_a_huge_input() -> None:
    """A 400 KB invalid value, type, parameter name or event id comes back as its first 200
    characters and its length: the error was as large as the input, and was queued, logged and
    copied each time (issue 33)."""
    h = Harness()
    huge = "h" * 400_000
    err = error_of(h, {"type": "session.update", "session": {"type": "realtime", "audio": huge}})
    assert (err["code"], err["param"]) == ("invalid_value", "session.audio")
    assert len(err["message"]) < 1_000 and "(400,002 characters)" in err["message"]
    assert err["message"].startswith("Invalid value for 'session.audio': 'hhhh")
    err = error_of(h, {"type": huge, "event_id": huge})
    assert err["code"] == "invalid_event" and "(400,000 characters)" in err["message"]
    assert len(err["message"]) < 1_000
    assert err["event_id"] == "h" * 200 + "... (400,000 characters)"
    err = error_of(h, {"type": "session.update", "session": {"type": "realtime", huge: 1}})
    assert err["code"] == "unknown_parameter" and len(err["param"]) < 300 and len(err["message"]) <= 2_100
    out = h.send({"type": "session.update", "session": {"type": "realtime"}, "event_id": "evt_short"})
    assert types(out) == ["session.updated"]
    bad = {"type": "session.update", "session": {"type": "realtime", "audio": "x"}, "event_id": "e1"}
    err = error_of(h, bad)
    assert err["event_id"] == "e1" and err["message"] == (
        "Invalid value for 'session.audio': 'x' (Input should be a valid dictionary or instance of AudioIn)."
    )


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 1.5}}}},
            "invalid_value",
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "loud_vad"}}}},
            "invalid_value",
            "session.audio.input.turn_detection.type",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "invalid_value",
            "session.audio.output.format.rate",
        ),
        ({"audio": {"output": {"speed": 3}}}, "invalid_value", "session.audio.output.speed"),
        ({"max_output_tokens": 0}, "invalid_value", "session.max_output_tokens"),
        ({"output_modalities": []}, "invalid_value", "session.output_modalities"),
        ({"modalities": ["text"]}, "unknown_parameter", "session.modalities"),  # the beta shape
        ({"type": "transcription"}, "invalid_value", "session.type"),
    ],
)
def test_session_update_bad_values(session: dict[str, Any], code: str, param: str) -> None:
    h = Harness()
    before = h.core.session_object()
    err = error_of(
        h, {"type": "session.update", "event_id": "u1", "session": {"type": "realtime", **session}}
    )
    assert (err["code"], err["param"], err["event_id"]) == (code, param, "u1")
    assert h.core.session_object() == before  # nothing changed


def test_session_update_requires_type() -> None:
    err = error_of(Harness(), {"type": "session.update", "session": {"instructions": "x"}})
    assert (err["code"], err["param"]) == ("missing_required_parameter", "session.type")


@pytest.mark.parametrize("audio", ["***", "AAA"])
def test_append_invalid_base64(audio: str) -> None:
    err = error_of(Harness(), {"type": "input_audio_buffer.append", "audio": audio, "event_id": "a1"})
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "audio", "a1")


def test_append_odd_byte_count() -> None:
    odd = base64.b64encode(b"\x00\x01\x02").decode()
    err = error_of(Harness(), {"type": "input_audio_buffer.append", "audio": odd, "event_id": "a2"})
    assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "audio", "a2")


def test_commit_under_100ms() -> None:
    h = Harness()
    h.push_to_talk()
    h.append(tone(0.08))
    err = error_of(h, {"type": "input_audio_buffer.commit", "event_id": "c1"})
    assert (err["code"], err["event_id"]) == ("input_audio_buffer_commit_empty", "c1")
    h.append(tone(0.04))  # now 120 ms in the buffer
    assert types(h.send({"type": "input_audio_buffer.commit"}))[0] == "input_audio_buffer.committed"
    err = error_of(h, {"type": "input_audio_buffer.commit", "event_id": "c2"})  # emptied by the commit
    assert err["code"] == "input_audio_buffer_commit_empty"


def test_clear_buffer() -> None:
    h = Harness()
    h.push_to_talk()
    h.append(tone(0.5))
    assert types(h.send({"type": "input_audio_buffer.clear"})) == ["input_audio_buffer.cleared"]
    assert error_of(h, {"type": "input_audio_buffer.commit"})["code"] == "input_audio_buffer_commit_empty"


def test_response_create_while_active_and_cancel_not_active() -> None:
    h = Harness()
    err = error_of(h, {"type": "response.cancel", "event_id": "x1"})
    assert (err["code"], err["event_id"]) == ("response_cancel_not_active", "x1")
    h.send({"type": "response.create"})
    rid = h.started().response_id
    err = error_of(h, {"type": "response.create", "event_id": "x2"})
    assert (err["code"], err["event_id"]) == ("conversation_already_has_active_response", "x2")
    err = error_of(h, {"type": "response.cancel", "response_id": "resp_other", "event_id": "x3"})
    assert err["code"] == "response_cancel_not_active"
    out = h.send({"type": "response.cancel", "response_id": rid})
    assert types(out) == ["response.done"]
    assert out.events[0]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert error_of(h, {"type": "response.cancel"})["code"] == "response_cancel_not_active"


@pytest.mark.parametrize(
    "event",
    [
        {"type": "conversation.item.retrieve", "item_id": "item_nope"},
        {"type": "conversation.item.delete", "item_id": "item_nope"},
        {"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
        {"type": "conversation.item.create", "item": user_text("x"), "previous_item_id": "item_nope"},
    ],
)
def test_unknown_item_id(event: dict[str, Any]) -> None:
    err = error_of(Harness(), {**event, "event_id": "i1"})
    assert err["code"] == "item_not_found" and err["event_id"] == "i1"
    assert err["param"] in ("item_id", "previous_item_id")


def test_truncate_rejects_user_items() -> None:
    h = Harness()
    h.send({"type": "conversation.item.create", "item": user_text("hi", id="u1")})
    err = error_of(
        h, {"type": "conversation.item.truncate", "item_id": "u1", "content_index": 0, "audio_end_ms": 0}
    )
    assert err["code"] == "unsupported_content_type"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        (
            {"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]},
            "item.content[0].type",
        ),
        ({"type": "message", "role": "robot", "content": []}, "item.role"),
        (
            {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "@@"}]},
            "item.content[0].audio",
        ),
        ({"type": "message", "role": "user", "content": [{"type": "input_text"}]}, "item.content[0].text"),
        ({"type": "bogus"}, "item.type"),
    ],
)
def test_item_create_bad_item(item: dict[str, Any], param: str) -> None:
    err = error_of(Harness(), {"type": "conversation.item.create", "item": item})
    assert (err["code"], err["param"]) == ("invalid_value", param)


def test_missing_field_and_unknown_field() -> None:
    err = error_of(Harness(), {"type": "conversation.item.delete"})
    assert (err["code"], err["param"]) == ("missing_required_parameter", "item_id")
    err = error_of(Harness(), {"type": "response.cancel", "foo": 1})
    assert (err["code"], err["param"]) == ("unknown_parameter", "foo")


def test_output_audio_buffer_clear_needs_webrtc() -> None:
    assert error_of(Harness(), {"type": "output_audio_buffer.clear"})["code"] == "invalid_event"


# --- conversation items --------------------------------------------------------------------


def test_items_create_retrieve_delete_with_previous_item_id() -> None:
    h = Harness()
    out = h.send({"type": "conversation.item.create", "item": user_text("first", id="a")})
    assert types(out) == ["conversation.item.added", "conversation.item.done"]
    assert out.events[0]["previous_item_id"] is None
    assert out.events[0]["item"] == {
        "id": "a",
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": "first"}],
    }
    assert (
        h.send({"type": "conversation.item.create", "item": user_text("third", id="c")}).events[0][
            "previous_item_id"
        ]
        == "a"
    )
    assert (
        h.send(
            {"type": "conversation.item.create", "item": user_text("second", id="b"), "previous_item_id": "a"}
        ).events[0]["previous_item_id"]
        == "a"
    )
    assert (
        h.send(
            {
                "type": "conversation.item.create",
                "item": user_text("zeroth", id="z"),
                "previous_item_id": "root",
            }
        ).events[0]["previous_item_id"]
        is None
    )
    assert [i.id for i in h.core.conversation.items] == ["z", "a", "b", "c"]
    err = error_of(h, {"type": "conversation.item.create", "item": user_text("dup", id="a")})
    assert (err["code"], err["param"]) == ("invalid_value", "item.id")

    out = h.send({"type": "conversation.item.retrieve", "item_id": "b"})
    assert types(out) == ["conversation.item.retrieved"] and out.events[0]["item"]["id"] == "b"
    assert types(h.send({"type": "conversation.item.delete", "item_id": "b"})) == [
        "conversation.item.deleted"
    ]
    assert [i.id for i in h.core.conversation.items] == ["z", "a", "c"]

    h.send({"type": "response.create"})
    assert h.started().params["text"] == "zeroth\nfirst\nthird"


def test_created_items_become_history_and_prompt() -> None:
    h = Harness()
    h.update(instructions="Be nice.")
    h.send(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "system",
                "content": [{"type": "input_text", "text": "Sys."}],
            },
        }
    )
    h.send({"type": "conversation.item.create", "item": user_text("Q1")})
    h.send(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "A1"}],
            },
        }
    )
    h.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        }
    )
    audio = base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()
    h.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]},
        }
    )
    h.send({"type": "response.create"})
    params = h.started().params
    assert params["history"] == [{"role": "user", "text": "Q1"}, {"role": "assistant", "text": "A1"}]
    assert params["instructions"] == "Be nice.\n\nSys."
    assert len(params["audio"]) == 3200  # 200 ms at 16 kHz


# --- session.update ----------------------------------------------------------------------


def test_session_update_merges() -> None:
    h = Harness()
    out = h.update(
        instructions="A", audio={"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7}}}
    )
    assert types(out) == ["session.updated"]
    s = out.events[0]["session"]
    assert s["instructions"] == "A"
    assert s["audio"]["input"]["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.7,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "idle_timeout_ms": None,
        "create_response": True,
        "interrupt_response": True,
    }
    s = h.update(
        audio={
            "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 200}},
            "output": {"voice": "marin", "speed": 1.2},
        }
    ).events[0]["session"]
    td = s["audio"]["input"]["turn_detection"]
    assert (td["threshold"], td["silence_duration_ms"]) == (0.7, 200)  # merged, not replaced
    assert s["instructions"] == "A"  # untouched fields stay
    assert s["audio"]["output"] == {
        "format": {"type": "audio/pcm", "rate": 24000},
        "voice": "marin",
        "speed": 1.2,
    }
    s = h.update(
        audio={
            "input": {
                "transcription": {"model": "whisper-1", "language": "en"},
                "noise_reduction": {"type": "far_field"},
            }
        }
    ).events[0]["session"]
    assert s["audio"]["input"]["transcription"] == {"model": "whisper-1", "language": "en"}
    assert s["audio"]["input"]["noise_reduction"] == {"type": "far_field", "strength": 1.0}
    s = h.update(audio={"input": {"turn_detection": None, "transcription": None}}).events[0]["session"]
    assert s["audio"]["input"]["turn_detection"] is None and s["audio"]["input"]["transcription"] is None
    s = h.update(audio={"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}).events[
        0
    ]["session"]
    assert s["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": True,
    }
    s = h.update(
        output_modalities=["text"],
        max_output_tokens=100,
        tools=[{"type": "function", "name": "f"}],
        tool_choice="required",
    ).events[0]["session"]
    assert (s["output_modalities"], s["max_output_tokens"], s["tool_choice"]) == (["text"], 100, "required")
    assert s["id"] == h.events[0]["session"]["id"]


def test_voice_locked_after_audio() -> None:
    h = Harness()
    h.send({"type": "response.create"})
    h.respond()
    err = error_of(
        h,
        {"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "cedar"}}}},
    )
    assert err["param"] == "session.audio.output.voice"


def test_turn_detection_off_stops_vad() -> None:
    h = Harness()
    out = h.append(tone(0.1))
    assert out.effects  # DetectSpeech requested while server_vad is on
    h.push_to_talk()
    assert h.append(tone(0.5)).effects == []


def test_stale_vad_scores_are_ignored() -> None:
    h = Harness()
    out = h.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.2))})
    (job,) = out.effects
    h.send({"type": "input_audio_buffer.clear"})
    stale = h.take(h.core.feed_vad([0.99] * job.num_frames, h.now, start_sample=job.start_sample))  # type: ignore[union-attr]
    assert stale.events == []


# --- WebRTC hooks (audio out on a track) -------------------------------------------------


def test_track_transport_audio_and_barge_in_truncates_at_playout() -> None:
    h = Harness(audio_out_via_track=True)
    h.append(np.concatenate([tone(0.3), silence(0.6)]))
    rid = h.started().response_id
    h.take(h.core.on_response_text(rid, "alpha beta gamma delta", h.now))
    out = h.take(h.core.on_response_audio(rid, tone(1.0, 22_050), 22_050, h.now))
    assert "response.output_audio.delta" not in types(out)
    assert "output_audio_buffer.started" in types(out)
    plays = [e for e in out.effects if isinstance(e, PlayAudio)]
    assert plays and plays[0].sample_rate == 24_000
    h.take(h.core.on_response_done(rid, "completed", now=h.now))
    h.take(h.core.on_playout(rid, 400.0, h.now))
    out = h.append(tone(0.1))  # user speaks while the track still plays
    assert types(out) == [
        "input_audio_buffer.speech_started",
        "output_audio_buffer.cleared",
        "conversation.item.truncated",
    ]
    assert out.events[2]["audio_end_ms"] == 400
    assert ClearAudioOutput(rid) in out.effects
    item = h.core.conversation.items[-1]
    assert item.content[0].output_audio is not None and len(item.content[0].output_audio) == 19_200


def test_track_transport_playout_finished() -> None:
    h = Harness(audio_out_via_track=True)
    h.send({"type": "response.create"})
    rid = h.started().response_id
    h.take(h.core.on_response_audio(rid, tone(0.2), 24_000, h.now))
    h.take(h.core.on_response_done(rid, "completed", now=h.now))
    out = h.take(h.core.on_playout_finished(rid, h.now))
    assert types(out) == ["output_audio_buffer.stopped"]


def test_every_event_has_unique_id_across_a_session() -> None:
    h = Harness()
    h.append(np.concatenate([silence(0.2), tone(0.3), silence(0.6)]))
    h.respond()
    ids = [e["event_id"] for e in h.events]
    assert len(ids) == len(set(ids)) and all(i.startswith("event_") for i in ids)
    json.dumps(h.events)  # JSON-ready as emitted


def test_client_may_send_back_the_session_object() -> None:
    h = Harness()
    session = h.events[0]["session"]
    out = h.send({"type": "session.update", "session": session})
    assert types(out) == ["session.updated"]
    assert out.events[0]["session"] == session


def test_event_after_max_duration_expires_session() -> None:
    h = Harness(max_duration_s=10)
    h.now = 10.5
    out = h.send({"type": "input_audio_buffer.clear", "event_id": "late"})
    assert types(out) == ["error"] and out.events[0]["error"]["code"] == "session_expired"
    assert [type(e).__name__ for e in out.effects] == ["Close"]


def test_usage_counts_the_prompt_text_without_joining_it() -> None:
    """response.usage's input text tokens: the prompt's characters (the trailing turn, the
    history joined with spaces, the instructions) / 4, rounded up, counted without joining the
    history into one more copy of it (a 8 MiB conversation made an 8 MB string per response)."""
    h = Harness()
    h.update(instructions="be brief")
    for text in ["first question", "second one", "x" * 1001]:
        h.send({"type": "conversation.item.create", "item": user_text(text)})
        h.send({"type": "response.create"})
        rid = h.started().response_id
        h.take(h.core.on_response_text(rid, f"answer to {text[:6]}", h.now))
        h.take(h.core.on_response_done(rid, "completed", now=h.now))
    h.send({"type": "conversation.item.create", "item": user_text("last")})
    h.send({"type": "response.create"})
    rid = h.started().response_id
    out = h.take(h.core.on_response_done(rid, "completed", now=h.now))
    (done,) = [e for e in out.events if e["type"] == "response.done"]
    history = ["first question", "answer to first ", "second one", "answer to second"]
    history += ["x" * 1001, "answer to xxxxxx"]
    prompt = "last" + " ".join(history) + "be brief"
    details = done["response"]["usage"]["input_token_details"]
    assert details["text_tokens"] == -(-len(prompt) // 4)
