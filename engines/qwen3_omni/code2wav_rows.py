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
other bits, in a batch than alone. Here every kind of convolution has one fixed kernel whose bits
per output position do not depend on the batch size, the row's length or what the other rows hold
(measured on this CPU; ``tests/engines_qwen/test_batching.py`` checks it on the machine it runs
on), and a row alone runs the same kernels:

* dense and depthwise convolutions with a kernel wider than 1: oneDNN (``mkldnn_convolution``);
* 1-wide convolutions and the transposed convolutions: ATen's im2col + GEMM (``thnn_conv2d``,
  ``slow_conv_transpose2d``), whose GEMM runs the positions as columns, at least
  :data:`MIN_COLUMNS` of them (1 to 3 take another path): shorter inputs get zero columns on the
  right, which only reach the trimmed or padded samples;
* the ConvNeXt blocks' per-position layers: one product over every position of the batch, at least
  :data:`MIN_COLUMNS` rows. NOT exact in general: MKL's float32 sgemm changes a row's bits at a
  row count that grows with the input width (measured: 256 inputs, pwconv2 here, one regime for
  2-10 rows and another from 11), so a short window alone and in a batch can differ in the last
  bits there. The tiny model's samples stay bit-identical only because its random layer scale
  (``gamma``, ~1e-6) rounds that difference away; with trained weights it would not. Open.

So the samples differ from ``code2wav(window[None])`` by float rounding (~1e-6 of the peak), and
a batch of first chunks pays each kernel's call once instead of once per row. Where those kernels
were not measured (another dtype or device, no oneDNN: :func:`fixed_kernels`), each window runs
the model's forward on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from engines.rowbatch import RowExact

Lengths = list[int]

MIN_COLUMNS = 4  # MKL's sgemm: one code path for 4 or more rows (columns), others below


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
    """``Qwen3OmniMoeCausalConvNet`` (stride 1): left zero padding (already there if ``padded``),
    then the fixed kernel."""
    conv = block.conv
    if conv.stride[0] != 1:
        raise TypeError("code2wav: strided causal convolutions have no batched rule")
    weight = conv.weight[:, :, None]  # 1-D as 2-D: [O, C/groups, 1, K]
    if conv.kernel_size[0] == 1:
        columns = x.shape[-1]
        x = _at_least_columns(x)[:, :, None]
        out = torch.ops.aten.thnn_conv2d(x, weight, [1, 1], conv.bias, [1, 1], [0, 0])
        return out[:, :, 0, :columns]
    if not padded:
        x = F.pad(x, (block.padding, 0))
    dilation = [1, conv.dilation[0]]
    out = torch.mkldnn_convolution(x[:, :, None], weight, conv.bias, [0, 0], [1, 1], dilation, conv.groups)
    return out[:, :, 0]


def _transposed(block: Any, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3OmniMoeCausalTransConvNet``: im2col + GEMM over at least :data:`MIN_COLUMNS`
    input positions, then the model's trim."""
    conv = block.conv
    columns = x.shape[-1]
    x = _at_least_columns(x)[:, :, None]
    stride, kernel = conv.stride[0], conv.kernel_size[0]
    out = torch.ops.aten.slow_conv_transpose2d(
        x, conv.weight[:, :, None], [1, kernel], conv.bias, [1, stride], [0, 0], [0, 0], [1, 1]
    )[:, :, 0]
    full = (columns - 1) * stride + kernel  # the model's output length before its trim
    return out[:, :, block.left_pad : full - block.right_pad]


def _at_least_columns(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, with zero columns on the right up to :data:`MIN_COLUMNS`."""
    if x.shape[-1] < MIN_COLUMNS:
        return F.pad(x, (0, MIN_COLUMNS - x.shape[-1]))
    return x.contiguous()


def _snake(block: Any, x: torch.Tensor, left: int = 0) -> torch.Tensor:
    """``Qwen3OmniMoeSnakeBeta``, ``x + 1/(e^β + ε) · sin(x·e^α)²`` (the model's operations in its
    order, so its bits), in one new tensor with ``left`` zero columns before it."""
    alpha = block.alpha.exp()[None, :, None]
    inverse = 1.0 / (block.beta.exp()[None, :, None] + block.no_div_by_zero)
    batch, channels, columns = x.shape
    buffer = x.new_empty(batch, channels, left + columns)
    buffer[:, :, :left].zero_()
    out = torch.mul(x, alpha, out=buffer[:, :, left:]).sin_()
    out.mul_(out).mul_(inverse).add_(x)
    return buffer


def _convnext(block: Any, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3OmniMoeConvNeXtBlock``: its depthwise convolution, then its per-position layers as
    one product over every position of the batch (at least :data:`MIN_COLUMNS`)."""
    h = _causal(block.dwconv, x).permute(0, 2, 1)
    batch, positions, channels = h.shape
    flat = h.reshape(batch * positions, channels)
    flat = F.pad(flat, (0, 0, 0, max(0, MIN_COLUMNS - flat.shape[0])))
    flat = block.pwconv2(block.act(block.pwconv1(block.norm(flat))))[: batch * positions]
    h = (block.gamma * flat).reshape(batch, positions, channels).permute(0, 2, 1)
    return x + h
