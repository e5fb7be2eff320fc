"""The live request's faults, through the official `openai` SDK against a real server.

- A stage raising on one session's input fails that session's live request: the session gets an
  `error` (`server_error`, naming the client `event_id` of that input), opens a new live request
  and keeps detecting turns; another session
  streaming at the same time sees no error and keeps its live request.
- Audio appended far faster than real time is accepted up to the session's byte bound; past it
  the client gets one `input_audio_overflow` error and the excess is dropped (nothing queues
  without end), and the session stays usable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from session.voice.live_request import LiveRequest
from tests.live_server import LiveServer, live_server
from tests.realtime.wire import (
    WIRE_RATE,
    ServerEvents,
    chunks,
    pcm16_b64,
    ping,
    sdk_session,
    silence,
    stream_realtime,
)
from tests.sessions.client import opened, resumed
from tests.speech_audio import SENTENCE, speak

pytestmark = pytest.mark.system

pytest.importorskip("piper")
pytest.importorskip("onnxruntime")

POISON = Path(__file__).with_name("poison.yaml")
VAD = {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}
UPDATE = {"type": "realtime", "audio": {"input": {"turn_detection": VAD}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline=str(POISON)) as live:
        yield live


def session_id(events: ServerEvents) -> str:
    return str(events.log[0].raw["session"]["id"])  # session.created


def live_input(server: LiveServer, events: ServerEvents) -> LiveRequest:
    live = server.ctx.sessions[session_id(events)].live
    assert isinstance(live, LiveRequest)
    return live


def speech() -> np.ndarray:
    voice = speak(SENTENCE, WIRE_RATE)
    return np.concatenate([silence(0.2), 0.5 * voice / np.max(np.abs(voice)), silence(0.6)])


async def test_stage_failure_fails_only_that_session(server: LiveServer) -> None:
    async with sdk_session(server, model="poison") as (conn_a, ev_a), sdk_session(
        server, model="poison"
    ) as (conn_b, ev_b):
        for conn, events in ((conn_a, ev_a), (conn_b, ev_b)):
            await conn.session.update(session=UPDATE)
            await events.wait_for("session.updated")
        live_a, live_b = live_input(server, ev_a), live_input(server, ev_b)
        first_b = live_b.request_id
        assert live_a.request_id and first_b

        # Session A: one full-scale burst (the stage raises on it), while B streams speech.
        burst = np.ones(WIRE_RATE // 10, dtype=np.float32)
        b_streaming = asyncio.create_task(stream_realtime(conn_b, speech()))
        await conn_a.input_audio_buffer.append(audio=pcm16_b64(burst), event_id="evt_burst")
        error = await ev_a.wait_for("error", within_s=20)
        assert error.event.error.type == "server_error"
        assert error.event.error.code == "live_request_failed"
        assert error.event.error.event_id == "evt_burst"  # the input that caused it
        assert "poisoned frame" in error.event.error.message
        await b_streaming
        await ev_b.wait_for("input_audio_buffer.speech_stopped", within_s=20)
        assert "error" not in ev_b.types()

        # A reopened its live request and still detects a turn; B kept its own.
        assert live_a.opened == 2 and live_a.failures == 1
        await stream_realtime(conn_a, speech())
        started = await ev_a.wait_for("input_audio_buffer.speech_started", within_s=20)
        stopped = await ev_a.wait_for("input_audio_buffer.speech_stopped", within_s=20)
        assert started.event.item_id == stopped.event.item_id
        assert live_b.opened == 1 and live_b.failures == 0 and live_b.request_id == first_b


async def test_audio_faster_than_real_time_is_bounded(server: LiveServer) -> None:
    async with sdk_session(server, model="poison") as (conn, events):
        await conn.session.update(session=UPDATE)
        await events.wait_for("session.updated")
        live = live_input(server, events)
        live.limit_bytes = 32 * 1024  # 0.5 s of 16 kHz float32 (the stage takes 50 ms a step)
        # 20 s of audio as fast as the socket takes it (a client streaming a file).
        for piece in chunks(0.1 * np.sin(np.arange(20 * WIRE_RATE) / 7.0).astype(np.float32), 200):
            await conn.input_audio_buffer.append(audio=pcm16_b64(piece))
        error = await events.wait_for("error", within_s=20)
        assert error.event.error.code == "input_audio_overflow"
        assert live.queued_bytes <= live.limit_bytes
        assert live.dropped_bytes > 0
        await asyncio.sleep(0.5)
        errors = [r.raw["error"] for r in events.log if r.type == "error"]
        assert {e["code"] for e in errors} == {"input_audio_overflow"}
        assert len(errors) <= 3, errors  # at most one a second, not one per append
        await ping(conn, events)  # still served


async def test_a_resumed_session_keeps_its_live_request_and_its_turns(server: LiveServer) -> None:
    """Drop the connection mid-session and resume on the same process: the session's live
    request runs on (not reopened, nothing duplicated) and server VAD still detects a turn on
    the new connection; the events of the turn are new, none replayed twice."""
    async with opened(server) as conn:
        await conn.send({"type": "session.update", "session": UPDATE})
        await conn.events.wait_for("session.updated")
        sid, token, last = conn.session_id, conn.resume_token, conn.last_event_id
        live = server.ctx.sessions[sid].live
        assert isinstance(live, LiveRequest)
        first = live.request_id
        conn.abort()  # no close frame: the session is detached, resumable
    async with resumed(server, sid, token, last) as conn:
        for piece in chunks(speech(), 20):
            await conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(piece)})
        started = await conn.events.wait_for("input_audio_buffer.speech_started", within_s=30)
        stopped = await conn.events.wait_for("input_audio_buffer.speech_stopped", within_s=30)
        assert started.raw["item_id"] == stopped.raw["item_id"]
        assert live.opened == 1 and live.request_id == first and live.failures == 0
        ids = [r.raw["event_id"] for r in conn.events.log]
        assert len(ids) == len(set(ids))
