"""Continuous batching for the transformers responder (``speech.responder`` with an LM).

Every live reply of a step advances by one token in one forward of the model: each reply keeps
its own ``DynamicCache``; a reply's prompt is prefilled on its own in the step it joins (the others
decode in that same step), and a finished or cancelled reply simply leaves the next batch.

Each reply's text is exactly what it is alone (greedy): the decode forward runs every row at its
own position over its own cache (:class:`~engines.rowbatch.RowsCache`), and only at row counts
measured to give every row of every projection the bits it gets alone (a reply alone steps
:data:`~engines.row_counts.REFERENCE_ROWS` rows, itself and filler rows):
:class:`~engines.row_counts.RowCounts` measures them per thread count at load, and a step whose
count is not one of them pads with filler rows to the next one or splits into several forwards.
The weights are read once per forward for all its replies: a memory-bound decode gets close to
one reply's step time for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from engines.row_counts import RowCounts
from engines.rowbatch import RowsCache, install_rows_attention, rows_mask_marker
from engines.speech.chat import IncrementalDetokenizer, Turn
from engines.speech.responder import CausalLmResponder


@dataclass(slots=True)
class Reply:
    """One reply being generated."""

    turn: Turn
    prompt: list[int]
    detok: IncrementalDetokenizer
    cache: DynamicCache | None = None  # None until prefilled
    next_id: int | None = None  # the token picked last, to feed next
    produced: int = 0  # tokens picked so far (max_tokens bounds it)
    done: bool = False
    deltas: list[str] = field(default_factory=list)  # text produced in the current step


class BatchedLm:
    """Steps many :class:`Reply` objects of one :class:`CausalLmResponder` together."""

    def __init__(self, lm: CausalLmResponder, *, num_threads: int | None = None) -> None:
        self.lm = lm
        self.model: Any = lm.model
        install_rows_attention(self.model.config)
        self.num_threads = num_threads
        self.row_counts = RowCounts(self.model)
        before = torch.get_num_threads()
        try:  # measured now, not in the first reply's step
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            self.row_counts.counts()
        finally:
            torch.set_num_threads(before)

    def reply(self, turn: Turn) -> Reply:
        """A new reply (raises ``ContextLengthExceeded`` when the prompt cannot fit)."""
        detok = IncrementalDetokenizer(self.lm.tokenizer)
        return Reply(turn=turn, prompt=self.lm.prompt_ids(turn), detok=detok)

    def step(self, replies: Sequence[Reply], tokens: int = 1) -> None:
        """Advance every reply by up to ``tokens`` tokens; text lands in ``reply.deltas``."""
        for reply in replies:
            reply.deltas = []
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            # Per step, on the thread that computes: OpenMP keeps the setting per thread.
            torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            for _ in range(max(1, tokens)):
                live = [r for r in replies if not r.done]
                if not live:
                    return
                fresh = [r for r in live if r.cache is None]
                decoding = [r for r in live if r.cache is not None]
                for reply in fresh:
                    self._prefill(reply)
                if decoding:
                    self._decode(decoding)

    # -- one token ----------------------------------------------------------------------------

    def _prefill(self, reply: Reply) -> None:
        if reply.turn.max_tokens <= 0:
            self._end(reply)
            return
        reply.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([reply.prompt], dtype=torch.long)
        out = self.model(
            input_ids=ids,
            cache=reply.cache,
            use_cache=True,
            attention_mask=None,
            **self.lm._extra,
        )
        self._pick(reply, out.logits[0, -1])

    def _decode(self, replies: Sequence[Reply]) -> None:
        start = 0
        for real, rows in self.row_counts.plan(len(replies)):
            self._forward(replies[start : start + real], rows)
            start += real

    def _forward(self, replies: Sequence[Reply], rows: int) -> None:
        """One decode forward of ``replies`` and ``rows - len(replies)`` filler rows."""
        ids = torch.zeros((rows, 1), dtype=torch.long)
        positions = torch.zeros((rows, 1), dtype=torch.long)
        caches: list[DynamicCache | None] = [None] * rows
        for i, reply in enumerate(replies):
            assert reply.cache is not None and reply.next_id is not None
            ids[i, 0] = reply.next_id
            positions[i, 0] = reply.cache.get_seq_length()
            caches[i] = reply.cache
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            cache=RowsCache(caches),
            attention_mask=rows_mask_marker(rows),
            use_cache=True,
            **self.lm._extra,
        )
        logits = out.logits[:, -1]
        for i, reply in enumerate(replies):
            self._pick(reply, logits[i])

    def _pick(self, reply: Reply, logits: torch.Tensor) -> None:
        """Greedy: the reply's next token; the end of the reply at a stop token or max_tokens
        (as :meth:`CausalLmResponder.respond`: the last picked token is never fed)."""
        next_id = int(logits.argmax())
        reply.produced += 1
        if next_id in self.lm._stop_ids and not reply.turn.ignore_eos:
            self._end(reply)
            return
        delta = reply.detok.feed([next_id])
        if delta:
            reply.deltas.append(delta)
        reply.next_id = next_id
        if reply.produced >= reply.turn.max_tokens:
            self._end(reply)

    def _end(self, reply: Reply) -> None:
        tail = reply.detok.flush()
        if tail:
            reply.deltas.append(tail)
        reply.done = True
        reply.cache = None  # frees the KV
        reply.next_id = None
