"""Streaming Mimi (``transformers.MimiModel``) for many sessions at once, one 80 ms frame a step.

``transformers`` gives Mimi a streaming *encoder*: its causal convolutions keep their left
padding in a ``MimiConv1dPaddingCache``, and its transformer takes a KV cache; feeding 1,920
samples at a time yields exactly the codes of a whole-signal encode (``tests/duplex`` checks
it). Here those per-layer padding states live in per-slot buffers and the transformer KV in a
:class:`~engines.duplex.slot_kv.SlotKV`, so the frames of every session in a step are encoded
in one batched call.

The *decoder* side has a streaming transformer but ``transformers`` runs its SEANet
convolutions on whole signals only. Here they are stepped one frame at a time with Moshi's
streaming rules: each causal ``MimiConv1d`` (and those inside the residual blocks) gets the
left padding it kept from the previous frame through the same ``padding_cache`` hook the
encoder uses, and each causal transposed convolution adds the overlapping tail of the previous
frame's output (without its bias) to the start of this one and keeps its own tail. So every
frame decodes to exactly the samples a whole-signal decode gives (checked in the tests), at
the cost of one frame.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConv1dPaddingCache,
    MimiConvTranspose1d,
    MimiResnetBlock,
)

from engines.duplex.slot_kv import SlotKV


class _SlotPaddingCache(MimiConv1dPaddingCache):
    """The padding cache of a batch whose rows may be new sessions.

    A layer in ``replicate`` mode pads a signal's start with its first sample, which the
    cache only learns from the first input; rows flagged ``fresh`` get that initial padding,
    the others keep their stored state.
    """

    fresh: torch.Tensor  # bool [B]

    def update(self, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        if self.per_layer_padding_mode[layer_idx] == "replicate" and bool(self.fresh.any()):
            start = self._cache_init(hidden_states, layer_idx)
            stored: torch.Tensor = self.padding_cache[layer_idx]  # type: ignore[assignment]
            self.padding_cache[layer_idx] = torch.where(  # type: ignore[call-overload]
                self.fresh[:, None, None], start, stored
            )
        return super().update(hidden_states, layer_idx)


class _CallOrderPaddingCache:
    """Padding states of the decoder's causal convolutions, in the order they are called (its
    convolutions carry no ``layer_idx``; the order of one forward pass is fixed)."""

    def __init__(self, states: list[torch.Tensor]) -> None:
        self.states = states
        self._next = 0

    def update(self, hidden_states: torch.Tensor, layer_idx: int | None) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        previous = self.states[i]
        keep = previous.shape[-1]
        joined = torch.cat([previous, hidden_states], dim=-1)
        self.states[i] = joined[..., joined.shape[-1] - keep :]
        return previous


def _decoder_convs(seanet: Any) -> list[Any]:
    """The causal MimiConv1d layers of a SEANet decoder in call order (residual blocks inside)."""
    convs: list[Any] = []
    for layer in seanet.layers:
        if isinstance(layer, MimiConv1d):
            convs.append(layer)
        elif isinstance(layer, MimiResnetBlock):
            convs += [m for m in layer.block if isinstance(m, MimiConv1d)]
            if isinstance(layer.shortcut, MimiConv1d):
                convs.append(layer.shortcut)
    return convs


class MimiStreams:
    """Per-slot streaming encode/decode state around one ``MimiModel``."""

    def __init__(self, mimi: Any, *, slots: int, num_codebooks: int) -> None:
        cfg = mimi.config
        self.mimi = mimi
        self.num_codebooks = num_codebooks
        self.sample_rate = int(cfg.sampling_rate)
        self.frame_size = round(cfg.sampling_rate / cfg.frame_rate)  # 1920 at 24 kHz / 12.5 Hz
        enc, dec = mimi.encoder, mimi.decoder
        if not cfg.use_causal_conv or cfg.trim_right_ratio != 1.0 or cfg.pad_mode != "constant":
            raise ValueError("streaming Mimi needs causal convolutions, trim_right_ratio 1 and zero padding")
        self._hop = round(cfg.sampling_rate / cfg.encodec_frame_rate)  # samples per 25 Hz step
        self._steps_per_frame = self.frame_size // self._hop
        convs = [enc.encoder_seanet.get_submodule(n) for n in enc.encoder_seanet._conv1d_layer_names]
        convs.append(enc.downsample)
        self._pad_layout = (
            [c.padding_total for c in convs], [c.pad_mode for c in convs], [c.in_channels for c in convs]
        )
        self._pad = [torch.zeros(slots, c.in_channels, c.padding_total) for c in convs]
        self._fresh = torch.ones(slots, dtype=torch.bool)  # no audio encoded yet (replicate padding)

        def kv(tcfg: Any) -> SlotKV:
            return SlotKV(
                layers=tcfg.num_hidden_layers, slots=slots, kv_heads=tcfg.num_key_value_heads,
                head_dim=tcfg.head_dim, window=tcfg.sliding_window,
            )

        self._enc_kv = kv(enc.config)
        self._dec_kv = kv(dec.config)
        hidden = dec.config.hidden_size
        self._prev_latent = torch.zeros(slots, hidden, 1)
        seanet = dec.decoder_seanet
        convs = _decoder_convs(seanet)
        self._dec_pad = [torch.zeros(slots, c.in_channels, int(c.padding_total)) for c in convs]
        self._dec_tails = [
            torch.zeros(slots, layer.conv.out_channels, layer.conv.kernel_size[0] - layer.conv.stride[0])
            for layer in seanet.layers
            if isinstance(layer, MimiConvTranspose1d)
        ]

    @property
    def state_bytes(self) -> int:
        buffers = [*self._pad, *self._dec_pad, *self._dec_tails, self._prev_latent]
        return sum(b.numel() * b.element_size() for b in buffers) + self._enc_kv.nbytes + self._dec_kv.nbytes

    def reset(self, slot: int) -> None:
        for pad in self._pad:
            pad[slot] = 0
        self._fresh[slot] = True
        self._enc_kv.reset(slot)
        self._dec_kv.reset(slot)
        self._prev_latent[slot] = 0
        for state in (*self._dec_pad, *self._dec_tails):
            state[slot] = 0

    def encode(self, slots: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """float32 [B, frame_size] (one frame per slot) → codes int64 [B, num_codebooks]."""
        enc = self.mimi.encoder
        padding, modes, channels = self._pad_layout
        cache = _SlotPaddingCache(
            num_layers=len(padding), per_layer_padding=padding, per_layer_padding_mode=modes,
            per_layer_in_channels=channels,
        )
        cache.fresh = self._fresh.index_select(0, slots)
        cache.padding_cache = [pad.index_select(0, slots) for pad in self._pad]  # type: ignore[misc]
        hidden = enc.encoder_seanet(audio[:, None, :], padding_cache=cache)
        pos, mask = self._enc_kv.begin(slots, hidden.shape[-1])
        out = enc.encoder_transformer(
            hidden.transpose(1, 2), attention_mask=mask, position_ids=pos, cache=self._enc_kv, use_cache=True
        )
        latents = enc.downsample(out.last_hidden_state.transpose(1, 2), padding_cache=cache)
        for pad, new in zip(self._pad, cache.padding_cache, strict=True):
            assert new is not None
            pad.index_copy_(0, slots, new)
        self._fresh[slots] = False
        codes = self.mimi.quantizer.encode(latents, self.num_codebooks).transpose(0, 1)  # [B, K, 1]
        return codes[:, :, -1]

    def decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """codes int64 [B, num_codebooks] → float32 [B, frame_size] audio for that frame."""
        dec = self.mimi.decoder
        latent = self.mimi.quantizer.decode(codes[:, :, None])  # [B, hidden, 1]
        pair = torch.cat([self._prev_latent.index_select(0, slots), latent], dim=-1)
        self._prev_latent.index_copy_(0, slots, latent)
        # the causal transposed conv: the last `steps_per_frame` outputs belong to the new frame
        up = dec.upsample(pair)[..., -self._steps_per_frame :]
        pos, mask = self._dec_kv.begin(slots, up.shape[-1])
        out = dec.decoder_transformer(
            up.transpose(1, 2), attention_mask=mask, position_ids=pos, cache=self._dec_kv, use_cache=True
        )
        audio = self._seanet_step(slots, out.last_hidden_state.transpose(1, 2))
        return audio[:, 0]

    def _seanet_step(self, slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One frame through the SEANet decoder with per-slot streaming state."""
        cache = _CallOrderPaddingCache([pad.index_select(0, slots) for pad in self._dec_pad])
        tail_index = 0
        for layer in self.mimi.decoder.decoder_seanet.layers:
            if isinstance(layer, (MimiConv1d, MimiResnetBlock)):
                hidden = layer(hidden, padding_cache=cache)
            elif isinstance(layer, MimiConvTranspose1d):
                state = self._dec_tails[tail_index]
                tail_index += 1
                full = layer.conv(hidden)  # [B, C, (T - 1) * stride + kernel]
                overlap = state.shape[-1]
                full[..., :overlap] += state.index_select(0, slots)
                emitted = hidden.shape[-1] * layer.conv.stride[0]
                tail = full[..., emitted:]
                if layer.conv.bias is not None:  # the next frame adds its own bias there
                    tail = tail - layer.conv.bias[None, :, None]
                state.index_copy_(0, slots, tail.contiguous())
                hidden = full[..., :emitted]
            else:
                hidden = layer(hidden)
        for pad, new in zip(self._dec_pad, cache.states, strict=True):
            pad.index_copy_(0, slots, new.contiguous())
        return hidden
