"""The append fast path, batched input resampling, PCM16 item audio and its retention bound."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from media.audio import PCM24K, VAD_RATE, StreamingResampler, resample
from session.realtime.input_audio import InputAudio
from session.voice.driver import RealtimeDriver
from tests.session.realtime_harness import Harness, pcm16_b64, tone, types
from web.server.metrics import conversation_audio_bytes

pytestmark = pytest.mark.unit


def error_of(h: Harness, event: dict[str, Any]) -> dict[str, Any]:
    out = h.send(event)
    assert types(out) == ["error"], types(out)
    err: dict[str, Any] = out.events[0]["error"]
    return err


# --- the append fast path: same errors as the validated model -----------------------------


@pytest.mark.parametrize(
    ("event", "code", "param"),
    [
        ({"type": "input_audio_buffer.append"}, "missing_required_parameter", "audio"),
        ({"type": "input_audio_buffer.append", "audio": 12}, "invalid_value", "audio"),
        ({"type": "input_audio_buffer.append", "audio": None}, "invalid_value", "audio"),
        ({"type": "input_audio_buffer.append", "audio": "AAAA", "rate": 8000}, "unknown_parameter", "rate"),
        ({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": 7}, "invalid_value", "event_id"),
        ({"type": "input_audio_buffer.append", "audio": "AA=A"}, "invalid_value", "audio"),
        ({"type": "input_audio_buffer.append", "audio": "AA=="}, "invalid_value", "audio"),  # odd byte count
    ],
)
def test_bad_appends_get_the_validated_errors(event: dict[str, Any], code: str, param: str) -> None:
    h = Harness()
    err = error_of(h, {**event, "event_id": event.get("event_id", "evt_a")})
    assert (err["code"], err["param"]) == (code, param)
    assert err["event_id"] == ("evt_a" if isinstance(event.get("event_id", "evt_a"), str) else None)
    # the session goes on: a good append after the bad one is accepted silently
    assert h.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.04))}).events == []


def test_append_without_event_id_and_with_null_event_id() -> None:
    h = Harness()
    h.push_to_talk()
    for extra in ({}, {"event_id": None}, {"event_id": "e1"}):
        out = h.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.1)), **extra})
        assert out.events == [] and out.effects == []
    out = h.send({"type": "input_audio_buffer.commit"})
    assert types(out)[0] == "input_audio_buffer.committed"


# --- batched resampling --------------------------------------------------------------------


@pytest.mark.parametrize("vad", [False, True])
def test_batched_resampling_equals_per_append_resampling(vad: bool) -> None:
    """Appends wait as int16 and are resampled in batches; the timeline holds what resampling
    each 40 ms append as it came (the old way) gave, to within the half step of its PCM16 storage."""
    signal = tone(3.0, freq=330.0)
    pcm = np.rint(signal * 32767).astype("<i2").tobytes()
    step = PCM24K.bytes_for_ms(40)
    buffered = InputAudio(PCM24K)
    buffered.set_vad(vad)
    reference = StreamingResampler(PCM24K.rate, VAD_RATE)
    expected: list[np.ndarray] = []
    for i in range(0, len(pcm), step):
        buffered.append_wire(pcm[i : i + step])
        expected.append(reference.process(PCM24K.decode(pcm[i : i + step])))
        if vad:  # a VAD frame's worth (40 ms > 32 ms) is resampled at once: VAD is not delayed
            assert buffered._end == sum(len(x) for x in expected)
            buffered.next_frames()
    buffered.flush()
    expected.append(reference.flush())
    got = buffered.slice(buffered.start, buffered.end)
    want = np.concatenate(expected)
    assert len(got) == len(want) == pytest.approx(3.0 * VAD_RATE, abs=2)
    np.testing.assert_allclose(got, want, atol=0.5 / 32768 + 1e-7)


def test_manual_mode_resamples_at_most_once_a_second() -> None:
    buffered = InputAudio(PCM24K)
    pcm = np.rint(tone(0.5) * 32767).astype("<i2").tobytes()
    buffered.append_wire(pcm)
    assert buffered._end == 0  # still waiting as int16
    assert buffered.duration_ms == pytest.approx(500, abs=12)  # reading settles it
    buffered.append_wire(pcm * 2)  # 1 s of wire samples waiting: resampled now
    assert buffered._end > 0.9 * 1.5 * VAD_RATE


# --- PCM16 storage ---------------------------------------------------------------------------


def push_to_talk_turn(h: Harness, seconds: float, *, reply_s: float = 0.5, transcript: str = "") -> str:
    """Append `seconds` of tone, commit, respond with `reply_s` of audio; the user item id."""
    h.append(tone(seconds), chunk_s=0.04)
    committed = h.send({"type": "input_audio_buffer.commit"}).events[0]
    item_id = str(committed["item_id"])
    h.send({"type": "response.create"})
    if transcript:
        h.take(h.core.on_input_transcript(h.started().response_id, transcript, now=h.now))
    h.respond("ok", audio_s=reply_s, rate=24_000)
    return item_id


def test_committed_audio_is_pcm16_and_pipelines_still_get_float32() -> None:
    h = Harness()
    h.push_to_talk()
    signal = tone(1.0, freq=300.0)
    h.append(signal, chunk_s=0.04)
    item_id = h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"]
    part = h.core.conversation.get(item_id).content[0]
    assert part.input_audio is not None and part.input_audio.dtype == np.int16
    assert len(part.input_audio) == pytest.approx(VAD_RATE, abs=2)
    h.send({"type": "response.create"})
    audio = h.started().params["audio"]
    assert audio.dtype == np.float32
    want = resample(np.rint(signal * 32767) / 32768, 24_000, VAD_RATE)
    n = min(len(audio), len(want))
    # PCM16 storage is within half a step of the resampled float audio
    assert np.max(np.abs(audio[200 : n - 200] - want[200 : n - 200])) < 2e-4
    # retrieve gives the audio back in the session's input format
    item = h.send({"type": "conversation.item.retrieve", "item_id": item_id}).events[0]["item"]
    back = np.frombuffer(base64.b64decode(item["content"][0]["audio"]), "<i2") / 32768
    assert len(back) == pytest.approx(24_000, abs=3)
    assert np.max(np.abs(back[300:-300] - signal[300:-300])) < 2e-3


# --- the retention bound -----------------------------------------------------------------------


def audio_seconds(h: Harness) -> float:
    return sum(p.audio_ms() for i in h.core.conversation.items for p in i.content) / 1000


def test_retention_keeps_only_the_newest_seconds_of_audio() -> None:
    h = Harness(audio_retention_s=2.0)
    h.push_to_talk()
    users = [push_to_talk_turn(h, 0.6, reply_s=0.4, transcript=f"turn {k}") for k in range(5)]
    items = h.core.conversation.items
    assert len(items) == 10  # user, assistant, ... nothing is deleted
    assert audio_seconds(h) <= 2.0 + 0.01
    # the newest two turns (2 s) keep their audio, older items only their transcripts
    with_audio = [i.id for i in items if any(p.audio_ms() > 0 for p in i.content)]
    assert with_audio == [i.id for i in items[-4:]]
    old = h.send({"type": "conversation.item.retrieve", "item_id": users[0]}).events[0]["item"]
    assert old["content"] == [{"type": "input_audio", "transcript": None}]  # no `audio`
    old_reply = h.send({"type": "conversation.item.retrieve", "item_id": items[1].id}).events[0]["item"]
    assert old_reply["content"] == [{"type": "output_audio", "transcript": "ok"}]
    new = h.send({"type": "conversation.item.retrieve", "item_id": users[-1]}).events[0]["item"]
    assert len(base64.b64decode(new["content"][0]["audio"])) == pytest.approx(0.6 * 48_000, abs=8)
    # the history of the next response still has every earlier turn, as text (ASR's)
    push_to_talk_turn(h, 0.6)
    history = h.started().params["history"]
    assert [e["text"] for e in history if e["role"] == "user"] == [f"turn {k}" for k in range(5)]
    # what /metrics reports (omniduplex_conversation_audio_bytes) is bounded with it
    driver = RealtimeDriver(h.core, None)
    assert conversation_audio_bytes([driver]) <= 2 * 48_000 + 1.2 * 32_000  # ≤ 2 s, mixed


def test_the_newest_item_keeps_its_audio_even_past_the_bound() -> None:
    h = Harness(audio_retention_s=0.5)
    h.push_to_talk()
    user = push_to_talk_turn(h, 1.5, reply_s=0.3)
    h.append(tone(1.2), chunk_s=0.04)
    newest = h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"]
    stored = {i.id: sum(p.audio_ms() for p in i.content) for i in h.core.conversation.items}
    assert stored[user] == 0  # 1.5 s: older and over the bound
    assert stored[newest] == pytest.approx(1200, abs=2)


def test_truncate_of_an_item_whose_audio_was_dropped() -> None:
    h = Harness(audio_retention_s=0.5)
    h.push_to_talk()
    push_to_talk_turn(h, 0.3, reply_s=0.8)
    assistant = h.core.conversation.items[1]
    push_to_talk_turn(h, 0.3, reply_s=0.8)
    assert assistant.content[0].output_audio is None  # dropped
    err = error_of(
        h,
        {
            "type": "conversation.item.truncate",
            "item_id": assistant.id,
            "content_index": 0,
            "audio_end_ms": 900,
        },
    )
    assert (err["code"], err["param"]) == ("invalid_value", "audio_end_ms")  # still knows it lasted 800 ms
    out = h.send(
        {
            "type": "conversation.item.truncate",
            "item_id": assistant.id,
            "content_index": 0,
            "audio_end_ms": 400,
        }
    )
    assert types(out) == ["conversation.item.truncated"]
    assert assistant.content[0].output_audio_ms() == 400


def test_trailing_user_turns_over_the_bound_go_to_the_pipeline_as_transcripts() -> None:
    """Documented degradation: two user turns committed back to back, the older one past the
    bound: the response gets the newer one's audio and the older one's transcript."""
    h = Harness(audio_retention_s=1.0)
    h.update(audio={"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}})
    h.append(tone(0.8), chunk_s=0.04)
    first = h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"]
    h.take(h.core.on_input_transcript(first, "the first turn", now=h.now))
    h.append(tone(0.6), chunk_s=0.04)
    h.send({"type": "input_audio_buffer.commit"})
    assert h.core.conversation.get(first).audio_16k is None
    h.send({"type": "response.create"})
    params = h.started().params
    assert len(params["audio"]) == pytest.approx(0.6 * VAD_RATE, abs=2)
    assert {"role": "user", "text": "the first turn"} in params["history"]


def _two_turns_back_to_back(h: Harness) -> None:
    """Two user turns committed back to back (the first one's words known), then a response."""
    h.update(audio={"input": {"turn_detection": None}})
    h.append(tone(0.8), chunk_s=0.04)
    first = h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"]
    h.take(h.core.on_input_transcript(first, "the first turn", now=h.now))
    h.append(tone(0.6), chunk_s=0.04)
    h.send({"type": "input_audio_buffer.commit"})
    h.send({"type": "response.create"})


def test_trailing_user_turns_with_known_words_go_as_words_to_an_asr_first_pipeline() -> None:
    """The user spoke again before an answer came: an ASR-first pipeline gets the earlier turn's
    words, not its audio to transcribe again with the last turn's."""
    h = Harness(pipeline_transcribes_input=True)
    _two_turns_back_to_back(h)
    params = h.started().params
    assert len(params["audio"]) == pytest.approx(0.6 * VAD_RATE, abs=2)
    assert params["history"][-1] == {"role": "user", "text": "the first turn"}
    # A pipeline whose model hears the audio itself gets both turns' audio, as before.
    heard = Harness(pipeline_transcribes_input=False)
    _two_turns_back_to_back(heard)
    params = heard.started().params
    assert len(params["audio"]) == pytest.approx(1.4 * VAD_RATE, abs=4)
    assert {"role": "user", "text": "the first turn"} not in params["history"]


def test_input_audio_memory_per_turn_is_halved() -> None:
    """PCM16 at 16 kHz: 32 KB per second of user audio (float32 was 64 KB)."""
    h = Harness()
    h.push_to_talk()
    push_to_talk_turn(h, 2.0, reply_s=2.0)
    user, assistant = h.core.conversation.items
    assert user.content[0].input_audio is not None and user.content[0].input_audio.nbytes == pytest.approx(
        64_000, abs=8
    )
    assert assistant.content[0].output_audio is not None and len(assistant.content[0].output_audio) == 96_000


def test_retention_walks_back_only_over_items_that_may_hold_audio() -> None:
    """An hour-long session has thousands of items: each pass stops at the oldest item that
    may still hold audio instead of rescanning the conversation."""
    h = Harness(audio_retention_s=1.0)
    h.push_to_talk()
    for _ in range(40):
        push_to_talk_turn(h, 0.3, reply_s=0.3)
    conversation = h.core.conversation
    holders = [i for i in conversation.items if any(p.audio_ms() > 0 for p in i.content)]
    assert len(conversation) == 80 and len(holders) == 3  # 3 × 0.3 s within the 1 s bound
    assert conversation._audio_holders_bound <= len(holders) + 1


def test_an_old_audio_item_inserted_at_the_root_is_still_bounded() -> None:
    h = Harness(audio_retention_s=1.0)
    h.push_to_talk()
    for _ in range(3):
        push_to_talk_turn(h, 0.3, reply_s=0.3)
    audio = pcm16_b64(tone(0.8))
    content = [{"type": "input_audio", "audio": audio}]
    item = {"type": "message", "role": "user", "id": "item_root", "content": content}
    out = h.send({"type": "conversation.item.create", "previous_item_id": "root", "item": item})
    assert "conversation.item.done" in types(out)
    assert h.core.conversation.get("item_root").audio_16k is None  # oldest and over the bound
    assert audio_seconds(h) <= 1.0 + 0.01


def test_uncommitted_buffer_is_stored_as_pcm16() -> None:
    """A full-duplex client streams audio all the time: seconds of it may wait uncommitted in
    every session, so the buffer holds 2 bytes per 16 kHz sample, not 4."""
    buffered = InputAudio(PCM24K)
    pcm = np.rint(tone(2.0) * 32767).astype("<i2").tobytes()
    buffered.append_wire(pcm)
    buffered.flush()
    assert all(chunk.dtype == np.int16 for chunk in buffered._chunks)
    held = sum(chunk.nbytes for chunk in buffered._chunks)
    assert held == pytest.approx(2 * 2.0 * VAD_RATE, rel=0.01)
    out = buffered.slice(buffered.start, buffered.end)
    assert out.dtype == np.float32 and len(out) * 2 == held

