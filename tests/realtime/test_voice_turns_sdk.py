"""Voice turns with the official `openai` SDK against a real server (voice-cascade on CPU).

Piper speaks the user's side (deterministic voice), the server runs Silero VAD → whisper
tiny.en → echo responder → Piper; every event is validated strictly by `ServerEvents`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import (
    WIRE_RATE,
    Received,
    ServerEvents,
    chunks,
    decode_pcm16,
    pcm16_b64,
    rms,
    sdk_session,
    silence,
    stream_realtime,
)
from tests.speech_audio import SENTENCE, speak, word_errors, words

pytestmark = pytest.mark.system

pytest.importorskip("piper")
pytest.importorskip("faster_whisper")

ECHO = f"You said: {SENTENCE}"
LONG_SENTENCE = f"{SENTENCE} Then it runs back into the quiet forest."
LONG_ECHO = f"You said: {LONG_SENTENCE}"
DELTAS = ("response.output_audio_transcript.delta", "response.output_audio.delta")
# PROTOCOLS.md "Order of one voice turn", after the VAD events; deltas collapsed to one entry.
RESPONSE_ORDER = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    "deltas",
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]
TURN_ORDER = [
    "input_audio_buffer.committed",
    "conversation.item.added",
    "conversation.item.done",
    *RESPONSE_ORDER,
]
TRANSCRIPTION = {"model": "whisper-1", "language": "en"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv"))) as live:
        yield live


def turn_order(events: list[Received]) -> list[str]:
    """Event types with input transcription (asynchronous by design) left out and runs of
    audio/transcript deltas collapsed."""
    out: list[str] = []
    for r in events:
        if r.type.startswith("conversation.item.input_audio_transcription."):
            continue
        kind = "deltas" if r.type in DELTAS else r.type
        if not (out and out[-1] == kind == "deltas"):
            out.append(kind)
    return out


def of_type(events: list[Received], kind: str) -> list[Received]:
    return [r for r in events if r.type == kind]


def response_audio(events: list[Received]) -> np.ndarray:
    return decode_pcm16(r.event.delta for r in of_type(events, "response.output_audio.delta"))


def transcript_deltas(events: list[Received]) -> str:
    return "".join(r.event.delta for r in of_type(events, "response.output_audio_transcript.delta"))


async def input_transcript(events: ServerEvents, seen: list[Received], item_id: str) -> str:
    """The `input_audio_transcription.completed` transcript of `item_id` (already seen or to come)."""
    for r in seen:
        if r.type == "conversation.item.input_audio_transcription.completed" and r.event.item_id == item_id:
            return str(r.event.transcript)
    while True:
        r = await events.wait_for("conversation.item.input_audio_transcription.completed", within_s=30)
        if r.event.item_id == item_id:
            return str(r.event.transcript)


async def test_push_to_talk_turn(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": None, "transcription": TRANSCRIPTION}},
            }
        )
        updated = await events.wait_for("session.updated")
        assert updated.event.session.audio.input.turn_detection is None
        for piece in chunks(speak(SENTENCE, WIRE_RATE), 100):
            await conn.input_audio_buffer.append(audio=pcm16_b64(piece))
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        turn = await events.collect_until("response.done", within_s=60)

        assert turn_order(turn) == TURN_ORDER
        user_item = turn[1].event.item
        assert user_item.role == "user" and user_item.content[0].type == "input_audio"
        done = turn[-1].event.response
        assert done.status == "completed" and done.usage is not None
        assistant = done.output[0]
        assert assistant.role == "assistant" and assistant.status == "completed"
        assert words(assistant.content[0].transcript) == words(ECHO)
        assert words(transcript_deltas(turn)) == words(ECHO)
        assert words(await input_transcript(events, turn, user_item.id)) == words(SENTENCE)

        audio = response_audio(turn)
        assert 1.0 < audio.size / WIRE_RATE < 10.0  # "You said: ..." is ~3.5 s of speech
        assert rms(audio) > 0.02
        deltas = of_type(turn, "response.output_audio.delta")
        assert all(r.event.item_id == assistant.id and r.event.response_id == done.id for r in deltas)


async def test_server_vad_turn_end_to_end(server: LiveServer) -> None:
    """Piper speaks a sentence, streamed at real-time pace; the server's VAD ends the turn,
    the input transcription is the sentence word for word, and the reply says it back. Two
    sentences (~5 s): long enough for the live ASR's local agreement (two passes 700 ms apart)
    to send words while the user still speaks, on a loaded host too (one sentence, ~3 s, left
    none before the end of speech at load 4-7)."""
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {
                        "transcription": TRANSCRIPTION,
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
                    }
                },
            }
        )
        await events.wait_for("session.updated")
        speech = speak(LONG_SENTENCE, WIRE_RATE)
        audio = np.concatenate([silence(0.3), speech, silence(1.0)])
        streaming = asyncio.create_task(stream_realtime(conn, audio))
        turn = await events.collect_until("response.done", within_s=60)
        await streaming

        vad = [r.type for r in turn if r.type.startswith("input_audio_buffer.")]
        assert vad == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
        ]
        kinds = [r.type for r in turn]
        assert kinds[0] == "input_audio_buffer.speech_started"
        stopped_at = kinds.index("input_audio_buffer.speech_stopped")
        started, stopped = turn[0].event, turn[stopped_at].event
        assert started.item_id == stopped.item_id
        speech_ms = speech.size * 1000 // WIRE_RATE
        assert 0 <= started.audio_start_ms <= 300 + 100  # onset at 300 ms, minus prefix padding
        assert abs(stopped.audio_end_ms - (300 + speech_ms)) < 400
        assert turn_order(turn[stopped_at + 1 :]) == TURN_ORDER
        # The live request's ASR stage transcribed the user while they spoke: transcription
        # deltas of the item being spoken arrived before the end of speech was detected.
        during = [r.event for r in turn[:stopped_at]]
        assert {type(e).__name__ for e in during[1:]} == {"ConversationItemInputAudioTranscriptionDeltaEvent"}
        assert during[1:] and all(e.item_id == started.item_id for e in during[1:])

        transcript = await input_transcript(events, turn, started.item_id)
        assert words(transcript) == words(LONG_SENTENCE)
        audio_out = response_audio(turn)
        assert audio_out.size / WIRE_RATE > 1.0 and rms(audio_out) > 0.02
        assert words(transcript_deltas(turn)) == words(LONG_ECHO)
        done = turn[-1].event.response
        assert done.status == "completed"
        assert words(done.output[0].content[0].transcript) == words(LONG_ECHO)
        # The turn was transcribed on the live request during the silence that ended it, and
        # the response used that transcript instead of transcribing again.
        stats = server.ctx.sessions[events.log[0].raw["session"]["id"]].stats
        assert stats.transcripts_prepared >= 1 and stats.transcripts_prepared_used == 1
        # ... and the response itself was started on it during that silence, its output held
        # until the turn ended (docs/sessions.md, "Responses started ahead").
        ahead = server.ctx.sessions[events.log[0].raw["session"]["id"]].response_ahead
        assert ahead is not None and ahead.used == 1
        completed = kinds.index("conversation.item.input_audio_transcription.completed")
        assert completed < kinds.index("response.output_audio.delta")
        # The deltas (during speech, and the rest at the turn's end) add up to the transcript.
        deltas = [r.event.delta for r in of_type(turn, "conversation.item.input_audio_transcription.delta")]
        assert words("".join(deltas)) == words(LONG_SENTENCE), deltas


async def test_a_pause_inside_the_turn_drops_the_response_started_ahead(server: LiveServer) -> None:
    """A 400 ms pause mid-sentence (the turn ends after 700 ms): the response started in the
    pause is dropped unseen when the speaker goes on; the one answer covers the whole turn."""
    first, second = "The quick brown fox", "jumps over the lazy dog."
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 700}}},
            }
        )
        await events.wait_for("session.updated")
        audio = np.concatenate(
            [silence(0.3), speak(first, WIRE_RATE), silence(0.4), speak(second, WIRE_RATE), silence(1.2)]
        )
        streaming = asyncio.create_task(stream_realtime(conn, audio))
        turn = await events.collect_until("response.done", within_s=60)
        await streaming

        assert [r.type for r in turn].count("response.created") == 1
        assert [r.type for r in turn].count("input_audio_buffer.speech_stopped") == 1
        done = turn[-1].event.response
        assert done.status == "completed"
        # One answer covers both halves (Whisper may mishear a word of a sentence cut by a
        # pause: "jump" for "jumps" on some CPUs).
        heard = done.output[0].content[0].transcript
        assert word_errors(f"You said: {first} {second}", heard) <= 1, heard
        ahead = server.ctx.sessions[events.log[0].raw["session"]["id"]].response_ahead
        assert ahead is not None and ahead.dropped >= 1 and ahead.used == 1


LONG_REQUEST = (
    "Tell me about the weather, the mountains, the rivers, the forests, the cities, the roads, "
    "the harbours, the islands, the deserts, the valleys, the lakes, the bridges, the towers, "
    "the gardens, the markets, the castles, the villages and the fields."
)


async def test_barge_in_then_truncate(server: LiveServer) -> None:
    """Speech during the response audio cancels it (turn_detected); the client then truncates
    the assistant item at what it played, and retrieve shows the cut audio and transcript."""
    interruption = np.concatenate([speak("Wait, stop please.", WIRE_RATE), silence(0.5)])
    async with sdk_session(server) as (conn, events):
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}},
            }
        )
        await events.wait_for("session.updated")
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": LONG_REQUEST}],
            }
        )
        await conn.response.create()
        first_delta = await events.wait_for("response.output_audio.delta", within_s=30)
        playback_start = first_delta.at
        assistant_id = first_delta.event.item_id

        streaming = asyncio.create_task(stream_realtime(conn, interruption))
        try:
            speech_started = await events.wait_for("input_audio_buffer.speech_started", within_s=30)
            # The client stops its playback here: it played what arrived, up to the time passed.
            received = [
                r for r in events.log if r.type == "response.output_audio.delta" and r.at <= speech_started.at
            ]
            received_ms = response_audio(received).size * 1000 / WIRE_RATE
            played_ms = int(min(received_ms, (speech_started.at - playback_start) * 1000))
            done = await events.wait_for("response.done", within_s=30)
            response = done.event.response
            assert response.status == "cancelled", "the response had finished before the barge-in"
            assert response.status_details.type == "cancelled"
            assert response.status_details.reason == "turn_detected"
            assert response.output[0].id == assistant_id and response.output[0].status == "incomplete"
            full_transcript = response.output[0].content[0].transcript
            sent = [r for r in events.log if r.type == "response.output_audio.delta"]
            sent_ms = response_audio(sent).size * 1000 / WIRE_RATE
            assert 0 < played_ms < sent_ms

            await conn.conversation.item.truncate(
                item_id=assistant_id, content_index=0, audio_end_ms=played_ms
            )
            truncated = await events.wait_for("conversation.item.truncated", within_s=10)
            assert (truncated.event.item_id, truncated.event.content_index) == (assistant_id, 0)
            assert truncated.event.audio_end_ms == played_ms

            await conn.conversation.item.retrieve(item_id=assistant_id)
            retrieved = (await events.wait_for("conversation.item.retrieved", within_s=10)).event.item
            part = retrieved.content[0]
            kept = decode_pcm16([part.audio])
            assert kept.size == played_ms * WIRE_RATE // 1000
            np.testing.assert_array_equal(kept, response_audio(sent)[: kept.size])
            assert part.transcript and len(part.transcript) < len(full_transcript)
            assert full_transcript.startswith(part.transcript)
        finally:
            streaming.cancel()
            await asyncio.wait([streaming])


async def test_text_only_turn(server: LiveServer) -> None:
    async with sdk_session(server) as (conn, events):
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        updated = await events.wait_for("session.updated")
        assert updated.event.session.output_modalities == ["text"]
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "good morning"}],
            }
        )
        added = await events.wait_for("conversation.item.done")
        t0 = time.monotonic()
        await conn.response.create()
        turn = await events.collect_until("response.done", within_s=30)

        kinds = [r.type for r in turn]
        collapsed = [k for i, k in enumerate(kinds) if not (i and k == kinds[i - 1] and k.endswith(".delta"))]
        assert collapsed == [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done",
        ]
        assert of_type(turn, "response.content_part.added")[0].event.part.type == "text"
        text = "".join(r.event.delta for r in of_type(turn, "response.output_text.delta"))
        assert text == "You said: good morning"
        assert of_type(turn, "response.output_text.done")[0].event.text == text
        done = turn[-1].event.response
        assert done.status == "completed" and done.output_modalities == ["text"]
        assert done.output[0].content[0].type == "output_text" and done.output[0].content[0].text == text
        assert turn[2].event.previous_item_id == added.event.item.id
        assert time.monotonic() - t0 < 10
