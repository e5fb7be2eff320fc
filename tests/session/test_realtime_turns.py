"""Voice turns through the realtime core: exact GA event order, on virtual time."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from session.realtime.effects import CancelResponse, StartResponse, TranscribeInput
from tests.session.realtime_harness import Harness, collapse, silence, tone, types

pytestmark = pytest.mark.system

RESPONSE_AUDIO_ORDER = [
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    "response.output_audio_transcript.delta",
    "response.output_audio.delta",
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def test_session_created_first() -> None:
    h = Harness()
    assert types(h.events) == ["session.created"]
    session = h.events[0]["session"]
    assert session["id"].startswith("sess_") and session["object"] == "realtime.session"
    assert session["expires_at"] == 1_800_000_000 + 3600
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"


def test_push_to_talk_voice_turn() -> None:
    h = Harness()
    h.push_to_talk()
    out = h.append(tone(0.5))
    assert out.events == [] and out.effects == []  # appends are not acknowledged; no VAD
    out = h.send({"type": "input_audio_buffer.commit"})
    assert types(out) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    user = out.events[1]["item"]
    assert user["role"] == "user" and user["content"] == [{"type": "input_audio", "transcript": None}]
    assert out.events[0]["previous_item_id"] is None
    assert not any(isinstance(e, StartResponse) for e in out.effects)  # commit does not respond

    out = h.send({"type": "response.create"})
    assert types(out) == ["response.created"]
    assert out.events[0]["response"]["status"] == "in_progress"
    start = h.started()
    assert start.params["audio"].dtype == np.float32
    assert abs(len(start.params["audio"]) - 8000) <= 16  # 0.5 s at 16 kHz
    assert start.params["modalities"] == ["text", "audio"] and start.params["history"] == []

    out = h.respond("Hello there.", audio_s=0.5, rate=22_050)
    assert collapse(types(out)) == RESPONSE_AUDIO_ORDER
    assistant_added = out.events[1]
    assert assistant_added["previous_item_id"] == user["id"]
    assert assistant_added["item"]["status"] == "in_progress"
    done = out.events[-1]["response"]
    assert done["status"] == "completed" and done["status_details"] is None
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello there."}]
    assert done["usage"]["output_tokens"] > 0 and done["usage"]["total_tokens"] > 0
    # the audio deltas are 40 ms frames of PCM16 24 kHz (last one may be short), 0.5 s in all
    deltas = [base64.b64decode(e["delta"]) for e in out.events if e["type"] == "response.output_audio.delta"]
    assert all(len(d) == 1920 for d in deltas[:-1]) and 0 < len(deltas[-1]) <= 1920
    assert abs(sum(map(len, deltas)) - 24_000) <= 4  # 0.5 s × 24 kHz × 2 bytes


def test_server_vad_turn_with_transcription_from_pipeline() -> None:
    h = Harness()
    h.update(
        audio={
            "input": {
                "transcription": {"model": "whisper-1"},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
            }
        }
    )
    out = h.append(np.concatenate([silence(0.5), tone(0.6), silence(0.5)]))
    assert types(out) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    started, stopped, committed = out.events[:3]
    item_id = started["item_id"]
    assert stopped["item_id"] == committed["item_id"] == item_id
    assert 150 <= started["audio_start_ms"] <= 220  # speech at 500 ms minus 300 ms prefix padding
    assert 1080 <= stopped["audio_end_ms"] <= 1180  # speech ends at 1100 ms
    # the pipeline transcribes the response's audio: no separate TranscribeInput effect
    assert not any(isinstance(e, TranscribeInput) for e in h.effects)
    start = h.started()
    assert 1.1 <= len(start.params["audio"]) / 16000 <= 1.4  # prefix + speech + silence tail
    out = h.take(h.core.on_input_transcript(start.response_id, "hello world", now=h.now))
    # As whisper-1 does: the whole transcript as one delta, then completed.
    assert types(out) == [
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert out.events[0]["item_id"] == item_id and out.events[0]["delta"] == "hello world"
    assert out.events[1]["item_id"] == item_id and out.events[1]["transcript"] == "hello world"
    out = h.respond("You said: hello world")
    assert collapse(types(out)) == RESPONSE_AUDIO_ORDER
    retrieved = h.send({"type": "conversation.item.retrieve", "item_id": item_id}).events[0]["item"]
    assert retrieved["content"][0]["transcript"] == "hello world"
    assert len(base64.b64decode(retrieved["content"][0]["audio"])) > 0

    # the next turn carries the earlier exchange as history
    h.append(np.concatenate([tone(0.4), silence(0.5)]))
    assert h.started().params["history"] == [
        {"role": "user", "text": "hello world"},
        {"role": "assistant", "text": "You said: hello world"},
    ]


def test_text_only_turn() -> None:
    h = Harness()
    h.update(output_modalities=["text"], instructions="Be brief.")
    h.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        }
    )
    h.send({"type": "response.create"})
    start = h.started()
    assert start.params["text"] == "Hi!" and start.params["modalities"] == ["text"]
    assert start.params["instructions"] == "Be brief."
    rid = start.response_id
    out = h.take(h.core.on_response_text(rid, "Hel", h.now))
    out.extend(h.take(h.core.on_response_text(rid, "lo.", h.now)))
    out.extend(h.take(h.core.on_response_audio(rid, tone(0.2), 24000, h.now)))  # ignored
    out.extend(h.take(h.core.on_response_done(rid, "completed", now=h.now)))
    assert types(out) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert out.events[2]["part"] == {"type": "text", "text": ""}
    assert out.events[5]["text"] == "Hello."
    assert out.events[6]["part"] == {"type": "text", "text": "Hello."}
    assert out.events[-1]["response"]["output"][0]["content"] == [{"type": "output_text", "text": "Hello."}]
    assert out.events[-1]["response"]["output_modalities"] == ["text"]


def test_response_create_overrides_modalities_and_instructions() -> None:
    h = Harness()
    h.send(
        {
            "type": "response.create",
            "response": {
                "output_modalities": ["text"],
                "instructions": "Say hi.",
                "max_output_tokens": 50,
                "metadata": {"k": "v"},
            },
        }
    )
    params = h.started().params
    assert params["modalities"] == ["text"] and params["instructions"] == "Say hi."
    assert params["max_tokens"] == 50 and params["text"] == ""
    created = h.events[-1]["response"]
    assert created["max_output_tokens"] == 50 and created["metadata"] == {"k": "v"}


def test_out_of_band_response_is_not_added_to_conversation() -> None:
    h = Harness()
    h.send(
        {
            "type": "response.create",
            "response": {
                "conversation": "none",
                "output_modalities": ["text"],
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "classify"}],
                    }
                ],
            },
        }
    )
    assert h.started().params["text"] == "classify"
    rid = h.started().response_id
    h.take(h.core.on_response_text(rid, "ok", h.now))
    out = h.take(h.core.on_response_done(rid, "completed", now=h.now))
    assert "conversation.item.added" not in types(h.events)
    assert out.events[-1]["response"]["conversation_id"] is None
    assert len(h.core.conversation) == 0


def test_barge_in_cancels_then_truncate() -> None:
    h = Harness()
    h.append(np.concatenate([tone(0.5), silence(0.6)]))
    rid = h.started().response_id
    h.take(h.core.on_response_text(rid, "one two three four five six seven eight", h.now))
    h.take(h.core.on_response_audio(rid, tone(2.0), 24_000, h.now))
    item_id = next(e for e in h.events if e["type"] == "response.output_item.added")["item"]["id"]

    out = h.append(tone(0.1))
    assert types(out)[0] == "input_audio_buffer.speech_started"
    assert collapse(types(out))[1:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = out.events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert done["output"][0]["status"] == "incomplete"
    assert [e for e in out.effects if isinstance(e, CancelResponse)] == [CancelResponse(rid)]
    assert h.core.active_response_id is None
    # late pipeline output for the cancelled response is ignored
    assert h.take(h.core.on_response_audio(rid, tone(0.5), 24_000, h.now)).events == []
    assert h.take(h.core.on_response_done(rid, "cancelled", now=h.now)).events == []

    # the client played 1 s of the 2 s it received: truncate after the cancel succeeds
    out = h.send(
        {
            "type": "conversation.item.truncate",
            "item_id": item_id,
            "content_index": 0,
            "audio_end_ms": 1000,
            "event_id": "evt_trunc",
        }
    )
    assert types(out) == ["conversation.item.truncated"]
    assert out.events[0] | {"event_id": None} == {
        "type": "conversation.item.truncated",
        "event_id": None,
        "item_id": item_id,
        "content_index": 0,
        "audio_end_ms": 1000,
    }
    item = h.send({"type": "conversation.item.retrieve", "item_id": item_id}).events[0]["item"]
    assert len(base64.b64decode(item["content"][0]["audio"])) == 48_000  # 1 s of PCM16 24 kHz
    assert item["content"][0]["transcript"] == "one two three four"
    # the new user turn sees the truncated assistant text as history
    h.append(silence(0.6))
    assert h.started().params["history"][-1] == {"role": "assistant", "text": "one two three four"}


def test_truncate_completed_response_and_beyond_length() -> None:
    h = Harness()
    h.push_to_talk()
    h.send({"type": "response.create"})
    h.respond("abc def", audio_s=0.5, rate=24_000)
    item_id = h.events[-1]["response"]["output"][0]["id"]
    out = h.send(
        {
            "type": "conversation.item.truncate",
            "item_id": item_id,
            "content_index": 0,
            "audio_end_ms": 900,
            "event_id": "e9",
        }
    )
    assert out.events[0]["error"] == {
        "type": "invalid_request_error",
        "code": "invalid_value",
        "param": "audio_end_ms",
        "event_id": "e9",
        "message": "Audio content of 500ms is already shorter than 900ms.",
    }
    assert types(
        h.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 500,
            }
        )
    ) == ["conversation.item.truncated"]
    assert types(
        h.send(
            {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 0}
        )
    ) == ["conversation.item.truncated"]


def test_interrupt_response_false_keeps_response() -> None:
    h = Harness()
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}})
    h.append(np.concatenate([tone(0.3), silence(0.6)]))
    rid = h.started().response_id
    out = h.append(np.concatenate([tone(0.3), silence(0.6)]))
    assert "response.done" not in types(out) and h.core.active_response_id == rid
    # speech stopped while responding: committed, but no second response
    assert sum(isinstance(e, StartResponse) for e in h.effects) == 1
    assert "input_audio_buffer.committed" in types(out)


def test_create_response_false_commits_and_transcribes_separately() -> None:
    h = Harness()
    h.update(
        audio={
            "input": {
                "transcription": {"model": "whisper-1"},
                "turn_detection": {"type": "server_vad", "create_response": False},
            }
        }
    )
    out = h.append(np.concatenate([tone(0.3), silence(0.6)]))
    assert "input_audio_buffer.committed" in types(out) and "response.created" not in types(out)
    (job,) = [e for e in out.effects if isinstance(e, TranscribeInput)]
    out = h.take(h.core.on_input_transcript(job.item_id, "hi", final=False, now=h.now))
    assert types(out) == ["conversation.item.input_audio_transcription.delta"]
    out = h.take(h.core.on_input_transcript(job.item_id, "hi there", now=h.now))
    # The deltas add up to the transcript: the final's words after "hi", then completed.
    assert [e.get("delta") for e in out.events] == [" there", None]
    assert out.events[1]["transcript"] == "hi there"
    assert h.take(h.core.on_input_transcript(job.item_id, "again", now=h.now)).events == []  # once


def test_transcription_failed_event() -> None:
    h = Harness(pipeline_transcribes_input=False)
    h.update(audio={"input": {"transcription": {"model": "whisper-1"}, "turn_detection": None}})
    h.append(tone(0.3))
    out = h.send({"type": "input_audio_buffer.commit"})
    (job,) = [e for e in out.effects if isinstance(e, TranscribeInput)]
    out = h.take(h.core.on_input_transcript_failed(job.item_id, "asr crashed"))
    assert types(out) == ["conversation.item.input_audio_transcription.failed"]


def test_pipeline_failure_ends_response_failed() -> None:
    h = Harness()
    h.send({"type": "response.create"})
    rid = h.started().response_id
    out = h.take(h.core.on_response_done(rid, "failed", "engine exploded", now=h.now))
    assert types(out) == ["response.done"]
    details = out.events[0]["response"]["status_details"]
    assert details["type"] == "failed" and details["error"]["message"] == "engine exploded"
    assert out.events[0]["response"]["output"] == []


def test_pcmu_output_and_input() -> None:
    h = Harness()
    h.update(
        audio={
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcmu"}},
        }
    )
    from media.audio import PCMU

    h.send(
        {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(PCMU.encode(tone(0.3, 8000))).decode(),
        }
    )
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})
    assert abs(len(h.started().params["audio"]) - 4800) <= 16
    out = h.respond(audio_s=0.3, rate=24_000)
    deltas = [base64.b64decode(e["delta"]) for e in out.events if e["type"] == "response.output_audio.delta"]
    assert all(len(d) == 320 for d in deltas[:-1])  # 40 ms at 8 kHz, one byte per sample
    assert abs(sum(map(len, deltas)) - 2400) <= 2
    assert out.events[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}


def test_idle_timeout_triggers_response() -> None:
    h = Harness()
    h.update(audio={"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}})
    assert h.core.next_deadline() == 3600.0  # only the session expiry before any response
    h.append(np.concatenate([tone(0.3), silence(0.6)]))
    h.respond(audio_s=1.0, rate=24_000)
    deadline = h.core.next_deadline()
    assert deadline is not None and deadline > h.now + 5.0  # after the audio has played out
    assert h.take(h.core.tick(deadline - 0.01)).events == []
    h.append(silence(0.3))
    out = h.take(h.core.tick(deadline + 0.01))
    assert types(out) == [
        "input_audio_buffer.timeout_triggered",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    assert out.events[0]["item_id"] == out.events[1]["item_id"]


def test_session_expiry_closes_1001() -> None:
    h = Harness(max_duration_s=60)
    h.send({"type": "response.create"})
    rid = h.started().response_id
    assert h.take(h.core.check_expiry(59.9)).events == []
    out = h.take(h.core.check_expiry(60.0))
    assert types(out) == ["response.done", "error"]
    assert out.events[1]["error"]["code"] == "session_expired"
    assert [type(e).__name__ for e in out.effects] == ["CancelResponse", "Close"]
    assert out.effects[0] == CancelResponse(rid) and out.effects[1].code == 1001  # type: ignore[union-attr]
    assert h.send({"type": "response.create"}).events == []  # closed: nothing more
