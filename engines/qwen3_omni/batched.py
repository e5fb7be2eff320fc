"""Batched decode forwards of the thinker, the talker and the code predictor (engines.rowbatch).

Each takes one new position per request (its own cache, its own position) and runs the
``transformers`` module once for all of them under :class:`~engines.rowbatch.RowExact`, so
every row's result has the same bits as the same request's unbatched call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from engines.qwen3_omni.model import LoadedModel
from engines.rowbatch import RowExact, RowsCache, rows_mask_marker


def _positions(starts: Sequence[int]) -> torch.Tensor:
    """``[4, B, 1]`` text positions (audio-free rows: every RoPE channel the same)."""
    return torch.tensor(list(starts), dtype=torch.long).view(1, -1, 1).expand(4, -1, 1)


def thinker_logits(
    loaded: LoadedModel, embeds: Sequence[torch.Tensor], starts: Sequence[int], caches: Sequence[DynamicCache]
) -> torch.Tensor:
    """Next-token logits ``[B, vocab]`` of B requests, each fed one embedding ``[1, 1, H]`` at
    position ``starts[i]`` on top of its own cache (which this extends by that position)."""
    thinker = loaded.model.thinker
    batch = len(embeds)
    with RowExact():
        out = thinker.model.language_model(
            inputs_embeds=torch.cat(list(embeds), dim=0),
            position_ids=_positions(starts),
            cache=RowsCache(caches),
            attention_mask=rows_mask_marker(batch),
            use_cache=True,
        )
        return thinker.lm_head(out.last_hidden_state[:, -1])


def talker_hidden(
    loaded: LoadedModel, embeds: Sequence[torch.Tensor], starts: Sequence[int], caches: Sequence[DynamicCache]
) -> torch.Tensor:
    """The talker's last hidden state ``[B, 1, D]`` after one input row per request."""
    batch = len(embeds)
    with RowExact():
        out = loaded.model.talker.model(
            inputs_embeds=torch.cat(list(embeds), dim=0),
            position_ids=_positions(starts),
            cache=RowsCache(caches),
            attention_mask=rows_mask_marker(batch),
            use_cache=True,
        )
    return out.last_hidden_state[:, -1:]
