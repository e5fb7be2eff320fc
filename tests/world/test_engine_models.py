"""The tiny world models (torch) driven directly through the Engine contract (no orchestrator)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.world.tiny_jepa import TinyJepaEngine
from engines.world.tiny_video_random import TinyVideoRandomEngine
from runtime.engine import EngineRequest, StepInput
from runtime.payloads import Action, Conditioning, Frames
from tests.world.test_engines import run

pytestmark = pytest.mark.system


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
