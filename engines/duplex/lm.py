"""One frame of the Moshi language model for a batch of sessions: temporal step + depth step.

Per frame (12.5 Hz) and session: the temporal transformer (``MoshiForCausalLM`` inside
``MoshiForConditionalGeneration``) reads one *column* of tokens, the model's previous text
token plus the 8 + 8 codebooks of its own and the user's audio streams, and its KV cache
(a :class:`~engines.duplex.slot_kv.SlotKV` slot, so sessions at different positions share the
batch); the depth transformer (``MoshiDepthDecoder``) then samples the frame's 8 audio codes
one codebook after another, conditioned on the temporal output and the sampled text token.

Streams are kept in Moshi's delayed layout: the acoustic codebooks (1..7) of both audio
streams lag the semantic one by ``acoustic_delay`` frames (Moshi: 1), which is what the
model was trained on; :class:`FrameLM` keeps that small per-slot token ring and hands back
aligned frames (text token + 8 codes of one frame), the first one after ``acoustic_delay``
steps. This follows ``LMGen.step`` of Kyutai's reference implementation.

Sampling uses one ``torch.Generator`` per session, so a session's stream does not depend on
which other sessions share its step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from engines.duplex.slot_kv import SlotKV


@dataclass(slots=True)
class Sampling:
    """Moshi's defaults: text 0.7 / top-25, audio 0.8 / top-250 (temperature 0 = greedy)."""

    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250
    text_pad_bias: float = 0.0  # added to the pad logit: a silence prior for random weights only


def sample_rows(
    logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float, top_k: int
) -> torch.Tensor:
    """Sample one id per row of [B, V] logits, row ``b`` drawing from ``generators[b]``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.stack([
        torch.multinomial(probs[b], 1, generator=gen)[0] for b, gen in enumerate(generators)
    ])


@dataclass(slots=True)
class FrameOut:
    """What one step gives back per session: an aligned frame once the delays are filled."""

    ready: torch.Tensor  # bool [B]: False during the first `max_delay` steps of a session
    text: torch.Tensor  # int64 [B]
    codes: torch.Tensor  # int64 [B, K]


class FrameLM:
    """The temporal + depth step of a ``MoshiForConditionalGeneration`` over session slots."""

    def __init__(
        self, model: Any, *, slots: int, context: int, acoustic_delay: int = 1,
        text_pad_id: int = 3, sampling: Sampling | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.k = cfg.num_codebooks
        self.text_vocab = cfg.vocab_size
        self.audio_vocab = cfg.audio_vocab_size
        self.text_pad_id = text_pad_id
        self.sampling = sampling or Sampling()
        streams = 1 + 2 * self.k
        per_stream = [0] + [0] + [acoustic_delay] * (self.k - 1)
        self.delays = torch.tensor(per_stream + per_stream[1:])  # text, model audio, user audio
        self.max_delay = acoustic_delay
        self.columns = 2 * acoustic_delay + 2
        self.initial = torch.tensor([self.text_vocab] + [self.audio_vocab] * (2 * self.k))
        self.tokens = torch.zeros(slots, streams, self.columns, dtype=torch.long)
        self.offsets = torch.zeros(slots, dtype=torch.long)
        self.kv = SlotKV(
            layers=cfg.num_hidden_layers, slots=slots, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, window=context,
        )

    @property
    def state_bytes(self) -> int:
        return self.kv.nbytes + self.tokens.numel() * 8

    def reset(self, slot: int) -> None:
        self.kv.reset(slot)
        self.tokens[slot] = 0
        self.offsets[slot] = 0

    def step(
        self, slots: torch.Tensor, user_codes: torch.Tensor, generators: Sequence[torch.Generator]
    ) -> FrameOut:
        """Feed one user frame (codes [B, K]) per slot; sample the model's next column."""
        k, cols = self.k, self.columns
        off = self.offsets.index_select(0, slots)
        rows = slots[:, None]
        user_streams = torch.arange(1 + k, 1 + 2 * k)
        write_at = (off[:, None] + self.delays[user_streams][None, :]) % cols
        self.tokens[rows, user_streams[None, :], write_at] = user_codes
        column = self.tokens[slots, :, off % cols]  # [B, 1 + 2K]
        is_init = off[:, None] <= self.delays[None, :]
        column = torch.where(is_init, self.initial[None, :], column)

        hidden = self._temporal(slots, column)
        text_logits = self.model.decoder.lm_head(hidden)[:, -1].float()
        if self.sampling.text_pad_bias:
            text_logits[:, self.text_pad_id] += self.sampling.text_pad_bias
        s = self.sampling
        text = sample_rows(text_logits, generators, s.text_temperature, s.text_top_k)
        codes = self._depth(hidden, text, generators)

        self.tokens[slots, 0, (off + 1) % cols] = text
        model_streams = torch.arange(1, 1 + k)
        write_at = (off[:, None] + self.delays[model_streams][None, :] + 1) % cols
        self.tokens[rows, model_streams[None, :], write_at] = codes
        off = off + 1
        self.offsets[slots] = off
        read = (off[:, None] - self.max_delay + self.delays[None, : 1 + k]) % cols  # [B, 1 + K]
        frame = torch.gather(self.tokens.index_select(0, slots)[:, : 1 + k], 2, read[:, :, None])[:, :, 0]
        return FrameOut(ready=off > self.max_delay, text=frame[:, 0], codes=frame[:, 1:])

    def _temporal(self, slots: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        embeds = decoder.model.embed_tokens(column[:, :1])
        for i, table in enumerate(self.model.embed_tokens):
            embeds = embeds + table(column[:, 1 + i : 2 + i])
        pos, mask = self.kv.begin(slots, 1)
        out = decoder.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=pos, cache=self.kv, use_cache=True
        )
        hidden: torch.Tensor = out.last_hidden_state  # [B, 1, H], after the final norm
        return hidden

    def _depth(
        self, hidden: torch.Tensor, text: torch.Tensor, generators: Sequence[torch.Generator]
    ) -> torch.Tensor:
        depth = self.model.depth_decoder
        cache = DynamicCache(config=depth.config)
        token = text[:, None]
        codes = []
        s = self.sampling
        for _ in range(self.k):
            out = depth(input_ids=token, last_hidden_state=hidden, cache=cache, use_cache=True)
            code = sample_rows(out.logits[:, -1].float(), generators, s.audio_temperature, s.audio_top_k)
            codes.append(code)
            token = code[:, None]
        return torch.stack(codes, dim=1)
