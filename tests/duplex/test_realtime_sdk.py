"""duplex-tiny behind the OpenAI Realtime protocol, driven by the official `openai` SDK over a
real WebSocket: audio in; the model's own stretches of speech out as responses (audio deltas,
a transcript from its text stream, response.done); the user's audio as user items; no VAD."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import decode_pcm16, ping, sdk_session, stream_realtime

pytestmark = pytest.mark.system

RATE = 24_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # a session ends 0.5 s after its socket (not the default 30 s grace), so its live request does
    with live_server(
        Path(tmp_path_factory.mktemp("srv")), pipeline="duplex-tiny", vad=False, disconnect_grace_s=0.5
    ) as live:
        yield live


def mic(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


async def test_model_speech_becomes_responses_and_user_audio_user_items(server: LiveServer) -> None:
    async with sdk_session(server, model="duplex-tiny") as (conn, events):
        sender = asyncio.create_task(stream_realtime(conn, mic(6.0), chunk_ms=20))
        done = await events.wait_for("response.done", within_s=30)
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    log = events.log
    types = [r.type for r in log]
    assert "input_audio_buffer.speech_started" not in types  # no VAD: the model takes the turns
    response = done.event.response
    assert response.status in ("completed", "incomplete")  # fell silent, or cut at max length
    rid = response.id
    mine = [r for r in log if r.raw.get("response_id") == rid or r.raw.get("response", {}).get("id") == rid]
    assert mine[0].type == "response.created"
    audio = decode_pcm16(r.raw["delta"] for r in mine if r.type == "response.output_audio.delta")
    assert audio.size >= RATE * 0.08 * 0.9  # at least one 80 ms model frame, at 24 kHz
    assert np.abs(audio).max() > 0
    transcript = "".join(r.raw["delta"] for r in mine if r.type == "response.output_audio_transcript.delta")
    item = response.output[0]
    assert item.role == "assistant" and item.content[0].type == "output_audio"
    assert item.content[0].transcript == transcript  # the model's text stream (noise: random weights)
    # the user's audio before the model spoke was committed as a user item, ahead of the response
    committed = types.index("input_audio_buffer.committed")
    assert committed < types.index("response.created")
    user_items = [r for r in log if r.type == "conversation.item.added" and r.raw["item"]["role"] == "user"]
    assert user_items and user_items[0].raw["item"]["content"][0]["type"] == "input_audio"


async def test_the_session_refuses_response_create_and_server_vad(server: LiveServer) -> None:
    async with sdk_session(server, model="duplex-tiny") as (conn, events):
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
        )
        updated = await events.wait_for("session.updated", within_s=10)
        assert updated.raw["session"]["audio"]["input"]["turn_detection"] is None
        await conn.response.create()
        error = await events.wait_for("error", within_s=10)
        assert error.raw["error"]["code"] == "invalid_event"
        assert "decides when to speak" in error.raw["error"]["message"]
        await ping(conn, events)  # still served


async def test_sessions_share_the_model_step_and_end_cleanly(server: LiveServer) -> None:
    """Three SDK sessions at once: each gets its own responses; ending them ends their live
    requests (the model's slots are freed)."""

    async def one(seed: int) -> str:
        async with sdk_session(server, model="duplex-tiny") as (conn, events):
            sender = asyncio.create_task(stream_realtime(conn, mic(5.0, seed), chunk_ms=40))
            done = await events.wait_for("response.done", within_s=40)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            return str(done.event.response.id)

    ids = await asyncio.gather(*(one(s) for s in range(3)))
    assert len(set(ids)) == 3
    orch = server.ctx.orchestrator
    for _ in range(100):  # the sessions end 0.5 s after their sockets (the host's sweep)
        if not orch.live_requests:
            break
        await asyncio.sleep(0.1)  # the server runs on another loop: no event to wait on
    assert orch.live_requests == []  # every session's live request was cancelled with it
    stage = orch.metrics.snapshot()["stages"]["duplex"]
    assert stage["batch"]["max"] >= 2  # frames of several sessions went through one step


async def test_user_items_are_transcribed_when_asked(server: LiveServer) -> None:
    """With input transcription on, each user item the model's turn committed gets one (Whisper
    on noise: the text itself means nothing; the event is what is checked)."""
    async with sdk_session(server, model="duplex-tiny") as (conn, events):
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}
        )
        await events.wait_for("session.updated", within_s=10)
        sender = asyncio.create_task(stream_realtime(conn, mic(4.0, 7), chunk_ms=20))
        committed = await events.wait_for("input_audio_buffer.committed", within_s=30)
        done = await events.wait_for(
            "conversation.item.input_audio_transcription.completed",
            "conversation.item.input_audio_transcription.failed",
            within_s=60,
        )
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert done.raw["item_id"] == committed.raw["item_id"]
