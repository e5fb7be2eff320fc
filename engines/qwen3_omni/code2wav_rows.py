"""code2wav over windows of several requests and different lengths in one call, each request's
samples bit-identical to its window decoded alone (``decode_windows([window])``).

* **Embedding and transformer** run once per group of equal-length windows under
  :class:`~engines.rowbatch.RowExact` (one-row products, per-row attention); windows of another
  length are another group: padding would change each row's attention reductions.
* **Convolutional tail** runs once for all windows, right-padded to the longest. Every stage is
  causal except the transposed convolutions' one-frame lookahead, which the model trims, so a
  window's own samples never depend on what follows it: each row's valid prefix is tracked
  through every stage and its samples are that prefix.

The model's own forward lets ATen pick each convolution's kernel by shape (oneDNN for a batch or a
long input, otherwise im2col + GEMM or a dilated loop), so a row takes other kernels, and gets
other bits, in a batch than alone. A GEMM's kernel also changes with the number of rows (or
columns) it multiplies, at counts that depend on the widths, the thread count and the CPU (this
machine, an AMD EPYC under MKL: an im2col GEMM over 64 input channels gives a position other bits
at 4 columns than at 5 to 16), so no product here is one GEMM over a count that varies with the
batch. Instead:

* every per-position product computes each position as that position alone computes it: the
  ConvNeXt blocks' ``pwconv1`` / ``pwconv2`` as :func:`~engines.rowbatch.row_linear` (one ``bmm``
  of one matrix-vector product per position, computed the same way whatever the number of
  entries: 1 to 20,000 measured at these widths, 1 and 2 threads); the 1-wide convolutions of
  more than :data:`ELEMENTWISE_MAX_INPUTS` input channels and the transposed convolutions'
  ``C_out × kernel`` products of each input position, thousands of positions, as
  :func:`~engines.rowbatch.tile_linear` (GEMMs of a fixed 64 rows each, the last tile
  zero-padded: 1.1-1.5x one GEMM, where one GEMV per position cost ~2x and the row-by-row
  fallback of a 4 x 4 weight far more); a transposed convolution then overlap-adds its positions'
  products elementwise in a fixed order, each straight from its strided view;
* a 1-wide convolution of at most :data:`ELEMENTWISE_MAX_INPUTS` input channels (in the last two
  decoder blocks: 8 and 4 channels over 2,000-7,000 positions per window) as elementwise
  multiply-adds over the whole batch, input channel after input channel (:func:`_pointwise`):
  every sample is the same sequence of single-rounded products and sums whatever the batch; a
  64-row GEMM tile of 4 or 8 inputs cost 3-4x that (its per-tile overhead, not arithmetic);
* dense and depthwise convolutions with a kernel wider than 1 run oneDNN's convolution
  (``mkldnn_convolution``), whose bits per output position did not vary with the batch size, the
  row's length or the other rows in any case measured (1 and 2 threads).

``tests/engines_qwen/test_batching.py`` checks both on the machine it runs on, with the ConvNeXt
layer scale at 1 (the tiny model's random 1e-6 hides a difference there). A row alone runs the
same kernels, so the samples differ from ``code2wav(window[None])`` by float rounding (~1e-6 of
the peak), and a batch of first chunks pays each call once instead of once per row. Where those
kernels were not measured (another dtype or device, no oneDNN: :func:`fixed_kernels`), each window
runs the model's own forward on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from engines.rowbatch import RowExact, row_linear, tile_linear

Lengths = list[int]

# A 1-wide convolution of at most this many input channels runs as elementwise multiply-adds
# (:func:`_pointwise`); wider ones as tile_linear GEMMs (at 16 inputs the 32 elementwise ops per
# convolution cost more than the tiles).
ELEMENTWISE_MAX_INPUTS = 8


def decode_windows(code2wav: Any, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Samples ``[1920·T_i − 555]`` of each window ``[num_quantizers, T_i]`` (int64 codes), each
    bit-identical to ``decode_windows(code2wav, [window])[0]``, whatever the other windows."""
    quantizers = code2wav.config.num_quantizers
    if not windows:
        raise ValueError("code2wav: no windows to decode")
    for window in windows:
        if window.dim() != 2 or window.shape[0] != quantizers or window.shape[1] < 1:
            raise ValueError(f"code2wav: a window must be [{quantizers}, T >= 1], got {tuple(window.shape)}")
    if not fixed_kernels(code2wav):
        return [code2wav(window[None])[0, 0] for window in windows]
    lengths = [int(w.shape[1]) for w in windows]
    hidden = _transformer(code2wav, windows, lengths)
    longest = max(lengths)
    x = torch.cat([F.pad(h, (0, 0, 0, longest - h.shape[1])) for h in hidden]).permute(0, 2, 1)
    for blocks in code2wav.upsample:
        x, lengths = _sequence(blocks, x, lengths)
    x, lengths = _sequence(code2wav.decoder, x, lengths)
    wav = x.clamp_(min=-1, max=1)
    return [wav[i, 0, :n] for i, n in enumerate(lengths)]


def fixed_kernels(code2wav: Any) -> bool:
    """Whether the fixed kernels below exist for this model: float32 on a CPU with oneDNN (where
    they were measured). Elsewhere every window runs the model's own forward, one call each."""
    weight = code2wav.code_embedding.weight
    return bool(
        weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def _transformer(code2wav: Any, windows: Sequence[torch.Tensor], lengths: Lengths) -> list[torch.Tensor]:
    """The embedding and pre-transformer, ``[1, T_i, H]`` per window, one forward per length."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    hidden: list[torch.Tensor | None] = [None] * len(windows)
    for rows in by_length.values():
        codes = torch.stack([windows[i] for i in rows])
        with RowExact():
            embedded = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
            out = code2wav.pre_transformer(inputs_embeds=embedded).last_hidden_state
        for row, i in enumerate(rows):
            hidden[i] = out[row : row + 1]
    return [h for h in hidden if h is not None]


def _sequence(
    blocks: Sequence[torch.nn.Module], x: torch.Tensor, lengths: Lengths
) -> tuple[torch.Tensor, Lengths]:
    """Stages one after another; an activation that feeds a causal convolution writes its output
    after the convolution's zero padding (one allocation instead of the output and a padded copy)."""
    i = 0
    while i < len(blocks):
        block, after = blocks[i], blocks[i + 1] if i + 1 < len(blocks) else None
        if isinstance(block, qm.Qwen3OmniMoeSnakeBeta) and isinstance(after, qm.Qwen3OmniMoeCausalConvNet):
            x = _causal(after, _snake(block, x, _left_padding(after)), padded=True)
            i += 2
        else:
            x, lengths = _stage(block, x, lengths)
            i += 1
    return x, lengths


def _stage(block: torch.nn.Module, x: torch.Tensor, lengths: Lengths) -> tuple[torch.Tensor, Lengths]:
    """One stage of the tail over the padded batch ``[B, C, T]``; the rows' valid lengths after it."""
    if isinstance(block, qm.Qwen3OmniMoeCausalTransConvNet):
        stride, kernel = block.conv.stride[0], block.conv.kernel_size[0]
        return _transposed(block, x), [(n + 1) * stride - kernel for n in lengths]
    if isinstance(block, qm.Qwen3OmniMoeCausalConvNet):
        return _causal(block, x), lengths
    if isinstance(block, qm.Qwen3OmniMoeSnakeBeta):
        return _snake(block, x), lengths
    if isinstance(block, qm.Qwen3OmniMoeCode2WavDecoderResidualUnit):
        h, _ = _sequence([block.act1, block.conv1, block.act2, block.conv2], x, lengths)
        return h.add_(x), lengths
    if isinstance(block, qm.Qwen3OmniMoeCode2WavDecoderBlock):
        return _sequence(list(block.block), x, lengths)
    if isinstance(block, qm.Qwen3OmniMoeConvNeXtBlock):
        return _convnext(block, x), lengths
    raise TypeError(f"code2wav: no batched rule for {type(block).__name__}")


def _left_padding(block: Any) -> int:
    """Zero columns a causal convolution's input gets on the left (none for a 1-wide one)."""
    return int(block.padding) if block.conv.kernel_size[0] > 1 else 0


def _causal(block: Any, x: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """``Qwen3OmniMoeCausalConvNet`` (stride 1): a 1-wide one as elementwise multiply-adds (few input
    channels) or a per-position product; a wider
    one as left zero padding (already there if ``padded``), then oneDNN's convolution."""
    conv = block.conv
    if conv.stride[0] != 1:
        raise TypeError("code2wav: strided causal convolutions have no batched rule")
    if conv.kernel_size[0] == 1 and conv.groups == 1 and conv.in_channels <= ELEMENTWISE_MAX_INPUTS:
        return _pointwise(conv, x)
    if conv.kernel_size[0] == 1 and conv.groups == 1:
        batch, _, columns = x.shape
        flat = x.permute(0, 2, 1).reshape(batch * columns, -1)
        out = _positions(conv, lambda w: w[:, :, 0], flat, conv.bias)
        return out.view(batch, columns, -1).permute(0, 2, 1)
    if not padded:
        x = F.pad(x, (block.padding, 0))
    weight = conv.weight[:, :, None]  # 1-D as 2-D: [O, C/groups, 1, K]
    dilation = [1, conv.dilation[0]]
    out = torch.mkldnn_convolution(x[:, :, None], weight, conv.bias, [0, 0], [1, 1], dilation, conv.groups)
    return out[:, :, 0]


def _transposed(block: Any, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3OmniMoeCausalTransConvNet``: each input position's ``[C_out, kernel]`` products
    (:func:`_positions`), overlap-added in a fixed order (the ``kernel / stride`` contributions
    to an output position summed first to last, then the bias), then the model's trim."""
    conv = block.conv
    stride, kernel = conv.stride[0], conv.kernel_size[0]
    if kernel % stride or conv.groups != 1 or conv.padding[0] or conv.dilation[0] != 1:
        raise TypeError("code2wav: this transposed convolution has no batched rule")
    batch, channels, columns = x.shape
    out_channels = conv.out_channels
    flat = x.permute(0, 2, 1).reshape(batch * columns, channels)
    cols = _positions(conv, lambda w: w.reshape(channels, -1).t(), flat, None)
    cols = cols.view(batch, columns, out_channels, kernel).permute(0, 2, 1, 3)  # [B, O, T, kernel]
    full = (columns - 1) * stride + kernel  # the model's output length before its trim
    out = x.new_zeros(batch, out_channels, full)
    # out as [B, O, full / stride, stride]: contribution q of input position t lands in span t + q
    spans = out.view(batch, out_channels, full // stride, stride)
    for q in range(kernel // stride):
        spans[:, :, q : q + columns] += cols[..., q * stride : (q + 1) * stride]
    if conv.bias is not None:
        out += conv.bias[None, :, None]
    return out[:, :, block.left_pad : full - block.right_pad]


def _pointwise(conv: Any, x: torch.Tensor) -> torch.Tensor:
    """A 1-wide convolution ``[B, C, T] -> [B, O, T]`` as ``x[:, 0] * w[:, 0] + ... + x[:, C-1] *
    w[:, C-1] (+ bias)``, one elementwise product and sum per input channel in channel order: each
    output sample's bits depend on its own inputs only (no reduction kernel, nothing chosen by
    shape). The weight's columns ``[1, O, 1]`` are made once per weight version and kept on ``conv``."""
    weight = conv.weight
    kept = getattr(conv, "_c2w_pointwise", None)
    key = (weight._version, weight.data_ptr(), weight.dtype)
    if kept is None or kept[0] is not weight or kept[1] != key:
        with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
            columns = tuple(weight.detach()[None, :, c].clone() for c in range(weight.shape[1]))
        kept = (weight, key, columns)
        conv._c2w_pointwise = kept
    columns = kept[2]
    out = x[:, 0:1] * columns[0]
    term = torch.empty_like(out)
    for c in range(1, len(columns)):
        out.add_(torch.mul(x[:, c : c + 1], columns[c], out=term))
    if conv.bias is not None:
        out.add_(conv.bias[None, :, None])
    return out


def _positions(
    module: Any, flatten: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [P, K] @ W.T (+ bias)`` for every position P, each position's product computed as that
    position alone computes it (:func:`~engines.rowbatch.tile_linear`: GEMMs of a fixed number of
    rows, whatever the number of positions); ``W = flatten(module.weight)`` ``[N, K]``,
    made once per weight version and kept on ``module``."""
    weight = module.weight
    kept = getattr(module, "_c2w_positions", None)
    key = (weight._version, weight.data_ptr(), weight.dtype)
    if kept is None or kept[0] is not weight or kept[1] != key:
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            flat = flatten(weight.detach()).contiguous()
        kept = (weight, key, flat)
        module._c2w_positions = kept
    return tile_linear(x, kept[2], bias)


def _snake(block: Any, x: torch.Tensor, left: int = 0) -> torch.Tensor:
    """``Qwen3OmniMoeSnakeBeta``, ``x + 1/(e^β + ε) · sin(x·e^α)²`` (the model's operations in its
    order), in one new tensor with ``left`` zero columns before it. The sine is NumPy's, in place
    on the tensor's memory (:func:`sine_in_place`)."""
    alpha = block.alpha.exp()[None, :, None]
    inverse = 1.0 / (block.beta.exp()[None, :, None] + block.no_div_by_zero)
    batch, channels, columns = x.shape
    buffer = x.new_empty(batch, channels, left + columns)
    buffer[:, :, :left].zero_()
    out = sine_in_place(torch.mul(x, alpha, out=buffer[:, :, left:]))
    out.mul_(out).mul_(inverse).add_(x)
    return buffer


def sine_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x.sin_()`` with NumPy's float32 sine: under half the time of ATen's on an AVX-512 host
    (152k samples: 88 against 200 µs, 1 thread; the tail's sines a third of a first chunk's
    decode there), ~7 % slower than ATen's on an AVX2-only one (Zen 3: 45.6 against 42.6 µs for
    28.5k samples; docs/benchmarks.md, issue 31, ninth and tenth rounds). Elementwise, so each
    sample's bits depend on its own input only: the same in a window alone and in a batch, and a
    sample's bits did not change with its offset in the array, the array's length or a strided
    view (``tests/engines_qwen/test_batching.py``).
    Within 6e-8 of the exact sine, like ATen's (4e-8)."""
    array = x.numpy()
    np.sin(array, out=array)
    return x


def _convnext(block: Any, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3OmniMoeConvNeXtBlock``: its depthwise convolution, then its per-position layers,
    every position's products computed as that position alone computes them (:func:`row_linear`)."""
    h = _causal(block.dwconv, x).permute(0, 2, 1)
    batch, positions, channels = h.shape
    flat = block.norm(h.reshape(batch * positions, channels))
    flat = row_linear(flat, block.pwconv1.weight, block.pwconv1.bias, owner=block.pwconv1)
    flat = row_linear(block.act(flat), block.pwconv2.weight, block.pwconv2.bias, owner=block.pwconv2)
    h = (block.gamma * flat).reshape(batch, positions, channels).permute(0, 2, 1)
    return x + h
