"""Deterministic Piper speech for tests that need a real voice (ASR round trips, VAD turns).

Shared by the engine tests (`tests/engines_speech`) and the realtime end-to-end tests
(`tests/realtime`), so every test speaks with the same voice settings.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any

import numpy as np

SENTENCE = "The quick brown fox jumps over the lazy dog."
# Piper draws noise inside its ONNX graph; with both noise scales at 0 its audio is
# bit-for-bit repeatable, and so is every transcript of it. Tests that compare strings use it.
DETERMINISTIC_VOICE: dict[str, Any] = {"noise_scale": 0.0, "noise_w_scale": 0.0}


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, for word-for-word comparisons."""
    return re.findall(r"[a-z0-9']+", text.lower())


def word_errors(expected: str, heard: str) -> int:
    """Words of `expected` that `heard` lacks or gets wrong, plus words it adds (an edit count
    over words, from the longest matching blocks)."""
    a, b = words(expected), words(heard)
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    same = sum(block.size for block in matcher.get_matching_blocks())
    return max(len(a), len(b)) - same


def deterministic_tts() -> Any:
    """The process-wide Piper voice with noise off (loads on first use)."""
    from engines.speech.tts import TtsConfig, shared_tts

    return shared_tts(TtsConfig(**DETERMINISTIC_VOICE))


@lru_cache(maxsize=32)
def _speak(text: str, rate: int) -> np.ndarray:
    import soxr

    tts = deterministic_tts()
    audio = tts.synthesize_all(text)
    if rate != tts.sample_rate:
        audio = soxr.resample(audio, tts.sample_rate, rate)
    return np.asarray(audio, dtype=np.float32)


def speak(text: str, rate: int = 16_000) -> np.ndarray:
    """Piper speech for `text` (deterministic voice), float32 mono at `rate` (a fresh copy)."""
    return _speak(text, rate).copy()
