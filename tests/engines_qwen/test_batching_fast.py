"""Continuous batching with ``batch_invariant: false`` (the thinker's and the talker's plain
batched products, MoE experts over all tokens at once): a row's logits may differ from its run
alone in the last float bits, yet every request's outputs (thinker tokens and text, talker codes,
code2wav samples) must stay exactly its outputs alone, also when requests join late or are
cancelled mid-batch. One row alone runs the same path as with ``batch_invariant: true``."""

from __future__ import annotations

import pytest
import torch

from engines.rowbatch import rows_exact
from tests.engines_qwen.batch_driver import Member, run_batched
from tests.engines_qwen.driver import Engines, Run, make_engines, run_pipeline
from tests.engines_qwen.test_batching import FRAMES, assert_same, params

# Layer: builds the tiny Qwen3-Omni model.
pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def fast() -> Engines:
    engines = make_engines(batch_invariant=False)
    assert not engines.thinker.batch_invariant and not engines.talker.batch_invariant
    return engines


@pytest.fixture(scope="module")
def alone(engines: Engines) -> dict[int, Run]:
    """Each request alone on the row-exact engines: the reference for both paths."""
    return {i: run_pipeline(engines, params(i), request_id=f"a{i}") for i in range(6)}


def test_a_request_alone_is_the_same_on_both_paths(fast: Engines, alone: dict[int, Run]) -> None:
    for i in (0, 3):
        assert_same(run_pipeline(fast, params(i), request_id=f"f{i}"), alone[i])


def test_batched_outputs_are_the_outputs_alone_on_the_fast_path(fast: Engines, alone: dict[int, Run]) -> None:
    packed = fast.thinker.stats["packed_prefills"], fast.talker.packed_prefills
    members = run_batched(fast, [Member(params(i)) for i in range(6)])
    assert max(max(m.batch_sizes) for m in members) == 6
    assert fast.thinker.stats["packed_prefills"] - packed[0] == 6
    assert fast.talker.packed_prefills - packed[1] == 6
    for i, m in enumerate(members):
        assert m.run.code_matrix.shape == (FRAMES, 16)
        assert_same(m.run, alone[i])


def test_joins_and_cancels_leave_the_others_unchanged_on_the_fast_path(
    fast: Engines, alone: dict[int, Run]
) -> None:
    members = run_batched(
        fast,
        [
            Member(params(0)),
            Member(params(1), join_at=3),
            Member(params(2), cancel_at=6),
            Member(params(3), join_at=9, cancel_at=20),
            Member(params(4), join_at=9),
            Member(params(5), join_at=12),
        ],
    )
    for i in (0, 1, 4, 5):
        assert_same(members[i].run, alone[i])
    cancelled = members[2].run
    assert 0 < len(cancelled.tokens) < len(alone[2].tokens)
    assert cancelled.tokens == alone[2].tokens[: len(cancelled.tokens)]


def test_the_fast_path_really_batches_the_products(fast: Engines) -> None:
    """Not the row-exact products under another name: a plain GEMM over 8 rows of a code predictor
    projection runs as one ``F.linear``, and its rows equal the rows alone to float rounding."""
    loaded = fast.talker.loaded
    layer = loaded.model.talker.code_predictor.model.layers[0].self_attn.q_proj
    x = torch.randn(8, 1, layer.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with rows_exact(False):
            together = layer(x)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
    assert together.numpy().tobytes() == plain.numpy().tobytes()
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
