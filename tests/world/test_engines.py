"""World engines driven directly through the Engine contract (no orchestrator)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engines.world.controls import ControlState, key_direction, normalize_key
from engines.world.frame_decode import DecodeTarget, FrameDecodeEngine, resize_frames
from engines.world.tiny_jepa import TinyJepaEngine
from engines.world.tiny_video_random import TinyVideoRandomEngine
from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput
from runtime.payloads import Action, Conditioning, Frames, Payload


@pytest.fixture(scope="module")
def jepa() -> TinyJepaEngine:
    engine = TinyJepaEngine({"chunk_frames": 2})
    engine.load()
    return engine


@pytest.fixture(scope="module")
def video() -> TinyVideoRandomEngine:
    engine = TinyVideoRandomEngine({"chunk_frames": 2})
    engine.load()
    return engine


def run(
    engine: Engine,
    params: dict[str, Any],
    script: dict[int, list[Payload]],
    chunks: int,
    updates: dict[int, str] | None = None,
) -> list[np.ndarray]:
    """Demand ``chunks`` chunks one at a time; ``script[k]`` goes in right before chunk k's demand."""
    state = engine.start(EngineRequest("r", params))
    frames = []
    for k in range(chunks):
        inputs = [*script.get(k, []), Action("demand", 1)]
        upd = [Conditioning({"prompt": updates[k]})] if updates and k in updates else []
        (out,) = engine.step([StepInput(state=state, inputs=inputs, updates=upd)])
        (payload,) = out.downstream
        assert isinstance(payload, Frames) and payload.chunk_index == k
        assert out.wait_for_input  # no more demand: it waits
        frames.append(payload.frames)
    return frames


def test_key_names() -> None:
    assert normalize_key("KeyW") == normalize_key("w") == "W"
    assert key_direction("ArrowLeft") == "left" and key_direction("d") == "right"
    assert key_direction("q") is None and key_direction(3) is None


def test_controls_snapshot_at_demand() -> None:
    controls = ControlState.from_params({"flow": "demand"})
    assert controls.next_job() is None  # nothing demanded: wait
    controls.absorb(
        StepInput(
            state=None,
            inputs=[Action("keydown", "d"), Action("demand", 1), Action("keyup", "d"), Action("demand", 1)],
            updates=[Conditioning({"prompt": "p1"})],
        )
    )
    first, second = controls.next_job(), controls.next_job()
    assert first is not None and second is not None
    assert (first.index, first.direction, first.prompt) == (0, "right", "p1")  # a tap still moves one chunk
    assert (second.index, second.direction) == (1, "stay")
    assert controls.next_job() is None
    with pytest.raises(ValueError):
        ControlState.from_params({"flow": "sometimes"})


@pytest.mark.system  # a world model
def test_tiny_jepa_deterministic_and_actions_change_frames(jepa: TinyJepaEngine) -> None:
    params = {"seed": 3, "flow": "demand"}
    still = run(jepa, params, {}, 8)
    again = run(jepa, params, {}, 8)
    assert all(np.array_equal(a, b) for a, b in zip(still, again, strict=True))
    moved = run(jepa, params, {3: [Action("keydown", "d")]}, 8)
    for k in range(3):
        assert np.array_equal(still[k], moved[k]), k  # nothing changes before the action's chunk
    for k in range(3, 8):
        assert not np.array_equal(still[k], moved[k]), k  # and from it on
    other = run(jepa, params, {3: [Action("keydown", "a")]}, 8)
    assert not np.array_equal(other[7], moved[7])  # left is not right


@pytest.mark.system  # a world model
def test_tiny_jepa_frames_and_num_frames(jepa: TinyJepaEngine) -> None:
    state = jepa.start(EngineRequest("r", {"num_frames": 5, "chunk_frames": 2}))  # free-running
    counts, done = [], False
    while not done:
        (out,) = jepa.step([StepInput(state=state)])
        (payload,) = out.downstream
        assert isinstance(payload, Frames)
        assert payload.frames.dtype == np.uint8 and payload.frames.shape[1:] == (32, 32, 3)
        assert payload.frames.max() > 200  # auto gain: the picture uses the range
        counts.append(len(payload.frames))
        done = out.done
    assert counts == [2, 2, 1]


@pytest.mark.system  # a world model
def test_tiny_jepa_batch_equals_single(jepa: TinyJepaEngine) -> None:
    singles = [run(jepa, {"seed": s, "flow": "demand"}, {1: [Action("keydown", "w")]}, 3) for s in (1, 2)]
    states = [jepa.start(EngineRequest(f"r{s}", {"seed": s, "flow": "demand"})) for s in (1, 2)]
    for k in range(3):
        extra = [Action("keydown", "w")] if k == 1 else []
        outs = jepa.step([StepInput(state=st, inputs=[*extra, Action("demand", 1)]) for st in states])
        for i, out in enumerate(outs):
            payload = out.downstream[0]
            assert isinstance(payload, Frames)
            assert np.array_equal(payload.frames, singles[i][k])


@pytest.mark.system  # a world model
def test_tiny_video_random_prompt_changes_output_from_its_chunk(video: TinyVideoRandomEngine) -> None:
    params = {"seed": 7, "prompt": "a red fox", "flow": "demand"}
    base = run(video, params, {}, 6)
    assert all(np.array_equal(a, b) for a, b in zip(base, run(video, params, {}, 6), strict=True))
    updated = run(video, params, {}, 6, updates={3: "a blue whale"})
    for k in range(3):
        assert np.array_equal(base[k], updated[k]), k
    for k in range(3, 6):
        assert not np.array_equal(base[k], updated[k]), k
    # the same update sent as an ordered input lands on the same chunk
    as_input = run(video, params, {3: [Conditioning({"prompt": "a blue whale"})]}, 6)
    assert all(np.array_equal(a, b) for a, b in zip(updated, as_input, strict=True))
    other_seed = run(video, {**params, "seed": 8}, {}, 1)
    assert not np.array_equal(base[0], other_seed[0])


def test_frame_decode_resizes_and_batches() -> None:
    engine = FrameDecodeEngine({"width": 64, "height": 64})
    small = engine.start(EngineRequest("a", {}))
    wide = engine.start(EngineRequest("b", {"width": 100, "height": 50, "upscale": "bilinear"}))
    frames = np.random.default_rng(0).integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
    chunk = Frames(frames, fps=30.0, chunk_index=5)
    outs = engine.step(
        [
            StepInput(state=small, chunks=[EdgeChunk([chunk])]),
            StepInput(state=wide, chunks=[EdgeChunk([chunk])], upstream_finished=True),
        ]
    )
    a, b = outs[0].client[0], outs[1].client[0]
    assert isinstance(a, Frames) and isinstance(b, Frames)
    assert a.frames.shape == (2, 64, 64, 3) and a.chunk_index == 5 and a.fps == 30.0
    assert np.array_equal(a.frames[:, ::2, ::2], frames)  # nearest ×2 keeps every source pixel
    assert b.frames.shape == (2, 50, 100, 3)
    assert not outs[0].done and outs[0].wait_for_input and outs[1].done
    nearest = resize_frames(frames, DecodeTarget(96, 96, "nearest"))
    assert np.array_equal(nearest[:, ::3, ::3], frames)
    with pytest.raises(ValueError):
        engine.start(EngineRequest("c", {"width": 4096}))
    with pytest.raises(ValueError):
        engine.start(EngineRequest("d", {"upscale": "bicubic"}))
