"""World engines driven directly through the Engine contract (no orchestrator)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engines.world.controls import ControlState, key_direction, normalize_key
from engines.world.frame_decode import DecodeTarget, FrameDecodeEngine, resize_frames
from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput
from runtime.payloads import Action, Conditioning, Frames, Payload

pytestmark = pytest.mark.unit


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
