"""The sans-I/O video session core, the key coalescer and the pacer: no sockets, no tasks."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import count

import pytest

from media.video import EncodedChunk
from session.world.config import VideoConfig, VideoLimits
from session.world.core import (
    CancelGeneration,
    CloseConnection,
    Output,
    Phase,
    StartGeneration,
    VideoSessionCore,
)
from session.world.events import (
    ChunkMetadata,
    ErrorEvent,
    InteractionApplied,
    InteractionQueued,
    KeyEvent,
    SessionDone,
    VideoStart,
)
from session.world.keys import HeldKeys
from session.world.pacing import ChunkPacer

pytestmark = pytest.mark.unit


def make_core(**limits: object) -> VideoSessionCore:
    ids = count(1)
    config = VideoConfig(limits=replace(VideoLimits(), **limits))  # type: ignore[arg-type]
    return VideoSessionCore(config, session_id="vsess_test", new_id=lambda prefix: f"{prefix}_{next(ids)}")


def text(event: dict[str, object]) -> str:
    return json.dumps(event)


def streaming(core: VideoSessionCore, model: str = "tiny-video-random", **start: object) -> StartGeneration:
    (effect,) = core.handle_text(text({"type": "session.start", "model": model, **start}), 0.0)
    assert isinstance(effect, StartGeneration)
    (started,) = core.on_started()
    assert isinstance(started, VideoStart)
    return effect


def chunk(frames: int = 2) -> EncodedChunk:
    return EncodedChunk(b"x" * 10 * frames, frames, [10] * frames)


def only(outputs: list[Output], kind: type) -> list[Output]:
    return [o for o in outputs if isinstance(o, kind)]


def test_start_plans_the_generation() -> None:
    core = make_core()
    effect = streaming(
        core, model="tiny-jepa", width=320, height=240, fps=24, seed=5, extra_params={"chunk_frames": 3}
    )
    assert effect.pipeline == "world-tiny-jepa"
    assert effect.params == {
        "prompt": "",
        "seed": 5,
        "width": 320,
        "height": 240,
        "fps": 24.0,
        "chunk_frames": 3,
        "flow": "demand",
    }
    assert core.phase is Phase.STREAMING


def test_interactions_land_on_the_next_undemanded_chunk() -> None:
    core = make_core()
    streaming(core)
    d0 = core.take_demand()
    assert d0 is not None and d0.chunk_index == 0 and d0.prompt is None
    (queued,) = core.handle_text(
        text({"type": "session.interaction", "prompt": "snow", "event_id": "p1"}), 1.0
    )
    assert (
        isinstance(queued, InteractionQueued) and queued.applies_at_chunk == 1
    )  # chunk 0 is already asked for
    # chunk 0 goes out: nothing applied yet
    events = core.on_chunk(0, chunk(), "image/jpeg", 30.0, 1.01)
    assert [type(e) for e in events] == [ChunkMetadata]
    progress = ("started_event_ids", "active_event_ids", "completed_event_ids")
    assert [events[0].to_dict()[k] for k in progress] == [[], [], []]  # always there (vLLM-Omni)
    d1 = core.take_demand()
    assert d1 is not None and d1.chunk_index == 1 and d1.prompt == "snow"
    events = core.on_chunk(1, chunk(), "image/jpeg", 30.0, 1.05)
    assert isinstance(events[0], InteractionApplied)
    assert events[0].chunk_index == 1 and events[0].event_ids == ["p1"] and events[0].latency_ms == 50.0
    meta = events[1]
    assert isinstance(meta, ChunkMetadata)
    assert meta.chunk_index == 1 and meta.transport_chunk_index == 1 and meta.pts_ms == pytest.approx(66.667)
    assert meta.to_dict()["generation_chunk_index"] == 1 and meta.to_dict()["num_frames"] == 2
    # applied whole at this chunk: it starts and completes here, nothing stays in transition
    assert [meta.to_dict()[k] for k in progress] == [["p1"], [], ["p1"]]


def test_key_flood_is_coalesced() -> None:
    core = make_core()
    streaming(core, model="tiny-jepa")
    core.take_demand()
    for i in range(500):  # auto-repeat and jitter: far more events than chunks
        kind = "keydown" if i % 3 else "keyup"
        core.handle_text(
            text(
                {
                    "type": "session.interaction",
                    "actions": [{"event": kind, "key": "d"}, {"event": "keydown", "key": "w"}],
                }
            ),
            float(i),
        )
    demand = core.take_demand()
    assert demand is not None
    sent = demand.keys.before + demand.keys.after
    assert len(sent) <= 4  # bounded by the number of keys, not the number of events
    assert ("keydown", "W") in demand.keys.before
    events = core.on_chunk(1, chunk(), "image/jpeg", 30.0, 600.0)
    applied = events[0]
    assert isinstance(applied, InteractionApplied) and len(applied.event_ids) == 64  # listed ids are capped


def test_held_keys_taps_and_order() -> None:
    keys = HeldKeys()
    keys.apply(KeyEvent("keydown", "D"))
    keys.apply(KeyEvent("keyup", "D"))  # a tap inside one chunk
    flush = keys.flush()
    assert flush.before == [("keydown", "D")] and flush.after == [("keyup", "D")]
    keys.apply(KeyEvent("keydown", "W"))
    assert not keys.apply(KeyEvent("keydown", "W"))  # auto-repeat changes nothing
    keys.apply(KeyEvent("keydown", "A"))
    assert keys.flush().before == [("keydown", "W"), ("keydown", "A")]  # press order: A wins
    assert not keys.dirty
    keys.apply(KeyEvent("keyup", "W"))
    flush = keys.flush()
    assert flush.before == [("keyup", "W")] and flush.after == []


def test_errors_leave_the_session_usable() -> None:
    core = make_core()
    streaming(core, model="tiny-jepa")
    bad = [
        ({"type": "session.interaction", "actions": [{"event": "keydown", "key": "q"}]}, "invalid_action"),
        ({"type": "session.interaction", "prompt": "x"}, "prompt_not_supported"),
        ({"type": "session.interaction"}, "invalid_event"),
        (
            {"type": "session.interaction", "actions": [{"event": "keydown", "key": "w"}] * 65},
            "invalid_action",
        ),
        ({"type": "session.start", "model": "tiny-jepa"}, "session_already_active"),
    ]
    for event, code in bad:
        assert isinstance(event, dict)
        (error,) = core.handle_text(text(event), 0.0)
        assert isinstance(error, ErrorEvent) and error.code == code, (event, error)
    # a rejected interaction changed nothing
    demand = core.take_demand()
    assert demand is not None and demand.keys.before == [] and demand.prompt is None
    assert core.phase is Phase.STREAMING
    (error,) = core.handle_text("x" * 70_000, 0.0)
    assert isinstance(error, ErrorEvent) and error.code == "message_too_large"


def test_stop_cancels_then_done() -> None:
    core = make_core()
    effect = streaming(core)
    core.take_demand()
    core.on_chunk(0, chunk(), "image/jpeg", 30.0, 0.1)
    (cancel,) = core.handle_text(text({"type": "session.stop"}), 0.2)
    assert cancel == CancelGeneration(effect.request_id)
    assert core.take_demand() is None  # nothing more is asked for
    assert core.handle_text(text({"type": "session.stop"}), 0.3) == []
    (done,) = core.on_generation_end("cancelled", None)
    assert isinstance(done, SessionDone) and done.stopped and done.reason == "stopped" and done.chunks == 1
    assert core.phase is Phase.IDLE


def test_stop_while_starting_cancels_once_admitted() -> None:
    core = make_core()
    (start,) = core.handle_text(text({"type": "session.start", "model": "tiny-jepa"}), 0.0)
    assert isinstance(start, StartGeneration)
    assert core.handle_text(text({"type": "session.stop"}), 0.0) == [CancelGeneration(start.request_id)]
    outputs = core.on_started()
    assert isinstance(outputs[0], VideoStart) and outputs[1] == CancelGeneration(start.request_id)


def test_num_frames_limits_demand_and_failure_reports() -> None:
    core = make_core()
    streaming(core, num_frames=5)
    assert [core.take_demand() is not None for _ in range(4)] == [True, True, True, False]
    error, done = core.on_generation_end("failed", "boom")
    assert isinstance(error, ErrorEvent) and error.code == "generation_failed" and error.message == "boom"
    assert isinstance(done, SessionDone) and done.reason == "failed"


def test_stall_ends_the_session_with_a_reason() -> None:
    core = make_core()
    effect = streaming(core)
    outputs = core.on_stalled(10.2)
    assert outputs[0] == CancelGeneration(effect.request_id)
    error = only(outputs, ErrorEvent)[0]
    assert isinstance(error, ErrorEvent) and error.code == "client_stalled"
    (close,) = only(outputs, CloseConnection)
    assert (
        isinstance(close, CloseConnection)
        and close.code == 1008
        and close.reason.startswith("client_stalled")
    )
    assert core.phase is Phase.CLOSED and core.handle_text(text({"type": "session.ping"}), 0.0) == []


def test_pacer_sends_on_time_and_demands_just_in_time() -> None:
    pacer = ChunkPacer(margin_s=0.002)
    assert pacer.send_at(10.0) == 10.0  # the first chunk goes at once
    pacer.sent(10.0, 0.1)
    pacer.observe_latency(0.010)
    assert pacer.demand_at(10.0) == pytest.approx(10.1 - 0.022)
    assert pacer.send_at(10.05) == pytest.approx(10.1)  # early: wait for its slot
    assert pacer.send_at(10.3) == 10.3  # late: at once
    pacer.sent(10.102, 0.1)  # timer jitter: the timeline holds, the rate does not drift
    assert pacer.next_due == pytest.approx(10.2)
    pacer.sent(10.35, 0.1)  # 150 ms late (a host hiccup): the timeline holds, the stream catches up
    assert pacer.next_due == pytest.approx(10.3)
    assert pacer.send_at(10.36) == 10.36  # the next one goes as soon as it is ready
    pacer.sent(10.36, 0.1)
    assert pacer.next_due == pytest.approx(10.4)  # back on the timeline
    pacer.sent(10.75, 0.1)  # 350 ms late (> catch_up_s): a real stall, the timeline moves
    assert pacer.next_due == pytest.approx(10.85)
    pacer.observe_latency(0.020)
    assert pacer.latency_s == pytest.approx(0.013)
