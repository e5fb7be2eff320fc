"""Shared fixtures: the tiny Qwen3-Omni engines (one model per process, built in ~0.2 s)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from engines.qwen3_omni.model import LoadedModel
from engines.qwen3_omni.prompt import build_prompt
from tests.engines_qwen.driver import Engines, make_engines


@pytest.fixture(scope="module")
def engines() -> Engines:
    return make_engines()


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """A deterministic 16 kHz test signal (tone sweep + noise), float32 in [-1, 1]."""
    n = int(16_000 * seconds)
    t = np.arange(n) / 16_000
    rng = np.random.default_rng(seed)
    wave = 0.2 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.02 * rng.standard_normal(n)
    return wave.astype(np.float32)


def reference_generate(
    loaded: LoadedModel, params: Mapping[str, Any], max_tokens: int, max_frames: int
) -> tuple[list[int], np.ndarray]:
    """``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy) on the same prompt.

    Returns the thinker's new tokens and the talker's codes [frames, 16] (captured where
    generate hands them to code2wav). generate's talker makes ``max_new_tokens`` c0 draws but
    only the first ``max_new_tokens - 1`` get their residual codes, hence ``max_frames + 1``.
    """
    model = loaded.model
    prompt = build_prompt(loaded, params)
    ids = torch.tensor([prompt.ids])
    captured: dict[str, torch.Tensor] = {}
    original = model.code2wav.chunked_decode

    def capture(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured["codes"] = codes.clone()
        return original(codes, *args, **kwargs)

    extra: dict[str, Any] = {}
    if prompt.input_features is not None:
        extra = {
            "input_features": prompt.input_features,
            "feature_attention_mask": prompt.feature_attention_mask,
        }
    model.code2wav.chunked_decode = capture  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            # generate() warns that greedy ignores temperature and that the repetition penalty
            # only sees generated codes (which is what the reference does).
            warnings.simplefilter("ignore")
            sequences, _wav = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                thinker_max_new_tokens=max_tokens,
                thinker_eos_token_id=sorted(loaded.ids.eos),
                thinker_do_sample=False,
                talker_do_sample=False,
                talker_max_new_tokens=max_frames + 1,
                speaker="ethan",
                **extra,
            )
    finally:
        del model.code2wav.chunked_decode
    tokens = sequences[0, ids.shape[1] :].tolist()
    return tokens, captured["codes"][0].T.numpy()
