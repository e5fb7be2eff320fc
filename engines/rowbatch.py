"""Continuous batching of decode steps whose every row stays bit-identical to the row alone.

A decode step of several requests runs the ``transformers`` model once on a ``[B, 1, H]`` batch,
each row at its own position, each with its own ``DynamicCache``. Two things would make a row
differ in the last bits from the same request stepped alone, and greedy outputs then diverge:

* **Attention over padded caches.** A padded batch reduces each row's softmax over the longest
  cache, with a different blocking than its own length. Here :class:`RowsCache` appends each
  row's new key/value to that row's own cache and hands the attention a list of per-row caches;
  :func:`rows_attention` (installed as the model's attention implementation by
  :func:`install_rows_attention`) runs ``sdpa`` on each row over exactly its own cache, the call
  the model makes for that row alone (rows of equal lengths stacked into one call on one thread,
  where the kernel computes each row as alone: :func:`_attend_rows`). A plain tensor (any
  unbatched call, ``generate``) goes straight to ``sdpa`` with ``sdpa``'s mask: nothing changes
  for it.
* **Matrix products whose kernel depends on the row count.** A GEMM gives a row other bits at
  some row counts than at others, at counts that depend on the widths, the dtype, the thread
  count and the CPU (this host, AMD EPYC with MKL, float32: 1-3 rows differ from 4; at two
  threads 5-7 and 9-11 rows differ from 4, 8 and 12+; an earlier host changed at 16 rows for 576
  inputs), so no count is safe by assumption. Two formulations follow, chosen per engine:

  - :class:`RowExact` (Qwen3-Omni): every ``linear`` of a batched step computes each batch row
    as that row alone computes it (:func:`row_linear`: one broadcast batched product whose every
    entry is the one-row GEMV, or row by row where no such product keeps the bits), MoE routers
    the same way, and every MoE expert call once per token (:func:`install_rows_experts`). The
    batch saves the model's per-call overhead (the tiny model is overhead-bound), not FLOPs.
  - Measured row counts (the responder's dense LM, memory-bound,
    :class:`engines.row_counts.RowCounts`): one GEMM per weight for many rows, the weights read
    once for all of them, but only at row counts measured at load to give every row the bits of
    the 4-row product a reply alone runs (with filler rows).

  A packed prefill (:class:`Segments`) runs every product once per prompt (the row count the
  prompt has alone), the MoE experts too; norms, rotary and token-wise layers once over all
  tokens, attention once per prompt over its own keys.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ROWS_ATTENTION = "omniduplex_rows"
ROWS_EXPERTS = "omniduplex_rows"
MIN_GEMM_ROWS = 4  # fewer rows take other sgemm paths (more rows: at some counts too, see above)

# Below this many weight elements torch's bmm takes a naive kernel whose bits differ from a
# one-row mm; from it on, bmm runs each batch entry through the same GEMV as a one-row mm.
BMM_MIN_ELEMENTS = 400

_local = threading.local()


class RowKV(list[torch.Tensor]):
    """Per-row key (or value) states ``[1, heads, len_i, dim]`` of one layer in a batched step."""


class SegmentKV(list[torch.Tensor]):
    """Per-request key (or value) states of one layer in a packed prefill: entry i is request
    i's own cache after its segment ``bounds[i]`` of the packed sequence was appended."""

    def __init__(self, bounds: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        self.bounds = list(bounds)


class SegmentsCache:
    """The caches of the requests of one packed prefill: several prompts concatenated along the
    sequence (``[1, S, H]``, request i at ``bounds[i]``), each segment appended to its request's
    own (empty) cache. Passed as the model's ``cache`` with a ready 4-D mask marker, like
    :class:`RowsCache`; :func:`rows_attention` then runs each segment causally over its own keys,
    the call its prompt alone makes."""

    def __init__(self, rows: Sequence[DynamicCache], lengths: Sequence[int]) -> None:
        self.rows = list(rows)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for n in lengths:
            self.bounds.append((start, start + n))
            start += n

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[SegmentKV, SegmentKV]:
        keys, values = SegmentKV(self.bounds), SegmentKV(self.bounds)
        for cache, (a, b) in zip(self.rows, self.bounds, strict=True):
            k, v = cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # only fresh caches are packed


class Segments:
    """While active (on this thread), every product made row-exact by :func:`install_row_exact`
    (``nn.Linear``, MoE routers) and the MoE experts of :func:`install_rows_experts` run once per
    segment of the packed token sequence (``lengths``), at the row count each prompt has alone (a
    GEMM's row count changes a row's bits); every other layer runs once over all tokens."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __enter__(self) -> Segments:
        self._outer = getattr(_local, "segments", None)
        _local.segments = self.lengths
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.segments = self._outer


class RowsCache:
    """The caches of the rows of one batched step, updated row by row.

    ``rows[i]`` is request i's own cache (or None for a filler row: its key/value are its own
    token only and are dropped). Passed as the model's ``cache``; the model only calls
    :meth:`update` on it because the step also passes a ready 4-D attention mask marker.
    """

    def __init__(self, rows: Sequence[DynamicCache | None]) -> None:
        self.rows = list(rows)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[RowKV, RowKV]:
        keys, values = RowKV(), RowKV()
        for i, cache in enumerate(self.rows):
            k, v = key_states[i : i + 1], value_states[i : i + 1]
            if cache is not None:
                k, v = cache.update(k, v, layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The first real row's length: only asked (for default positions) when every row has
        the same length, as in the code predictor's fresh per-frame caches."""
        for cache in self.rows:
            if cache is not None:
                return cache.get_seq_length(layer_idx)
        return 0


def rows_mask_marker(batch: int) -> torch.Tensor:
    """A 4-D mask the model's mask builder passes through untouched; ignored by row attention
    (a decode row attends to all of its own cache)."""
    return torch.zeros((batch, 1, 1, 1), dtype=torch.bool)


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | RowKV,
    value: torch.Tensor | RowKV,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if isinstance(key, SegmentKV):
        assert isinstance(value, SegmentKV)
        queries = [query[:, :, a:b] for a, b in key.bounds]
        return torch.cat(_attend_rows(module, queries, key, value, kwargs), dim=1), None
    if not isinstance(key, RowKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[arg-type]
    assert isinstance(value, RowKV)
    queries = [query[i : i + 1] for i in range(query.shape[0])]
    return torch.cat(_attend_rows(module, queries, key, value, kwargs), dim=0), None


def _attend_rows(
    module: torch.nn.Module,
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    kwargs: dict[str, Any],
) -> list[torch.Tensor]:
    """Each row's ``sdpa`` over its own keys (``[1, heads, q_i, d]`` over ``[1, kv_heads, k_i, d]``),
    output ``[1, q_i, heads, d]`` per row. On one intra-op thread, rows with the same query and
    key lengths run as one batched ``sdpa`` (their keys stacked): the CPU kernel then computes
    every (row, head) on its own, with blocks sized by the lengths only, so a row's bits are those
    of its call alone (``test_rows_attention_groups_rows_of_equal_length_bitwise``), for one call
    instead of one per row (decode rows of requests whose caches have the same length, prompts of
    the same length). With more threads the kernel splits a lone row's keys across them and a
    batch's rows not, which changes the row's bits: every row runs alone there."""
    groups: dict[tuple[int, int], list[int]] = {}
    alone = torch.get_num_threads() > 1
    for i, (q, k) in enumerate(zip(queries, keys, strict=True)):
        groups.setdefault((i, 0) if alone else (q.shape[-2], k.shape[-2]), []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(queries)
    for rows in groups.values():
        if len(rows) == 1:
            i = rows[0]
            outs[i] = sdpa_attention_forward(module, queries[i], keys[i], values[i], None, **kwargs)[0]
            continue
        out = sdpa_attention_forward(
            module,
            torch.cat([queries[i] for i in rows]),
            torch.cat([keys[i] for i in rows]),
            torch.cat([values[i] for i in rows]),
            None,
            **kwargs,
        )[0]
        for j, i in enumerate(rows):
            outs[i] = out[j : j + 1]
    return [o for o in outs if o is not None]


def install_rows_attention(*configs: Any) -> None:
    """Make ``configs`` (text-model configs) use :func:`rows_attention`: ``sdpa`` for every
    ordinary call, per-row attention for a :class:`RowsCache` step."""
    ALL_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, rows_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, sdpa_mask)
    for config in configs:
        config._attn_implementation = ROWS_ATTENTION


def rows_experts(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The MoE experts as the model's default (``grouped_mm``) computes them; inside a
    :class:`RowExact` step with several tokens, the same arithmetic with each (token, expert)
    product computed as that token alone computes it (a one-row group), so a token's result does
    not depend on who else was routed to the same expert."""
    segments = getattr(_local, "segments", None)
    if segments is not None and not getattr(_local, "exact", False):
        parts, start = [], 0
        for n in segments:
            end = start + n
            parts.append(
                grouped_mm_experts_forward(
                    self, hidden_states[start:end], top_k_index[start:end], top_k_weights[start:end]
                )
            )
            start = end
        return torch.cat(parts, dim=0)
    if not getattr(_local, "exact", False) or hidden_states.shape[0] <= 1:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    experts: Any = self
    num_tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    rows = hidden_states.repeat_interleave(top_k, dim=0)  # row s: token s // top_k
    gate_up = row_products(rows, experts.gate_up_proj[expert_ids])
    act = experts._apply_gate(gate_up) if experts.has_gate else experts.act_fn(gate_up)
    out = row_products(act, experts.down_proj[expert_ids])
    weighted = out * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def row_products(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``x[s] @ weights[s].T`` for every row s (x ``[S, K]``, weights ``[S, N, K]``): one
    matrix-vector product per row, as a one-row ``mm`` computes it."""
    return torch.bmm(x.unsqueeze(1), weights.transpose(1, 2)).squeeze(1)


def install_rows_experts(*configs: Any) -> None:
    ALL_EXPERTS_FUNCTIONS.register(ROWS_EXPERTS, rows_experts)
    for config in configs:
        config._experts_implementation = ROWS_EXPERTS


class RowExact:
    """While active (on this thread), every ``nn.Linear`` and MoE router made row-exact by
    :func:`install_row_exact`, and every expert call of :func:`install_rows_experts`, runs once
    per batch row (dim 0) on a fresh copy of that row: exactly the call the row alone makes."""

    def __enter__(self) -> RowExact:
        self._outer = getattr(_local, "exact", False)
        _local.exact = True
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.exact = self._outer


def rows_exact(invariant: bool = True) -> contextlib.AbstractContextManager[Any]:
    """The context of a batched step's products: :class:`RowExact` (every row's bits its own,
    ``batch_invariant: true``) or nothing (``false``: plain batched GEMMs over the rows, routers
    and MoE experts over all tokens at once; a row's logits may differ from its run alone in the
    last bits, so a greedy choice can differ only where two candidates are that close)."""
    return RowExact() if invariant else contextlib.nullcontext()


def packed_experts(lengths: Sequence[int], invariant: bool = True) -> contextlib.AbstractContextManager[Any]:
    """The products of a packed prefill: once per prompt (:class:`Segments`: linear layers, MoE
    routers and experts, each prompt's bits its own) or, not ``invariant``, once over every token
    of the packed sequence."""
    return Segments(lengths) if invariant else contextlib.nullcontext()


def _row_exact_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() >= 2 and x.shape[0] > 1 and getattr(_local, "exact", False):
        return row_linear(x, self.weight, self.bias, owner=self)
    packed = _packed_tokens(x)
    if packed is not None:
        return _per_prompt(x, packed, lambda part: F.linear(part, self.weight, self.bias))
    return F.linear(x, self.weight, self.bias)


def _packed_tokens(x: torch.Tensor) -> int | None:
    """Inside :class:`Segments` (and no RowExact step): the dimension of ``x`` that holds the
    packed prompts' tokens (``[1, S, H]`` or ``[S, H]``), None where there is none."""
    lengths = getattr(_local, "segments", None)
    if lengths is None or len(lengths) < 2 or getattr(_local, "exact", False):
        return None
    total = sum(lengths)
    if x.dim() == 3 and x.shape[0] == 1 and x.shape[1] == total:
        return 1
    if x.dim() == 2 and x.shape[0] == total:
        return 0
    return None


def _per_prompt(x: torch.Tensor, dim: int, product: Any) -> torch.Tensor:
    """``product`` once per packed prompt (its tokens along ``dim``): the row count, and so the
    kernel, that prompt's product has alone."""
    parts, start = [], 0
    for n in _local.segments:
        parts.append(product(x.narrow(dim, start, n)))
        start += n
    return torch.cat(parts, dim=dim)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, owner: Any = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row of ``x`` (dim 0) computed as that row alone
    computes it. Rows ``[B, K]`` (a token each) or ``[B, T, K]`` (T tokens each) and at least 4
    outputs: one ``bmm`` over a stride-0 view of the transposed weight, whose every entry is the
    product ``F.linear`` runs on that row alone (a weight of fewer than :data:`BMM_MIN_ELEMENTS`
    elements is padded with zero rows up to it, which leaves the real outputs' bits as they are,
    so the product does not take bmm's naive small kernel); anything else row by row. ``owner``
    (the module holding ``weight``) keeps the prepared view between calls. (Per-row contiguous
    copies of the weight made each product faster alone but a batched talker frame slower:
    eight copies of every weight do not stay in cache.)"""
    rows = x.shape[0]
    # A bias is added after the product only where that was checked: one token per row.
    if x.dim() == 2 or (x.dim() == 3 and (bias is None or x.shape[1] == 1)):
        wt = _row_weight(weight, owner)
        if wt is not None:
            # [B, K]: one token per row; [B, T, K]: each row's T tokens, one GEMM each as alone
            out = torch.bmm(x.reshape(rows, -1, x.shape[-1]).contiguous(), wt.expand(rows, -1, -1))
            n = weight.shape[0]
            if out.shape[-1] != n:
                out = out[..., :n]
            if bias is not None:
                out = out + bias  # a one-row F.linear adds the bias to the finished product
            return out.reshape(*x.shape[:-1], n)
    return torch.cat([F.linear(x[i : i + 1].clone(), weight, bias) for i in range(rows)], dim=0)


TILE_ROWS = 64  # tile_linear: every product is a GEMM of exactly this many rows


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over rows ``x [P, K]`` whose every row's bits depend on that
    row only, whatever P: the rows are cut into tiles of :data:`TILE_ROWS` (the last padded with
    zero rows) and one ``bmm`` runs a GEMM of exactly that many rows per tile, so the kernel (and
    each row's reduction order) never changes with the number of rows; a row's place inside its
    tile did not change its bits either (measured on this CPU, 1 and 2 threads, 1-256 outputs,
    4-256 inputs; code2wav's tests check it through the decoder). For thousands of rows
    (code2wav's positions) this costs 1.1-1.5x one GEMM, against ~2x and more for one GEMV per row
    (:func:`row_linear`) and ~50x for that function's row-by-row fallback (fewer than 4 outputs).
    The bias is added after the product."""
    rows, inputs = x.shape
    pad = -rows % TILE_ROWS
    tiles = (F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()).view(-1, TILE_ROWS, inputs)
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], -1, -1))
    out = out.view(-1, weight.shape[0])[:rows]
    return out + bias if bias is not None else out


@dataclass(frozen=True, slots=True)
class _RowWeight:
    weight: torch.Tensor  # the parameter it was made from (identity and version checked)
    version: int
    transposed: torch.Tensor | None  # [1, K, P]; None: no batched product keeps the bits


def _row_weight(weight: torch.Tensor, owner: Any) -> torch.Tensor | None:
    """``weight`` [N, K] as a ``[1, K, P]`` view for :func:`row_linear` (P >= N: zero rows up to
    BMM_MIN_ELEMENTS elements), or None where no batched product keeps a row's bits (N < 4: a
    one-row product of so few outputs takes other paths; measured for N = 1)."""
    made = getattr(owner, "_rows_weight", None) if owner is not None else None
    if not (isinstance(made, _RowWeight) and made.weight is weight and made.version == weight._version):
        n, k = weight.shape
        transposed = None
        if n >= MIN_GEMM_ROWS:
            outputs = max(n, -(-BMM_MIN_ELEMENTS // k))
            padded = weight if outputs == n else torch.cat([weight, weight.new_zeros(outputs - n, k)])
            transposed = padded.t().unsqueeze(0)
        made = _RowWeight(weight, weight._version, transposed)
        if owner is not None:
            owner._rows_weight = made
    return made.transposed


def _row_exact_router(self: nn.Module, hidden_states: torch.Tensor) -> Any:
    """A MoE top-k router (transformers' ``TopKRouter.forward``) whose logits of every token are
    that token's alone (:func:`row_linear`) in a RowExact step, and each packed prompt's its own
    in a packed prefill (:class:`Segments`); softmax and top-k run per row."""
    router: Any = self
    flat = hidden_states.reshape(-1, router.hidden_dim)
    packed = _packed_tokens(flat)
    if packed is not None:
        logits = _per_prompt(flat, packed, lambda part: F.linear(part, router.weight))
    elif flat.shape[0] <= 1 or not getattr(_local, "exact", False):
        return router._plain_forward(hidden_states)
    else:
        logits = row_linear(flat, router.weight, owner=router)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top_value, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return logits, top_value.to(logits.dtype), indices


def install_row_exact(*modules: nn.Module, routers: tuple[type, ...] = ()) -> None:
    """Make every ``nn.Linear`` under ``modules`` row-exact inside :class:`RowExact` and once per
    prompt inside :class:`Segments` (unchanged outside both), and every MoE router of a
    ``routers`` type (they call ``F.linear`` on a flattened ``[tokens, hidden]`` view, then
    softmax and top-k per token)."""
    for root in modules:
        for module in root.modules():
            if getattr(module, "_row_exact", False):
                continue
            if isinstance(module, nn.Linear):
                module.forward = types.MethodType(_row_exact_linear, module)  # type: ignore[method-assign]
            elif routers and isinstance(module, routers):
                module._plain_forward = module.forward  # type: ignore[assignment]
                module.forward = types.MethodType(_row_exact_router, module)  # type: ignore[method-assign]
            else:
                continue
            module._row_exact = True  # type: ignore[assignment]
