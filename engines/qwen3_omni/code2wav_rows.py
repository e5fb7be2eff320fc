"""code2wav over windows of several requests and different lengths in one call, each request's
samples bit-identical to its window decoded alone (``code2wav(codes)``).

* **Embedding and transformer** run once per group of equal-length windows under
  :class:`~engines.rowbatch.RowExact` (one-row products, per-row attention); windows of another
  length are another group: padding would change each row's attention reductions.
* **Convolutional tail** runs once for all windows, right-padded to the longest. Every stage is
  causal except the transposed convolutions' one-frame lookahead, which the model trims, so a
  window's own samples never depend on what follows it: each row's valid prefix is tracked
  through every stage and its samples are that prefix. Two kinds of kernels give a row other
  bits in a batch than alone (measured on this CPU's oneDNN): the dense convolutions with a
  kernel wider than 1 and the transposed convolutions (a short input takes another algorithm per
  batch size and length). Those run per row on the row's own valid prefix (a fresh contiguous
  copy: the input's alignment also picks the algorithm) and are padded back; the elementwise
  activations, the 1-wide and depthwise convolutions and the ConvNeXt blocks' per-position
  layers run batched. The tiny model's tail is overhead-bound at the first chunk's 4 frames, so a
  batch of first chunks costs well under the sum of the rows alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qm

from engines.rowbatch import RowExact

Lengths = list[int]


def decode_windows(code2wav: Any, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Samples ``[1920·T_i − 555]`` of each window ``[num_quantizers, T_i]`` (int64 codes),
    each bit-identical to ``code2wav(window[None])[0, 0]``."""
    quantizers = code2wav.config.num_quantizers
    for window in windows:
        if window.dim() != 2 or window.shape[0] != quantizers or window.shape[1] < 1:
            raise ValueError(f"code2wav: a window must be [{quantizers}, T >= 1], got {tuple(window.shape)}")
    lengths = [int(w.shape[1]) for w in windows]
    hidden = _transformer(code2wav, windows, lengths)
    longest = max(lengths)
    x = torch.cat([F.pad(h, (0, 0, 0, longest - h.shape[1])) for h in hidden]).permute(0, 2, 1)
    for blocks in code2wav.upsample:
        for block in blocks:
            x, lengths = _stage(block, x, lengths)
    for block in code2wav.decoder:
        x, lengths = _stage(block, x, lengths)
    wav = x.clamp(min=-1, max=1)
    return [wav[i, 0, :n] for i, n in enumerate(lengths)]


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


def _stage(block: torch.nn.Module, x: torch.Tensor, lengths: Lengths) -> tuple[torch.Tensor, Lengths]:
    """One stage of the tail over the padded batch; the rows' valid lengths after it."""
    x = x.contiguous()  # a permuted input would take other kernels than the row alone does
    if isinstance(block, qm.Qwen3OmniMoeCausalTransConvNet):
        stride, kernel = block.conv.stride[0], block.conv.kernel_size[0]
        out_lengths = [(n + 1) * stride - kernel for n in lengths]
        return _per_row(block, x, lengths, out_lengths, (x.shape[-1] + 1) * stride - kernel), out_lengths
    if isinstance(block, qm.Qwen3OmniMoeCausalConvNet):
        conv = block.conv
        if conv.groups == 1 and conv.kernel_size[0] > 1:
            return _per_row(block, x, lengths, lengths, x.shape[-1]), lengths
        return block(x), lengths
    if isinstance(block, qm.Qwen3OmniMoeCode2WavDecoderResidualUnit):
        h, _ = _stage(block.conv1, block.act1(x), lengths)
        h, _ = _stage(block.conv2, block.act2(h), lengths)
        return h + x, lengths
    if isinstance(block, qm.Qwen3OmniMoeCode2WavDecoderBlock):
        for inner in block.block:
            x, lengths = _stage(inner, x, lengths)
        return x, lengths
    if isinstance(block, (qm.Qwen3OmniMoeConvNeXtBlock, qm.Qwen3OmniMoeSnakeBeta)):
        return block(x), lengths  # depthwise causal conv, per-position layers, elementwise
    raise TypeError(f"code2wav: no batched rule for {type(block).__name__}")


def _per_row(
    block: torch.nn.Module, x: torch.Tensor, lengths: Lengths, out_lengths: Lengths, width: int
) -> torch.Tensor:
    """``block`` on each row's valid prefix alone (a fresh copy), right-padded to ``width``."""
    if x.shape[0] == 1:
        return block(x[:, :, : lengths[0]])
    rows = [
        F.pad(block(x[i : i + 1, :, :n].clone()), (0, width - m))
        for i, (n, m) in enumerate(zip(lengths, out_lengths, strict=True))
    ]
    return torch.cat(rows, dim=0)
