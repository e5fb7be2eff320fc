"""The tiny π0-shaped policy engine: chunk shape, seeded determinism, batch invariance, and the
per-session context (previous chunk, prompt, reset) changing what comes out."""

from __future__ import annotations

import numpy as np
import pytest

from engines.policy.stages import Pi0TinyEngine
from runtime.engine import EngineRequest, StepInput
from runtime.payloads import ActionChunk, Conditioning, Observation

# Layer: builds the tiny pi0 policy model.
pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def engine() -> Pi0TinyEngine:
    e = Pi0TinyEngine({"image_size": 32, "horizon": 10, "action_dim": 7, "num_steps": 3})
    e.load()
    return e


def obs(e: Pi0TinyEngine, index: int) -> Observation:
    rng = np.random.default_rng(index)
    size = e.config.image_size
    images = {k: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for k in e.config.image_keys}
    return Observation(images, rng.standard_normal(e.config.state_dim).astype(np.float32), seq=index)


def chunk(e: Pi0TinyEngine, state: object, index: int, **updates: object) -> np.ndarray:
    inputs = StepInput(
        state, inputs=[obs(e, index)], updates=[Conditioning(dict(updates))] if updates else []
    )
    (out,) = e.step([inputs])
    (payload,) = out.client
    assert isinstance(payload, ActionChunk) and payload.seq == index and out.wait_for_input
    return payload.actions


def test_chunk_shape_determinism_and_batching(engine: Pi0TinyEngine) -> None:
    one = engine.start(EngineRequest("a", {"seed": 1, "prompt": "pick"}))
    two = engine.start(EngineRequest("b", {"seed": 1, "prompt": "pick"}))
    a = chunk(engine, one, 0)
    assert a.shape == (10, 7) and a.dtype == np.float32 and np.isfinite(a).all()
    np.testing.assert_array_equal(a, chunk(engine, two, 0))  # same seed, inputs, context
    states = [engine.start(EngineRequest(f"r{i}", {"seed": i, "prompt": "x" * (i + 1)})) for i in range(4)]
    outs = engine.step([StepInput(s, inputs=[obs(engine, i)]) for i, s in enumerate(states)])
    batched = [o.client[0].actions for o in outs]  # type: ignore[attr-defined]
    for i, got in enumerate(batched):
        alone = engine.start(EngineRequest(f"s{i}", {"seed": i, "prompt": "x" * (i + 1)}))
        np.testing.assert_allclose(got, chunk(engine, alone, i), atol=1e-5)
    assert {o.client[0].batch for o in outs} == {4}  # type: ignore[attr-defined]


def test_context_changes_the_next_chunk(engine: Pi0TinyEngine) -> None:
    base = engine.start(EngineRequest("a", {"seed": 2}))
    first = chunk(engine, base, 0)
    # the same observation with the previous chunk and step carried over (a rebuilt session)
    rebuilt = engine.start(EngineRequest("b", {"seed": 2, "previous": first, "step": 1}))
    np.testing.assert_allclose(chunk(engine, base, 1), chunk(engine, rebuilt, 1), atol=1e-6)
    no_context = engine.start(EngineRequest("c", {"seed": 2, "step": 2}))
    assert not np.allclose(chunk(engine, base, 2), chunk(engine, no_context, 2), atol=1e-4)
    p1 = engine.start(EngineRequest("d", {"seed": 3, "prompt": "pick"}))
    p2 = engine.start(EngineRequest("e", {"seed": 3, "prompt": "pick"}))
    assert not np.allclose(chunk(engine, p1, 0), chunk(engine, p2, 0, prompt="place"), atol=1e-4)
    chunk(engine, p1, 1, reset=True)
    assert p1.previous is not None and p1.step == 2  # a reset clears, the new chunk fills it again


def test_bad_previous_chunk_is_refused(engine: Pi0TinyEngine) -> None:
    with pytest.raises(ValueError, match="previous chunk has shape"):
        engine.start(EngineRequest("a", {"previous": np.zeros((3, 3), np.float32)}))
