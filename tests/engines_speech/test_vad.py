from __future__ import annotations

import time

import numpy as np
import pytest

from engines.speech.vad import FRAME_SAMPLES, SileroVad, as_frames, speech_probs_across_streams

pytestmark = pytest.mark.system

pytest.importorskip("onnxruntime")


def _framed(audio: np.ndarray) -> np.ndarray:
    n = audio.size // FRAME_SAMPLES * FRAME_SAMPLES
    return audio[:n].reshape(-1, FRAME_SAMPLES)


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad()


def test_speech_is_speech_and_silence_is_not(vad: SileroVad, sentence16k: np.ndarray) -> None:
    silence = np.zeros(16000, dtype=np.float32)
    rng = np.random.default_rng(0)
    hiss = (0.003 * rng.standard_normal(16000)).astype(np.float32)
    stream = vad.new_stream()
    p_silence = stream.speech_probs(_framed(silence))
    p_hiss = stream.speech_probs(_framed(hiss))
    p_speech = stream.speech_probs(_framed(sentence16k))
    assert max(p_silence) < 0.1
    assert max(p_hiss[10:]) < 0.2  # noise onset gives a short transient (~0.4), then decays
    assert float(np.mean(np.array(p_speech) > 0.5)) > 0.6  # most of the sentence is voiced
    assert max(p_speech) > 0.95


def test_streams_keep_separate_state(vad: SileroVad, sentence16k: np.ndarray) -> None:
    frames = _framed(sentence16k)
    alone = vad.new_stream().speech_probs(frames)
    a, b = vad.new_stream(), vad.new_stream()
    silence = np.zeros_like(frames[0])
    got = []
    for frame in frames:  # interleave: b sees only silence
        got += a.speech_probs(frame)
        b.speech_probs(silence)
    assert got == alone
    a.reset()
    assert a.speech_probs(frames) == alone


def test_flat_input_and_bad_shapes(vad: SileroVad) -> None:
    assert as_frames(np.zeros(1024, dtype=np.float32)).shape == (2, FRAME_SAMPLES)
    with pytest.raises(ValueError):
        vad.new_stream().speech_probs(np.zeros(500, dtype=np.float32))
    with pytest.raises(ValueError):
        vad.new_stream().speech_probs(np.zeros((2, 256), dtype=np.float32))


def test_batched_across_streams_matches_single(vad: SileroVad, sentence16k: np.ndarray) -> None:
    frames = _framed(sentence16k)[:40]
    single = vad.new_stream().speech_probs(frames)
    streams = [vad.new_stream() for _ in range(3)]
    batched = [speech_probs_across_streams(vad, streams, np.stack([f, np.zeros_like(f), f])) for f in frames]
    np.testing.assert_allclose([p[0] for p in batched], single, atol=1e-6)
    np.testing.assert_allclose([p[2] for p in batched], single, atol=1e-6)


def test_per_frame_cost(vad: SileroVad, sentence16k: np.ndarray) -> None:
    frames = _framed(sentence16k)
    stream = vad.new_stream()
    stream.speech_probs(frames[:5])
    t0 = time.perf_counter()
    stream.speech_probs(frames)
    ms = (time.perf_counter() - t0) * 1000 / len(frames)
    print(f"silero VAD: {ms:.3f} ms per 32 ms frame")
    assert ms < 5.0  # ~0.1 ms here; a generous bound for loaded CI machines
