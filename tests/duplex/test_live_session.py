"""The session side of a pipeline that takes its own turns: the sans-I/O core with
`live_responses` and the session's live request (session/voice/live_request.py) on duplex-tiny."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from runtime.orchestrator import Orchestrator
from runtime.spec import load_pipeline
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import CoreOutput, LiveAudio, StartResponse
from session.realtime.ids import SequentialIds
from session.realtime.turn_live import LIVE_COMMIT_MAX_MS
from session.voice.live_request import LiveEntry, LiveRequest
from tests.session.realtime_harness import assert_valid_server_event, pcm16_b64

pytestmark = pytest.mark.system

RATE = 24_000


def live_core() -> RealtimeSessionCore:
    core = RealtimeSessionCore(CoreOptions(live_responses=True, new_id=SequentialIds()))
    core.start(0.0, 1_700_000_000)
    return core


def append(core: RealtimeSessionCore, seconds: float, now: float = 0.0) -> CoreOutput:
    samples = np.full(int(seconds * RATE), 0.1, dtype=np.float32)
    return core.handle_client_event({"type": "input_audio_buffer.append", "audio": pcm16_b64(samples)}, now)


def test_appended_audio_goes_to_the_live_request_and_no_vad_runs() -> None:
    core = live_core()
    assert core.config.turn_detection is None
    out = append(core, 0.5)
    live = [e for e in out.effects if isinstance(e, LiveAudio)]
    assert len(live) == 1 and live[0].rate == RATE and live[0].samples.size == RATE // 2
    assert np.allclose(live[0].samples, 0.1, atol=1e-4)
    assert out.events == []  # nothing client-visible: no speech_started, no commit


def test_a_live_response_commits_the_user_audio_then_streams_the_model() -> None:
    core = live_core()
    append(core, 0.5)
    rid, out = core.on_live_response_started(1.0)
    assert rid is not None
    types = [e["type"] for e in out.events]
    assert types[:4] == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    assert not any(isinstance(e, StartResponse) for e in out.effects)  # the pipeline already speaks
    events = list(out.events)
    events += core.on_response_text(rid, "hi", 1.1).events
    events += core.on_response_audio(rid, np.full(1920, 0.2, np.float32), RATE, 1.1).events
    done = core.on_response_done(rid, "incomplete", now=1.2).events
    events += done
    for event in events:
        assert_valid_server_event(event)
    assert done[-1]["type"] == "response.done"
    response = done[-1]["response"]
    assert response["status"] == "incomplete"
    assert response["output"][0]["content"][0]["transcript"] == "hi"
    assert any(e["type"] == "response.output_audio.delta" for e in events)
    # too little user audio since the last commit: the next response commits nothing
    rid2, out2 = core.on_live_response_started(2.0)
    assert rid2 is not None and out2.events[0]["type"] == "response.created"


def test_a_user_who_talks_on_is_committed_every_30_s() -> None:
    core = live_core()
    committed = 0
    for k in range(int(LIVE_COMMIT_MAX_MS / 1000) + 2):
        out = append(core, 1.0, now=float(k))
        committed += sum(e["type"] == "input_audio_buffer.committed" for e in out.events)
    assert committed == 1


def test_response_create_is_refused() -> None:
    core = live_core()
    out = core.handle_client_event({"type": "response.create", "event_id": "c1"}, 0.0)
    assert [e["type"] for e in out.events] == ["error"]
    assert out.events[0]["error"]["code"] == "invalid_event" and out.events[0]["error"]["event_id"] == "c1"
    assert out.effects == []


async def test_a_failed_live_request_gives_an_error_and_is_reopened() -> None:
    """The model fails one session's live request (its input was far ahead of real time): that
    session gets a server_error and a new live request; another session runs on untouched."""
    orch = Orchestrator.from_spec(load_pipeline("duplex-tiny"))
    await orch.start()
    events: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    cores = {name: live_core() for name in events}
    lives = {
        name: LiveRequest(
            orch, LiveEntry("duplex", RATE), cores[name], lambda out, n=name: events[n].extend(out.events),
            asyncio.get_running_loop().time, session_key=name,
        )
        for name in events
    }
    tasks = [asyncio.create_task(live.run()) for live in lives.values()]
    try:
        await asyncio.sleep(0.3)
        lives["a"].push(LiveAudio(np.zeros(RATE * 105 // 10, np.float32), RATE))  # 10.5 s at once
        for _ in range(25):
            lives["b"].push(LiveAudio(np.zeros(1920, np.float32), RATE))
            await asyncio.sleep(0.08)
        errors = [e for e in events["a"] if e["type"] == "error"]
        assert errors and errors[0]["error"]["type"] == "server_error"
        assert "ahead of the model" in errors[0]["error"]["message"]
        assert lives["a"].opened == 2  # opened again, usable
        assert lives["b"].opened == 1 and not [e for e in events["b"] if e["type"] == "error"]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert orch.live_requests == []  # cancelling the sessions cancelled their requests
        await orch.close()


async def test_audio_faster_than_the_model_takes_it_is_bounded() -> None:
    orch = Orchestrator.from_spec(load_pipeline("duplex-tiny"))
    core = live_core()
    events: list[dict[str, Any]] = []
    live = LiveRequest(
        orch, LiveEntry("duplex", RATE), core, lambda out: events.extend(out.events),
        asyncio.get_running_loop().time, session_key="s", input_limit_bytes=RATE * 4,  # 1 s of float32
    )
    for _ in range(3):  # never pumped (not running): the queue fills, then drops
        live.push(LiveAudio(np.zeros(RATE // 2, np.float32), RATE))
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "input_audio_overflow"
    assert live.dropped_bytes == RATE // 2 * 4  # the third half second: past 1 s waiting


def test_a_cancelled_live_response_drops_the_rest_of_the_stretch() -> None:
    core = live_core()
    rid, _ = core.on_live_response_started(0.0)
    assert rid is not None
    out = core.handle_client_event({"type": "response.cancel"}, 0.1)
    assert [e["type"] for e in out.events][-1] == "response.done"
    assert out.events[-1]["response"]["status"] == "cancelled"
    assert core.on_response_audio(rid, np.full(1920, 0.2, np.float32), RATE, 0.2).events == []
    assert core.on_response_done(rid, "completed", now=0.3).events == []
    rid2, started = core.on_live_response_started(0.4)  # the model's next stretch opens a new one
    assert rid2 not in (None, rid) and started.events[-1]["type"] == "response.created"


async def test_a_full_model_is_retried_with_backoff_not_in_a_loop(monkeypatch: Any) -> None:
    """More live sessions than the model has slots: the extra one gets an error per attempt,
    attempts spaced 0.5, 1, 2 ... s apart (here scaled down), never a tight loop."""
    import session.voice.live_request as live_request

    monkeypatch.setattr(live_request, "REOPEN_DELAY_S", 0.05)
    spec = load_pipeline("duplex-tiny")
    stage = spec.stages[0]
    spec = spec.with_stage(stage.engine, options={"max_sessions": 1})
    orch = Orchestrator.from_spec(spec)
    await orch.start()
    events: list[dict[str, Any]] = []
    first = LiveRequest(orch, LiveEntry("duplex", RATE), live_core(), lambda out: None,
                        asyncio.get_running_loop().time, session_key="a")
    second = LiveRequest(orch, LiveEntry("duplex", RATE), live_core(), lambda out: events.extend(out.events),
                         asyncio.get_running_loop().time, session_key="b")
    tasks = [asyncio.create_task(first.run())]
    try:
        await asyncio.sleep(0.3)
        tasks.append(asyncio.create_task(second.run()))
        await asyncio.sleep(1.0)
        errors = [e for e in events if e["type"] == "error"]
        assert all("slots are in use" in e["error"]["message"] for e in errors)
        # 0.05 + 0.1 + 0.2 + 0.4 (+ 0.8 > 1 s): 4 or 5 attempts, not hundreds
        assert 3 <= second.opened <= 6 and len(errors) == second.opened
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await orch.close()
