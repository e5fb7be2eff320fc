"""Row counts at which a model's plain matrix products keep each row's bits, measured.

A dense decode batches its rows into one GEMM per weight so the weights are read once for all of
them, but a GEMM's kernel (and so the bits it gives a row) depends on the number of rows it
multiplies, in a way that depends on the widths, the dtype, the thread count and the CPU. Measured
on this host (AMD EPYC, MKL, float32): with one thread every count of 4 or more gives a row the
bits it gets in a 4-row product; with two threads 5-7 and 9-11 rows give other bits than 4, 8 and
12 or more; another host (the one the engines were written on) changed at 16 rows for 576 inputs.
So no count is assumed: :class:`RowCounts` multiplies random rows through every distinct weight
of the model at every count from :data:`REFERENCE_ROWS` up to a limit and keeps the counts at
which every row equals the same row in a :data:`REFERENCE_ROWS`-row product (what a reply stepped
alone runs, with filler rows), once per thread count; :meth:`RowCounts.plan` then splits a batch
into forwards of such counts (filler rows padding each; one reply alone pads to
:data:`REFERENCE_ROWS`), the fewest forwards first: a memory-bound decode reads every weight once
per forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

REFERENCE_ROWS = 4  # a reply alone steps this many rows (itself and filler rows)


class RowCounts:
    """The row counts at which every ``nn.Linear`` of ``model`` gives each row the bits of a
    :data:`REFERENCE_ROWS`-row product, up to ``limit`` rows, per thread count (measured at the
    first call on a thread count: a few products per distinct weight shape)."""

    def __init__(self, model: nn.Module, *, limit: int = 32) -> None:
        self.limit = max(limit, REFERENCE_ROWS)
        layers: dict[tuple[tuple[int, ...], torch.dtype, bool], nn.Linear] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                key = (tuple(module.weight.shape), module.weight.dtype, module.bias is not None)
                layers.setdefault(key, module)
        self.layers = list(layers.values())
        self._kept: dict[int, frozenset[int]] = {}

    def counts(self) -> frozenset[int]:
        """The row counts (``REFERENCE_ROWS`` to ``limit``) that keep every row's bits at the
        current thread count."""
        threads = torch.get_num_threads()
        if threads not in self._kept:
            self._kept[threads] = self._measure()
        return self._kept[threads]

    def plan(self, rows: int) -> tuple[tuple[int, int], ...]:
        """``rows`` split into forwards ``(real rows, rows with filler)``: one row padded to
        :data:`REFERENCE_ROWS` (the reply alone), several to one of :meth:`counts`; the fewest
        forwards, then the fewest rows."""
        return _plan(self.counts(), self.limit, rows)

    @torch.inference_mode()
    def _measure(self) -> frozenset[int]:
        kept = set(range(REFERENCE_ROWS, self.limit + 1))
        gen = torch.Generator().manual_seed(0)
        for layer in self.layers:
            weight, bias = layer.weight, layer.bias
            x = torch.randn(self.limit, 1, weight.shape[1], generator=gen).to(weight.dtype)
            alone = []
            for i in range(self.limit):
                rows = x.new_zeros(REFERENCE_ROWS, 1, weight.shape[1])
                rows[0] = x[i]
                alone.append(F.linear(rows, weight, bias)[:1])
            reference = torch.cat(alone)
            for count in sorted(kept):
                if not torch.equal(F.linear(x[:count], weight, bias), reference[:count]):
                    kept.discard(count)
        return frozenset(kept)


@functools.lru_cache(maxsize=1024)
def _plan(counts: frozenset[int], limit: int, rows: int) -> tuple[tuple[int, int], ...]:
    # One reply pads to REFERENCE_ROWS: what it runs alone. Several share a measured count.
    padded = {1: REFERENCE_ROWS}
    for n in range(2, limit + 1):
        fits = [c for c in counts if c >= max(n, REFERENCE_ROWS)]
        if fits:
            padded[n] = min(fits)
    Plan = tuple[tuple[int, int], tuple[tuple[int, int], ...]]  # (forwards, rows), forwards
    best: list[Plan] = [((0, 0), ())]
    for total in range(1, rows + 1):
        options = []
        for n, width in padded.items():
            if n <= total:
                (forwards, padded_rows), chunks = best[total - n]
                options.append(((forwards + 1, padded_rows + width), (*chunks, (n, width))))
        best.append(min(options))
    return best[rows][1]


class PromptRows:
    """Whether a prefill may pack several prompts into one forward and keep each prompt's bits.

    A prompt prefilled alone multiplies its ``L`` tokens as one ``L``-row product per weight; packed
    with others, as rows of one ``T``-row product. Both give a row the bits it gets in a
    :data:`REFERENCE_ROWS`-row product when both counts do, so :meth:`keeps` measures a count (once
    per thread count) against :data:`REFERENCE_ROWS`-row products of the same random rows, for every
    distinct ``nn.Linear`` of ``model`` (the decoder without its head: a packed prefill runs the
    head on each prompt's last row alone, as a prompt alone does). Counts above ``limit`` are never
    packed."""

    def __init__(self, model: nn.Module, *, limit: int = 1024) -> None:
        self.limit = limit
        self.layers = RowCounts(model).layers
        self._rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # threads -> (x, ref)
        self._kept: dict[tuple[int, int], bool] = {}

    def prepare(self) -> None:
        """The reference products at the current thread count (a few hundred small products)."""
        self._reference(torch.get_num_threads())

    def keeps(self, count: int) -> bool:
        """Whether ``count`` rows give every row of every product its reference bits (measured on
        first use per thread count: one ``count``-row product per distinct weight)."""
        if not REFERENCE_ROWS <= count <= self.limit:
            return False
        threads = torch.get_num_threads()
        key = (threads, count)
        if key not in self._kept:
            self._kept[key] = self._measure(threads, count)
        return self._kept[key]

    @torch.inference_mode()
    def _measure(self, threads: int, count: int) -> bool:
        for layer, (x, reference) in zip(self.layers, self._reference(threads), strict=True):
            if not torch.equal(F.linear(x[:, :count], layer.weight, layer.bias), reference[:, :count]):
                return False
        return True

    @torch.inference_mode()
    def _reference(self, threads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if threads not in self._rows:
            gen = torch.Generator().manual_seed(0)
            rows = self.limit + REFERENCE_ROWS - self.limit % REFERENCE_ROWS
            pairs = []
            for layer in self.layers:
                weight, bias = layer.weight, layer.bias
                x = torch.randn(rows, 1, weight.shape[1], generator=gen).to(weight.dtype)
                chunks = range(0, rows, REFERENCE_ROWS)
                reference = torch.cat([F.linear(x[i : i + REFERENCE_ROWS], weight, bias) for i in chunks])
                pairs.append((x.reshape(1, rows, -1), reference.reshape(1, rows, -1)))
            self._rows[threads] = pairs
        return self._rows[threads]
