"""The transformers responder batches its live replies (engines.speech.lm_batch): each reply's
text batched is exactly its text alone (greedy), also when replies join late or one is cancelled
mid-batch; on a tiny random Llama and on the bundled SmolLM2-135M; in float32 at every batch size
up to 20 on a random Llama of SmolLM2's widths, logits bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.row_counts import _plan
from engines.speech.chat import Turn
from engines.speech.lm_batch import BatchedLm, Reply
from engines.speech.responder import CausalLmResponder
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


@pytest.fixture(scope="module")
def wide_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of SmolLM2-135M's matrix widths (576 hidden, 1536 MLP), one layer."""
    return save_tiny_llama(tmp_path_factory.mktemp("wide_lm_batch"), hidden=576, intermediate=1536, layers=1)


class RecordingLm(BatchedLm):
    """Keeps the logits every reply's tokens were picked from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logits: dict[int, list[bytes]] = {}

    def _pick(self, reply: Reply, logits: torch.Tensor) -> None:
        self.logits.setdefault(id(reply), []).append(logits.numpy().tobytes())
        super()._pick(reply, logits)


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_rows_keep_their_logits_at_every_batch_size(wide_lm_dir: Path, threads: int) -> None:
    """Float32 (the engine's default dtype) at every batch size up to the shipped max_batch (16)
    and beyond: each reply's logits, not only its greedy text, are bit for bit its logits alone.
    A GEMM's row count changes a row's bits (on this host: 5-7 and 9-11 rows at two threads
    differ from the 4 rows a reply alone steps), so the decode only runs measured row counts."""
    lm = CausalLmResponder(wide_lm_dir, dtype="float32")
    batched = RecordingLm(lm, num_threads=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # as the steps set it
    counts = batched.row_counts.counts()
    assert batched.row_counts.counts() is counts  # measured once per thread count (at load)
    turns = [
        Turn.from_params(
            " ".join(QUESTIONS[k % len(QUESTIONS)] for k in range(i % 4 + 1)) + f" {i}",
            {"ignore_eos": True},
            5,
        )
        for i in range(20)
    ]

    try:
        alone = [_stepped_logits(batched, [turn])[0] for turn in turns]
        assert len({a[-1] for a in alone}) == len(turns)
        for size in (2, 3, 5, 6, 7, 8, 9, 11, 12, 15, 16, 17, 20):
            plan = batched.row_counts.plan(size)
            assert sum(real for real, _ in plan) == size
            assert all(rows in counts or (real, rows) == (1, 4) for real, rows in plan)
            assert _stepped_logits(batched, turns[:size]) == alone[:size], size
    finally:
        torch.set_num_threads(before)


def test_row_counts_plan_the_fewest_forwards_at_measured_counts() -> None:
    """One reply pads to the 4 rows it steps alone; several share one measured count (filler rows
    up to the next one), else the fewest forwards of measured counts; no count measured: one
    forward per reply."""
    every = frozenset(range(4, 33))
    assert _plan(every, 32, 1) == ((1, 4),)
    assert _plan(every, 32, 3) == ((3, 4),)
    assert _plan(every, 32, 16) == ((16, 16),)
    assert _plan(every, 32, 40) == ((8, 8), (32, 32))
    holes = frozenset([4, 8, *range(12, 33)])  # two threads on this host
    assert _plan(holes, 32, 5) == ((5, 8),)
    assert _plan(holes, 32, 9) == ((9, 12),)
    up_to_15 = frozenset(range(4, 16))  # a regime that ends at 16 rows
    assert _plan(up_to_15, 32, 16) == ((4, 4), (12, 12))
    assert _plan(frozenset(), 32, 3) == ((1, 4), (1, 4), (1, 4))


def _stepped_logits(batched: RecordingLm, group: Sequence[Turn]) -> list[list[bytes]]:
    """Each reply of `group` stepped together to its end; the logits bytes of every step, per reply."""
    replies = [batched.reply(turn) for turn in group]
    while not all(r.done for r in replies):
        batched.step(replies)
    return [batched.logits.pop(id(r)) for r in replies]


@pytest.mark.parametrize("threads", [1, 2])
def test_prompts_prefilled_together_keep_their_logits(wide_lm_dir: Path, threads: int) -> None:
    """Replies that join in the same step prefill packed into one forward (one GEMM per weight
    over all their tokens) where the measured row counts allow it; each prompt's logits, and so
    every later step's, are bit for bit its logits alone. The packing is checked to happen."""
    lm = CausalLmResponder(wide_lm_dir, dtype="float32")
    batched = RecordingLm(lm, num_threads=threads)
    alone_prefills: list[int] = []
    prefill = batched._prefill

    def counted(reply: Reply) -> None:
        alone_prefills.append(len(reply.prompt))
        prefill(reply)

    batched._prefill = counted  # type: ignore[method-assign]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    turns = [
        Turn.from_params(" ".join(QUESTIONS[: i % 5 + 1]) + f" {i}", {"ignore_eos": True}, 4)
        for i in range(9)
    ]

    try:
        alone = [_stepped_logits(batched, [turn])[0] for turn in turns]
        assert len(alone_prefills) == len(turns)
        alone_prefills.clear()
        assert _stepped_logits(batched, turns) == alone
        assert len(alone_prefills) < len(turns)  # some prompts were packed
        assert len({len(batched.reply(t).prompt) for t in turns}) > 3  # of several lengths
    finally:
        torch.set_num_threads(before)
