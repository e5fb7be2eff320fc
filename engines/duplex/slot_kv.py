"""A KV cache with one fixed slot per session, so frames of several sessions run in one step.

Why not ``transformers``' ``DynamicCache``: it holds one sequence length for the whole batch,
so sessions that joined at different times (different positions, different histories) cannot
share a forward pass without re-padding every cached tensor each frame. Here every session
owns a *slot*: a ring of ``window`` positions per layer in one preallocated buffer. A step
binds the slots of the sessions it runs (:meth:`SlotKV.begin`), the model's attention layers
call :meth:`SlotKV.update` exactly as they call a ``transformers`` cache (it writes the new
keys/values into each session's ring and hands back that batch's rings), and the 4D mask from
``begin`` lets each query see only its own session's positions inside the sliding window.
Keys are stored after RoPE, so the order of entries in a ring does not matter: the mask, built
from each entry's absolute position, is the whole of the causal/sliding-window rule. This is
the same idea as Moshi's own ring KV cache, keyed by slot instead of by batch row.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKV:
    """Ring-buffer KV for ``slots`` sessions × ``layers`` attention layers."""

    def __init__(
        self, *, layers: int, slots: int, kv_heads: int, head_dim: int, window: int, max_new: int = 2,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if window < 1 or slots < 1 or max_new < 1:
            raise ValueError(f"SlotKV needs window, slots, max_new >= 1 (got {window}, {slots}, {max_new})")
        # A pass of n tokens overwrites n ring entries; the first of them must still see
        # `window` keys, so the ring holds window + max_new - 1 entries (the mask keeps `window`).
        self.capacity = window + max_new - 1
        self.max_new = max_new
        shape = (layers, slots, kv_heads, self.capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.window = window
        self.dtype = dtype
        # absolute position of each ring entry, -1 = empty; and tokens written per slot
        self.positions = torch.full((slots, self.capacity), -1, dtype=torch.long)
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self._slots: torch.Tensor | None = None
        self._ring_index: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def reset(self, slot: int) -> None:
        """Forget a slot's history (a new session takes it over)."""
        self.positions[slot] = -1
        self.lengths[slot] = 0

    def begin(self, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bind ``slots`` (int64 [B]) for a forward pass of ``n`` new tokens each.

        Returns ``(position_ids [B, n], mask [B, 1, n, capacity])``: the absolute positions of
        the new tokens and an additive float mask (0 = attend, dtype min = not).
        """
        if not 1 <= n <= self.max_new:
            raise ValueError(f"SlotKV.begin: {n} new tokens (at most {self.max_new})")
        start = self.lengths.index_select(0, slots)
        pos = start[:, None] + torch.arange(n)[None, :]
        ring = pos % self.capacity
        self.positions[slots[:, None], ring] = pos
        self.lengths[slots] = start + n
        key_pos = self.positions.index_select(0, slots)[:, None, :]  # [B, 1, W]
        query_pos = pos[:, :, None]  # [B, n, 1]
        allowed = (key_pos >= 0) & (key_pos <= query_pos) & (key_pos > query_pos - self.window)
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        self._slots, self._ring_index = slots, ring
        return pos, mask[:, None]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``transformers`` cache hook: store [B, H, n, D] new keys/values, return the rings."""
        if self._slots is None or self._ring_index is None:
            raise RuntimeError("SlotKV.update before begin()")
        slots, ring = self._slots, self._ring_index
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # advanced indices around a slice put the indexed dims first: [B, n, H, D]
        keys[slots[:, None], :, ring] = key_states.permute(0, 2, 1, 3).to(self.dtype)
        values[slots[:, None], :, ring] = value_states.permute(0, 2, 1, 3).to(self.dtype)
        return keys.index_select(0, slots), values.index_select(0, slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only read by model code when no position_ids are passed; callers always pass them.
        return 0
