"""Smart Turn v3.2: does a stretch of speech end a finished turn? One ONNX model, 16 kHz audio.

The model (pipecat-ai's Smart Turn v3.2, BSD-2-Clause; a Whisper-tiny-sized audio encoder with
a classification head, 8.7 MB) takes the last 8 s of a user's speech as Whisper log-mel
features (80 mel bins x 800 frames; shorter audio is zero-padded in front) and returns the
probability that the speaker has finished their turn. It scores *how* the words were said
(intonation, a trailing "and ...", a filler) as well as what was said; it needs no transcript.

The file ships inside the ``pipecat-ai`` wheel (installed ``--no-deps`` for that file alone:
the Makefile and pyproject say so); it is found on disk without importing ``pipecat`` (whose
``__init__`` needs its own dependencies). Features are computed here (the
``WhisperFeatureExtractor(chunk_length=8)`` recipe: a centred 400-point periodic-Hann STFT,
hop 160, Slaney mel filters, log10 clamped to 8 below the maximum, then (x + 4) / 4, after the
waveform is normalised to zero mean and unit variance as pipecat does) with numpy on the
calling thread alone: its FFT, and each mel filter applied over its few non-zero bins (no BLAS
call, whose thread pool would do the same). Not torch: its ops share the process's intra-op
thread pool, and on a loaded machine a parallel op waits for a pool thread another process
holds the core of (features of one 8 s window: 212 ms of wall time with torch's default two
threads against 9 ms with one, measured while a benchmark ran on the host; one thread cannot
be set for this thread alone: `torch.set_num_threads` also sets MKL's, process-wide).
Scores of several sessions go through the model in one call (``batch``).

The model is quantized (int8 weights and activations, QDQ). onnxruntime fuses it into integer
matrix products, and on an x86 CPU without VNNI (AVX2 only: AMD Zen 3, older Intel) its default
u8s8 kernel sums pairs of products in 16 bits, which saturate: on such a host the scores moved
by up to 0.90 from the quantized graph's own (median 0.045 over the evaluation set's 120 pauses,
finished sentences >= 0.5 39/60 -> 28/60; docs/benchmarks.md, issue 30, tenth round). The
session asks for the precise AVX2 kernel (``session.x64quantprecision``: up to 0.36, median
0.007, 37/60; ~12 ms more a call there); CPUs with VNNI or AVX-512 kernels do not use the
setting.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
WINDOW_S = 8  # the model sees the last 8 s
WINDOW_SAMPLES = WINDOW_S * SAMPLE_RATE
N_FFT = 400
HOP = 160
N_MELS = 80
FRAMES = WINDOW_SAMPLES // HOP  # 800
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
LICENSE = "BSD-2-Clause (pipecat-ai, Daily)"
PRECISE_AVX2 = "session.x64quantprecision"  # onnxruntime: AVX2 u8s8 products without saturation


def smart_turn_model_path() -> Path:
    """The ONNX file inside the installed ``pipecat-ai`` wheel, found without importing it."""
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "pipecat-ai is not installed: the end-of-turn model ships in its wheel "
            "(pip install --no-deps pipecat-ai==1.14.0; `make setup` does)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "audio" / "turn" / "smart_turn" / "data" / MODEL_FILE
    if not path.is_file():
        raise RuntimeError(f"Smart Turn model not found at {path}")
    return path


@lru_cache(maxsize=1)
def _mel_filters() -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters [201, 80] (as Whisper's)."""

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        mel = 3.0 * f / 200.0
        log = f >= 1000.0
        return np.where(log, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * (27.0 / np.log(6.4)), mel)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        f = 200.0 * m / 3.0
        log = m >= 15.0
        return np.where(log, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), f)

    mels = np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(SAMPLE_RATE / 2)), N_MELS + 2)
    edges = mel_to_hz(mels)
    bins = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    diff = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= (2.0 / (edges[2 : N_MELS + 2] - edges[:N_MELS]))[None, :]
    return filters.astype(np.float32)


@lru_cache(maxsize=1)
def _mel_bands() -> tuple[tuple[int, int, np.ndarray], ...]:
    """Each mel filter as (first bin, end bin, weights): its non-zero run of FFT bins."""
    bands = []
    for column in _mel_filters().T:
        nonzero = np.flatnonzero(column)
        lo, hi = (int(nonzero[0]), int(nonzero[-1]) + 1) if len(nonzero) else (0, 0)
        bands.append((lo, hi, column[lo:hi].copy()))
    return tuple(bands)


@lru_cache(maxsize=1)
def _hann() -> np.ndarray:
    """The periodic Hann window (torch.hann_window's default)."""
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)


def window(audio: np.ndarray) -> np.ndarray:
    """The model's input span: the last 8 s of `audio`, zero-padded in front to 8 s."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)[-WINDOW_SAMPLES:]
    if len(audio) < WINDOW_SAMPLES:
        audio = np.concatenate([np.zeros(WINDOW_SAMPLES - len(audio), np.float32), audio])
    return audio


def log_mel(audios: Sequence[np.ndarray]) -> np.ndarray:
    """Whisper log-mel features [N, 80, 800] of 16 kHz audio (each cut or padded to 8 s)."""
    wave = np.stack([window(a) for a in audios]).astype(np.float64)
    wave = (wave - wave.mean(axis=1, keepdims=True)) / np.sqrt(wave.var(axis=1, keepdims=True) + 1e-7)
    padded = np.pad(wave.astype(np.float32), ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT, axis=1)[:, ::HOP][:, :FRAMES]
    spec = np.fft.rfft(frames * _hann(), axis=-1)  # [N, 800, 201]
    power = (spec.real**2 + spec.imag**2).astype(np.float32)
    mel = np.empty((len(audios), N_MELS, FRAMES), np.float32)
    for m, (lo, hi, weights) in enumerate(_mel_bands()):
        mel[:, m] = (power[:, :, lo:hi] * weights).sum(axis=-1)
    logs = np.log10(np.maximum(mel, 1e-10))
    logs = np.maximum(logs, logs.max(axis=(1, 2), keepdims=True) - 8.0)
    return ((logs + 4.0) / 4.0).astype(np.float32)


class SmartTurn:
    """The model, loaded once per process (``InferenceSession.run`` is thread-safe)."""

    _lock = threading.Lock()
    _shared: SmartTurn | None = None

    def __init__(self, path: Path | None = None, *, threads: int = 1) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.add_session_config_entry(PRECISE_AVX2, "1")  # no 16-bit saturation (module docstring)
        self.path = path or smart_turn_model_path()
        self._session = ort.InferenceSession(
            str(self.path), sess_options=opts, providers=["CPUExecutionProvider"]
        )

    @classmethod
    def shared(cls) -> SmartTurn:
        with cls._lock:
            if cls._shared is None:
                cls._shared = SmartTurn()
            return cls._shared

    def scores(self, audios: Sequence[np.ndarray]) -> list[float]:
        """P(finished turn) of each stretch of 16 kHz audio (its last 8 s), in one call."""
        if not audios:
            return []
        features = log_mel(audios)
        (probs,) = self._session.run(None, {"input_features": features})
        return [float(p) for p in np.asarray(probs).reshape(-1)]
