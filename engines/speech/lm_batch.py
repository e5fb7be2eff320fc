"""Continuous batching for the transformers responder (``speech.responder`` with an LM).

Every live reply of a step advances by one token in one forward of the model: each reply keeps
its own ``DynamicCache``; the prompts of the replies that join in a step are prefilled in that step
(packed into one forward where the measured row counts allow it:
:class:`~engines.row_counts.PromptRows`), the others decoding in the same step, and a finished or
cancelled reply simply leaves the next batch.

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

from engines.row_counts import PromptRows, RowCounts
from engines.rowbatch import RowsCache, SegmentsCache, install_rows_attention, rows_mask_marker
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
        self.prompt_rows = PromptRows(self.model.get_decoder())
        # Packing runs the decoder, then the head on each prompt's last row as the model's forward
        # does for Llama (SmolLM2); other models may scale or cap their logits: not packed.
        self.packs = self.model.config.model_type == "llama"
        before = torch.get_num_threads()
        try:  # measured now, not in the first reply's step
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            self.row_counts.counts()
            self.prompt_rows.prepare()
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
                self._prefill_all(fresh)
                if decoding:
                    self._decode(decoding)

    # -- one token ----------------------------------------------------------------------------

    def _prefill_all(self, replies: Sequence[Reply]) -> None:
        """Every fresh reply's prompt: packed into forwards of up to ``prompt_rows.limit`` tokens
        where every prompt's length and the packed length keep each row's bits (one GEMM per
        weight over several prompts reads each weight once: 7 prompts of ~56 tokens ~1.1 -> ~0.9 s
        at one thread on this host), else one forward per prompt."""
        group: list[Reply] = []
        for reply in replies:
            if reply.turn.max_tokens <= 0:
                self._end(reply)
            elif not self.prompt_rows.keeps(len(reply.prompt)):
                self._prefill(reply)
            else:
                if sum(len(r.prompt) for r in group) + len(reply.prompt) > self.prompt_rows.limit:
                    self._prefill_packed(group)
                    group = []
                group.append(reply)
        self._prefill_packed(group)

    def _prefill_packed(self, replies: Sequence[Reply]) -> None:
        lengths = [len(r.prompt) for r in replies]
        if len(replies) < 2 or not self.packs or not self.prompt_rows.keeps(sum(lengths)):
            for reply in replies:
                self._prefill(reply)
            return
        caches = [DynamicCache(config=self.model.config) for _ in replies]
        ids = torch.tensor([[t for r in replies for t in r.prompt]], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        hidden = self.model.get_decoder()(
            input_ids=ids,
            position_ids=positions,
            cache=SegmentsCache(caches, lengths),
            attention_mask=rows_mask_marker(1),
            use_cache=True,
        ).last_hidden_state
        end = 0
        for reply, cache, n in zip(replies, caches, lengths, strict=True):
            end += n
            # the head on the prompt's last row alone, as logits_to_keep=1 runs it alone
            logits = self.model.get_output_embeddings()(hidden[:, end - 1 : end, :])
            reply.cache = cache
            self._pick(reply, logits[0, -1])

    def _prefill(self, reply: Reply) -> None:
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
