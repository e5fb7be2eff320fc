"""Shared fixtures: real CPU models, loaded once per test module (and cached per process)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput, StepOutput
from tests.speech_audio import DETERMINISTIC_VOICE, SENTENCE, speak, words

__all__ = ["DETERMINISTIC_VOICE", "SENTENCE", "words"]  # re-exported for the tests here


@pytest.fixture(scope="module")
def tts() -> Any:
    pytest.importorskip("piper")
    from engines.speech.tts import TtsConfig, shared_tts

    return shared_tts(TtsConfig(**DETERMINISTIC_VOICE))


@pytest.fixture(scope="module")
def asr() -> Any:
    pytest.importorskip("faster_whisper")
    from engines.speech.asr import AsrConfig, shared_asr

    return shared_asr(AsrConfig())


@pytest.fixture(scope="module")
def speak16k(tts: Any) -> Callable[[str], np.ndarray]:
    """Piper speech for a text, resampled to float32 16 kHz."""
    return speak


@pytest.fixture(scope="module")
def sentence16k(speak16k: Callable[[str], np.ndarray]) -> np.ndarray:
    return speak16k(SENTENCE)


def run_engine(
    engine: Engine,
    params: dict[str, Any],
    chunks: Sequence[EdgeChunk] = (),
    *,
    chunks_per_step: int = 1,
    max_steps: int = 1000,
) -> list[tuple[int, StepOutput]]:
    """Drive one request through ``engine`` as a stage would, delivering ``chunks`` a few per
    step; returns (chunks delivered so far, output) for every step until done."""
    state = engine.start(EngineRequest(request_id="r1", params=params))
    delivered = 0
    steps: list[tuple[int, StepOutput]] = []
    for _ in range(max_steps):
        new = list(chunks[delivered : delivered + chunks_per_step])
        delivered += len(new)
        finished = bool(chunks) and delivered == len(chunks)
        out = engine.step([StepInput(state=state, chunks=new, upstream_finished=finished)])[0]
        steps.append((delivered, out))
        if out.done:
            engine.finish(state, cancelled=False)
            return steps
        assert not (out.wait_for_input and delivered == len(chunks) and not new), "stalled"
    raise AssertionError(f"not done after {max_steps} steps")


def text_chunks(deltas: Sequence[str], source: str = "up") -> list[EdgeChunk]:
    """async_chunk delivery with first=1, steady=1: one TextDelta per chunk, then an empty
    finished chunk."""
    from runtime.payloads import TextDelta

    out = [EdgeChunk(items=[TextDelta(d)], index=i, source=source) for i, d in enumerate(deltas)]
    out.append(EdgeChunk(items=[], finished=True, index=len(deltas), source=source))
    return out
