"""The GPT-Live session core, sans-I/O: client frames and model progress in, effects out."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from session.live.core import (
    SILENCE_LAG_MS,
    Begin,
    Close,
    Condition,
    Effect,
    Emit,
    Feed,
    LiveCoreOptions,
    LiveSessionCore,
    Phase,
    RunDelegation,
)
from session.live.events import LiveLimits

pytestmark = pytest.mark.unit

RATE = 24_000


def core(**options: Any) -> LiveSessionCore:
    return LiveSessionCore(
        LiveCoreOptions(session_id="sess_x", pipeline="duplex-tiny", expires_at=99, **options)
    )


def send(c: LiveSessionCore, event: dict[str, Any]) -> list[Effect]:
    return c.receive(json.dumps(event))


def started(c: LiveSessionCore, **session: Any) -> list[Effect]:
    body = {"model": "duplex-tiny", "delegation": {"type": "client"}, **session}
    return send(c, {"type": "session.start", "session": body})


def emitted(effects: list[Effect]) -> list[dict[str, Any]]:
    return [e.event for e in effects if isinstance(e, Emit)]


def pcm(samples: np.ndarray) -> str:
    return base64.b64encode(samples.astype("<i2").tobytes()).decode()


def audio(c: LiveSessionCore, ms: int, value: int = 1000) -> list[Effect]:
    return send(c, {"type": "session.input_audio.append", "audio": pcm(np.full(ms * 24, value))})


def test_start_then_audio_feeds_the_model_on_the_input_clock() -> None:
    c = core()
    out = started(
        c,
        instructions="Be kind.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    )
    assert [type(e) for e in out] == [Emit, Begin]
    assert emitted(out)[0]["type"] == "session.started" and emitted(out)[0]["session"]["id"] == "sess_x"
    assert c.phase is Phase.LIVE
    assert c.conditioning()["instructions"] == "Be kind."
    assert c.conditioning()["history"] == [{"role": "user", "text": "hi"}]
    out = audio(c, 100)
    feed = [e for e in out if isinstance(e, Feed)]
    assert len(feed) == 1 and feed[0].samples.size == 2400
    assert feed[0].samples.dtype == np.float32 and feed[0].samples[0] == pytest.approx(1000 / 32768)
    assert c.input_ms == 100


def test_muted_input_is_silence_of_the_same_length() -> None:
    c = core()
    started(c)
    assert emitted(send(c, {"type": "session.input_audio.mute", "event_id": "m"})) == [
        {"type": "session.input_audio.muted", "client_event_id": "m"}
    ]
    feed = next(e for e in audio(c, 100) if isinstance(e, Feed))
    assert feed.samples.size == 2400 and not feed.samples.any()
    send(c, {"type": "session.input_audio.unmute"})
    feed = next(e for e in audio(c, 100) if isinstance(e, Feed))
    assert feed.samples.all()
    assert c.input_ms == 200  # muted audio still moves the session's clock


def test_the_output_is_continuous_silence_fills_the_gaps_and_speech_follows_it() -> None:
    c = core()
    started(c)
    deltas = [e for e in emitted(audio(c, 1000)) if e["type"] == "session.output_audio.delta"]
    silence = base64.b64decode(deltas[0]["delta"])
    assert len(silence) == 2 * 24 * (1000 - SILENCE_LAG_MS) and not any(silence)
    assert c.output.ms == 1000 - SILENCE_LAG_MS
    c.on_speech_started()
    text = emitted(c.on_model_text("hel"))[0]
    assert text == {
        "type": "session.output_transcript.delta",
        "delta": "hel",
        "start_ms": 800,
        "end_ms": 880,
    }
    speech = emitted(c.on_model_audio(np.full(1920, 0.5, dtype=np.float32), RATE))[0]
    pcm16 = np.frombuffer(base64.b64decode(speech["delta"]), dtype="<i2")
    assert pcm16.size == 1920 and (pcm16 == 16384).all()
    assert c.output.ms == 880
    # while the model speaks, no silence is added
    assert [e["type"] for e in emitted(audio(c, 100))] == []
    c.on_speech_stopped()
    fill = emitted(audio(c, 100))
    assert len(base64.b64decode(fill[0]["delta"])) == 2 * 24 * (1200 - SILENCE_LAG_MS - 880)


def test_usage_is_reported_every_interval_of_audio_and_at_the_close() -> None:
    c = core(limits=LiveLimits(usage_interval_s=1.0))
    started(c)
    types = [e["type"] for _ in range(25) for e in emitted(audio(c, 100))]
    assert types.count("session.usage.updated") == 2  # at 1.0 s and 2.0 s
    out = send(c, {"type": "session.close"})
    events = emitted(out)
    assert events[-2] == {"type": "session.usage.updated", "usage": {"seconds": 2.5}}
    assert events[-1] == {"type": "session.closed", "reason": "close_requested", "usage": {"seconds": 2.5}}
    assert isinstance(out[-1], Close) and out[-1].code == 1000
    assert c.phase is Phase.CLOSED
    assert c.receive("{}") == []  # nothing after the close


@pytest.mark.parametrize(
    ("event", "code"),
    [
        ({"type": "session.input_audio.append", "audio": "AAAA"}, "session_not_started"),
        ({"type": "session.close"}, "session_not_started"),
        ({"type": "nope"}, "unknown_event"),
        ({"type": "session.start", "session": {"model": "x"}}, "model_not_found"),
        (
            {
                "type": "session.start",
                "session": {"model": "gpt-live-1", "delegation": {"type": "responses"}},
            },
            "delegation_unavailable",
        ),
    ],
)
def test_a_refused_event_before_the_start_ends_the_connection(event: dict[str, Any], code: str) -> None:
    c = core()
    out = send(c, event)
    assert emitted(out)[0]["error"]["code"] == code
    assert isinstance(out[-1], Close) and out[-1].code == 1008
    assert c.phase is Phase.CLOSED


def test_limits_are_bytes_and_refusals_after_the_start_keep_the_session() -> None:
    limits = LiveLimits(
        max_message_bytes=2000, max_append_audio_bytes=960, max_append_bytes=10, max_context_bytes=24
    )
    c = core(limits=limits)
    started(c, instructions="12345")
    assert emitted(audio(c, 30))[0]["error"]["code"] == "input_audio_too_large"  # 1,440 bytes
    assert emitted(c.receive(" " * 2001))[0]["error"]["code"] == "message_too_large"
    ok = send(c, {"type": "session.thinking.append", "delegation_id": None, "content": "0123456789"})
    assert isinstance(ok[0], Condition)
    big = send(c, {"type": "session.thinking.append", "delegation_id": None, "content": "01234567890"})
    assert emitted(big)[0]["error"]["code"] == "text_too_large"
    full = send(c, {"type": "session.thinking.append", "delegation_id": None, "content": "0123456789"})
    assert emitted(full)[0]["error"]["code"] == "context_full"  # 5 + 10 + 10 > 24
    assert c.phase is Phase.LIVE
    assert [type(e) for e in audio(c, 20)] == [Feed]


def test_instructions_appends_reach_the_model_as_conditioning() -> None:
    c = core()
    started(c, instructions="Be kind.")
    out = send(c, {"type": "session.instructions.append", "delegation_id": None, "content": "Be brief."})
    condition = out[0]
    assert isinstance(condition, Condition)
    assert condition.values == {
        "append": {"kind": "instructions", "text": "Be brief."},
        "instructions": "Be kind.\n\nBe brief.",
    }
    out = send(c, {"type": "session.commentary.append", "delegation_id": None, "content": "Say hi now."})
    assert out[0] == Condition({"append": {"kind": "commentary", "text": "Say hi now."}})
    assert c.conditioning()["appends"] == [
        {"kind": "instructions", "text": "Be brief."},
        {"kind": "commentary", "text": "Say hi now."},
    ]


def test_client_delegation_is_announced_and_answered() -> None:
    c = core()
    started(c)
    created = emitted(c.on_delegate("look up the weather"))[0]
    assert created["type"] == "session.delegation.created" and created["delegation"]["target"] == "client"
    dlg = created["delegation"]["id"]
    out = send(c, {"type": "session.commentary.append", "delegation_id": dlg, "content": "It is sunny."})
    assert out[0] == Condition(
        {"append": {"kind": "commentary", "text": "It is sunny.", "delegation_id": dlg}}
    )
    send(
        c,
        {
            "type": "response.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "22 C"}]},
        },
    )
    out = send(c, {"type": "response.create"})
    assert out[0] == Condition({"append": {"kind": "result", "text": "22 C", "delegation_id": dlg}})
    kinds = [(e["type"], e["delegation_id"], e["event"]["type"]) for e in emitted(out)]
    assert kinds == [
        ("response.event", dlg, "response.created"),
        ("response.event", dlg, "response.completed"),
    ]


def test_responses_delegation_runs_on_the_text_model_when_the_pipeline_has_one() -> None:
    c = core(delegations=frozenset({"client", "responses"}))
    started(c, delegation=None)  # not asked: the pipeline's text model
    assert c.delegation == "responses"
    out = c.on_delegate("summarise")
    assert isinstance(out[1], RunDelegation) and out[1].task == "summarise"
    dlg = out[1].delegation_id
    assert c.on_delegation_result(dlg, "Done.") == [
        Condition({"append": {"kind": "result", "text": "Done.", "delegation_id": dlg}})
    ]
    refused = send(c, {"type": "session.update", "session": {"delegation": {"type": "client"}}})
    assert emitted(refused)[0]["error"]["code"] == "delegation_immutable"
