"""The transformers responder batches its live replies (engines.speech.lm_batch): each reply's
text batched is exactly its text alone (greedy), also when replies join late or one is cancelled
mid-batch; on a tiny random Llama and on the bundled SmolLM2-135M."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engines.speech.stages import ResponderEngine
from runtime.engine import EdgeChunk, EngineRequest, StepInput
from runtime.payloads import TextDelta
from tests.tiny_lm import save_tiny_llama

# Layer: loads language models.
pytestmark = pytest.mark.system

QUESTIONS = [
    "The quick brown fox",
    "hello there",
    "What is the capital of France?",
    "Why is the sky blue? Tell me.",
    "fox",
    "How do I make a cup of tea?",
]


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_lm_batch"))


def run(
    engine: ResponderEngine,
    questions: Sequence[str],
    *,
    join_at: Sequence[int] = (),
    cancel: dict[int, int] | None = None,
    params: dict[str, object] | None = None,
) -> tuple[list[str], int]:
    """Every reply through ``engine``, all live ones stepped in one call per round; returns each
    reply's text and the largest batch stepped."""
    join = list(join_at) or [0] * len(questions)
    cancel = cancel or {}
    states: dict[int, object] = {}
    texts = [""] * len(questions)
    done: set[int] = set()
    widest = 0
    for round_no in range(10_000):
        for k in range(len(questions)):
            if join[k] == round_no:
                states[k] = engine.start(EngineRequest(f"r{k}", dict(params or {})))
            if cancel.get(k) == round_no and k in states and k not in done:
                engine.finish(states[k], cancelled=True)
                done.add(k)
        live = [k for k in states if k not in done]
        if not live and len(states) == len(questions):
            return texts, widest
        if not live:
            continue
        inputs = [
            StepInput(state=states[k], chunks=[EdgeChunk(items=[TextDelta(questions[k])], finished=True)])
            if not getattr(states[k], "reply", None)
            else StepInput(state=states[k], upstream_finished=True)
            for k in live
        ]
        for item in inputs:
            item.upstream_finished = True
        widest = max(widest, len(inputs))
        for k, out in zip(live, engine.step(inputs), strict=True):
            texts[k] += "".join(p.text for p in out.client if isinstance(p, TextDelta))
            if out.done:
                engine.finish(states[k], cancelled=False)
                done.add(k)
    raise AssertionError("replies did not finish")


def test_tiny_lm_batched_replies_are_their_replies_alone(tiny_lm_dir: Path) -> None:
    engine = ResponderEngine({"llm": str(tiny_lm_dir), "deltas_per_step": 1, "max_tokens": 24})
    engine.load()
    params = {"ignore_eos": True}
    alone = [run(engine, [q], params=params)[0][0] for q in QUESTIONS]
    assert all(alone) and len(set(alone)) > 1
    together, widest = run(engine, QUESTIONS, params=params)
    assert widest == len(QUESTIONS)
    assert together == alone
    # Late joiners (a prefill beside decodes) and a reply cancelled mid-batch.
    mixed, _ = run(engine, QUESTIONS, join_at=[0, 0, 3, 5, 9, 9], cancel={1: 6}, params=params)
    assert [mixed[k] for k in (0, 2, 3, 4, 5)] == [alone[k] for k in (0, 2, 3, 4, 5)]
    assert mixed[1] and alone[1].startswith(mixed[1]) and mixed[1] != alone[1]


def test_smollm2_batched_replies_are_their_replies_alone() -> None:
    """The real model and shapes (576 hidden, 49152 vocabulary), with stop tokens."""
    engine = ResponderEngine({"deltas_per_step": 2, "max_tokens": 10})
    engine.load()
    questions = QUESTIONS[1:4]
    alone = [run(engine, [q])[0][0] for q in questions]
    together, widest = run(engine, questions, join_at=[0, 0, 1])
    assert together == alone
    assert widest == 3
    assert "Paris" in alone[1]
