"""Batched forwards of the thinker and the talker (engines.rowbatch).

Decodes take one new position per request (its own cache, its own position) and run the
``transformers`` module once for all of them under :class:`~engines.rowbatch.RowExact`;
prefills pack the prompts of several new requests along the sequence (:class:`SegmentsCache`,
:class:`Segments`) and run the module once for all of them. Either way every request's result
has the same bits as the same request's unbatched call. With ``invariant=False`` (the engines'
``batch_invariant: false``) the products run as plain batched GEMMs and the MoE experts over all
tokens at once (:func:`~engines.rowbatch.rows_exact`): faster at several rows, each row's
logits equal to its run alone up to the last float bits; attention stays per row either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from engines.qwen3_omni.model import LoadedModel
from engines.rowbatch import (
    MIN_GEMM_ROWS,
    RowsCache,
    SegmentsCache,
    packed_experts,
    rows_exact,
    rows_mask_marker,
)


def _positions(starts: Sequence[int]) -> torch.Tensor:
    """``[4, B, 1]`` text positions (audio-free rows: every RoPE channel the same)."""
    return torch.tensor(list(starts), dtype=torch.long).view(1, -1, 1).expand(4, -1, 1)


def thinker_logits(
    loaded: LoadedModel,
    embeds: Sequence[torch.Tensor],
    starts: Sequence[int],
    caches: Sequence[DynamicCache],
    invariant: bool = True,
) -> torch.Tensor:
    """Next-token logits ``[B, vocab]`` of B requests, each fed one embedding ``[1, 1, H]`` at
    position ``starts[i]`` on top of its own cache (which this extends by that position)."""
    thinker = loaded.model.thinker
    batch = len(embeds)
    with rows_exact(invariant):
        out = thinker.model.language_model(
            inputs_embeds=torch.cat(list(embeds), dim=0),
            position_ids=_positions(starts),
            cache=RowsCache(caches),
            attention_mask=rows_mask_marker(batch),
            use_cache=True,
        )
        return thinker.lm_head(out.last_hidden_state[:, -1])


def talker_hidden(
    loaded: LoadedModel,
    embeds: Sequence[torch.Tensor],
    starts: Sequence[int],
    caches: Sequence[DynamicCache],
    invariant: bool = True,
) -> torch.Tensor:
    """The talker's last hidden state ``[B, 1, D]`` after one input row per request."""
    batch = len(embeds)
    with rows_exact(invariant):
        out = loaded.model.talker.model(
            inputs_embeds=torch.cat(list(embeds), dim=0),
            position_ids=_positions(starts),
            cache=RowsCache(caches),
            attention_mask=rows_mask_marker(batch),
            use_cache=True,
        )
    return out.last_hidden_state[:, -1:]


def packable(prompt_length: int) -> bool:
    """Whether a prompt of this length is packed with others: at least MIN_GEMM_ROWS tokens (a
    packed prefill runs each prompt's products at its own row count, so shorter ones could pack
    too; they prefill alone as before)."""
    return prompt_length >= MIN_GEMM_ROWS


def _packed_positions(lengths: Sequence[int]) -> torch.Tensor:
    """``[4, 1, S]`` positions 0..L_i-1 of every packed prompt (text only: every channel equal)."""
    return torch.cat([torch.arange(n) for n in lengths]).view(1, 1, -1).expand(4, 1, -1)


def _packed(
    model: torch.nn.Module, embeds: Sequence[torch.Tensor], caches: Sequence[DynamicCache], invariant: bool
) -> torch.Tensor:
    """The last hidden state of each prompt ``[B, 1, D]``, prompts ``[1, L_i, H]`` prefilled
    from position 0 into their own empty caches in one forward."""
    lengths = [int(e.shape[1]) for e in embeds]
    with packed_experts(lengths, invariant):
        out = model(
            inputs_embeds=torch.cat(list(embeds), dim=1),
            position_ids=_packed_positions(lengths),
            cache=SegmentsCache(caches, lengths),
            attention_mask=rows_mask_marker(1),
            use_cache=True,
        )
    ends = torch.tensor(lengths).cumsum(0) - 1
    return out.last_hidden_state[0, ends].unsqueeze(1)


def thinker_prefill_logits(
    loaded: LoadedModel,
    embeds: Sequence[torch.Tensor],
    caches: Sequence[DynamicCache],
    invariant: bool = True,
) -> torch.Tensor:
    """Next-token logits ``[B, vocab]`` after each prompt, all prefilled in one forward."""
    thinker = loaded.model.thinker
    last = _packed(thinker.model.language_model, embeds, caches, invariant)
    with rows_exact(invariant):
        return thinker.lm_head(last)[:, -1]


def talker_prefill_hidden(
    loaded: LoadedModel,
    embeds: Sequence[torch.Tensor],
    caches: Sequence[DynamicCache],
    invariant: bool = True,
) -> torch.Tensor:
    """The talker's last hidden state ``[B, 1, D]`` after each prefill, all in one forward."""
    return _packed(loaded.model.talker.model, embeds, caches, invariant)
