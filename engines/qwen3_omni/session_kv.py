"""Thinker KV caches kept between a session's requests.

Entries live in a :class:`runtime.kv.SessionKVStore` (LRU under a byte budget): by default the
replica's own store (``budget.kv_bytes`` in the pipeline YAML, found with ``current_kv_store``);
with ``options["session_kv_bytes"]`` the engine keeps a private store of that size instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache


def cache_nbytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class SessionEntry:
    """A cache holding exactly ``len(keys)`` positions, and what the talker prompt needs of them."""

    cache: DynamicCache
    keys: list[int]
    accept_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # multimodal positions

    @property
    def nbytes(self) -> int:
        hidden = sum(t.numel() * t.element_size() for t in self.accept_hidden.values())
        return cache_nbytes(self.cache) + hidden
