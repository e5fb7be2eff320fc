"""Token selection shared by the thinker and the talker (one row of logits at a time)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0


def apply_repetition_penalty(logits: torch.Tensor, previous: Collection[int], penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on a 1-D row."""
    if penalty == 1.0 or not previous:
        return logits
    index = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
    score = logits.gather(0, index)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(0, index, score)


def mask_tokens(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """Set ``banned`` (a bool mask over the vocabulary, or None) to -inf."""
    if banned is None:
        return logits
    return logits.masked_fill(banned, float("-inf"))


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy argmax, or temperature / top-k / top-p sampling with a per-request generator."""
    row = logits.float().reshape(-1)
    if params.greedy:
        return int(torch.argmax(row).item())
    if params.temperature > 0 and params.temperature != 1.0:
        row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > params.top_p
        drop[0] = False
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def select_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """:func:`select_token` for every row of ``logits`` [B, V]: the greedy rows' argmax in one call
    (row by row it is the same first maximum), the sampling rows one by one with their own
    generators."""
    picked: list[int | None] = [None] * len(params)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for b, token in zip(greedy, rows.float().argmax(dim=-1).tolist(), strict=True):
            picked[b] = int(token)
    for b, p in enumerate(params):
        if picked[b] is None:
            picked[b] = select_token(logits[b], p, generators[b])
    return [int(t) for t in picked if t is not None]


def make_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
