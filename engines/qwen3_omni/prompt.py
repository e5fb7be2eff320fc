"""ChatML prompts for the thinker: text or 16 kHz audio, history and instructions."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from engines.qwen3_omni.model import SAMPLE_RATE_IN, LoadedModel

AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    #: One key per position for KV reuse: the token id, except audio placeholders, which carry a
    #: (negative) fingerprint of their clip so two different clips of one length never match.
    keys: list[int]
    input_features: torch.Tensor | None = None  # [1, 128, frames]
    feature_attention_mask: torch.Tensor | None = None  # [1, frames]
    audio_tokens: int = 0


def _messages(params: Mapping[str, Any], user_content: str) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    instructions = params.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": str(instructions)})
    history: Sequence[Mapping[str, Any]] = params.get("history") or ()
    for turn in history:
        role = str(turn.get("role", "user"))
        if role not in ("user", "assistant", "system"):
            raise ValueError(f"qwen3_omni: history role must be user, assistant or system, got {role!r}")
        messages.append({"role": role, "content": str(turn.get("text", ""))})
    messages.append({"role": "user", "content": user_content})
    return messages


def _audio_array(audio: Any) -> np.ndarray:
    samples = np.asarray(audio, dtype=np.float32).reshape(-1)
    if samples.size < SAMPLE_RATE_IN // 100:
        raise ValueError("qwen3_omni: audio input must hold at least 10 ms of 16 kHz samples")
    if not np.all(np.isfinite(samples)):
        raise ValueError("qwen3_omni: audio input contains NaN or infinite samples")
    return samples


def _fingerprint(samples: np.ndarray) -> int:
    digest = hashlib.blake2b(samples.tobytes(), digest_size=7).digest()
    return -1 - int.from_bytes(digest, "little")


def build_prompt(loaded: LoadedModel, params: Mapping[str, Any]) -> Prompt:
    """Token ids (audio placeholders expanded) and audio features for one request."""
    text = params.get("text")
    audio = params.get("audio")
    if text is None and audio is None:
        raise ValueError("qwen3_omni: params need 'text' or 'audio'")
    content = (AUDIO_PLACEHOLDER if audio is not None else "") + (str(text) if text is not None else "")
    rendered = loaded.tokenizer.apply_chat_template(
        _messages(params, content), tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str):
        raise TypeError("qwen3_omni: chat template did not render to a string")
    ids = [int(i) for i in loaded.tokenizer.encode(rendered, add_special_tokens=False)]
    prompt = Prompt(ids=ids, keys=list(ids))
    if audio is not None:
        _attach_audio(loaded, prompt, _audio_array(audio))
    if len(prompt.ids) < 3 or prompt.ids[-3:-1] != [loaded.ids.im_start, loaded.ids.assistant]:
        raise ValueError("qwen3_omni: the chat template must end with '<|im_start|>assistant\\n'")
    return prompt


def _attach_audio(loaded: LoadedModel, prompt: Prompt, samples: np.ndarray) -> None:
    features = loaded.feature_extractor(
        [samples],
        sampling_rate=SAMPLE_RATE_IN,
        padding="longest",
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = features["attention_mask"]
    frames = int(mask.sum().item())
    n_tokens = int(_get_feat_extract_output_lengths(torch.tensor(frames)).item())
    pad = loaded.ids.audio_pad
    at = [i for i, t in enumerate(prompt.ids) if t == pad]
    if len(at) != 1:
        raise ValueError("qwen3_omni: expected exactly one audio placeholder in the prompt")
    where = at[0]
    key = _fingerprint(samples)
    prompt.ids[where : where + 1] = [pad] * n_tokens
    prompt.keys[where : where + 1] = [key] * n_tokens
    prompt.input_features = features["input_features"].to(loaded.dtype)
    prompt.feature_attention_mask = mask
    prompt.audio_tokens = n_tokens


def user_mask(ids: Sequence[int], im_start: int, user: int) -> list[bool]:
    """Positions whose turn (the role after the previous ``<|im_start|>``) is ``user``.

    The same rule as ``Qwen3OmniMoeForConditionalGeneration.generate``: a user turn includes its
    ``<|im_start|>``, role, content, ``<|im_end|>`` and the newline after it.
    """
    out: list[bool] = []
    start = 0
    for pos, token in enumerate(ids):
        if token == im_start:
            start = pos
        role_pos = min(start + 1, len(ids) - 1)
        out.append(ids[role_pos] == user)
    return out
