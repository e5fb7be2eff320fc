"""Input speech for the load: Piper utterances synthesised once, and pre-encoded append events.

Every ``input_audio_buffer.append`` the clients send is built here, before the run, as the
UTF-8 bytes of the whole JSON event, so a session's sender only hands ready bytes to its
socket: no base64, no JSON, no numpy while the load runs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from media.audio import OPUS_RATE, resample

RATE = 24000  # the realtime protocol's audio/pcm rate
SENTENCES = (
    "Hello there, can you tell me what the weather will be like tomorrow?",
    "I would like to book a table for two people at seven tonight.",
    "What is the capital of France, and how far is it from London?",
    "Please remind me to call my sister after lunch.",
    "Could you play some quiet music while I read?",
    "How many minutes does it take to boil an egg?",
)


@dataclass(frozen=True, slots=True)
class EncodedUtterance:
    frames: tuple[bytes, ...]  # append events, one per append_ms of audio
    speech_ms: float  # the speech itself (the last frame is padded with silence)
    pad_ms: float  # silence at the end of the last frame


@dataclass(frozen=True, slots=True)
class SpeechBank:
    utterances: tuple[EncodedUtterance, ...]
    silence: bytes  # one append event of silence
    append_ms: int


def append_event(pcm16: bytes) -> bytes:
    audio = base64.b64encode(pcm16).decode("ascii")
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio}, separators=(",", ":")).encode()


def to_pcm16(samples: np.ndarray) -> bytes:
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).astype("<i2").tobytes()


def encode_utterance(samples: np.ndarray, append_ms: int) -> EncodedUtterance:
    step = RATE * append_ms // 1000
    n = max(1, math.ceil(samples.size / step))
    padded = np.zeros(n * step, dtype=np.float32)
    padded[: samples.size] = samples
    pcm = to_pcm16(padded)
    frames = tuple(append_event(pcm[i * step * 2 : (i + 1) * step * 2]) for i in range(n))
    speech_ms = samples.size * 1000.0 / RATE
    return EncodedUtterance(frames, speech_ms, n * append_ms - speech_ms)


def tone_utterance(duration_ms: int, seed: int = 0) -> np.ndarray:
    """A voice-band stand-in for speech: harmonics of 140 Hz, syllable-rate amplitude modulation."""
    n = RATE * duration_ms // 1000
    t = np.arange(n, dtype=np.float64) / RATE
    voice = sum(np.sin(2 * np.pi * 140.0 * k * t + k) / k for k in range(1, 6))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4.0 * t + seed)
    noise = np.random.default_rng(seed).normal(0.0, 0.01, n)
    return (0.25 * voice * envelope + noise).astype(np.float32)


def trim_silence(samples: np.ndarray, threshold: float = 0.01) -> np.ndarray:
    loud = np.flatnonzero(np.abs(samples) > threshold)
    return samples if loud.size == 0 else samples[loud[0] : loud[-1] + 1]


def piper_utterances(cache_dir: Path) -> list[np.ndarray]:
    """:data:`SENTENCES` spoken by the Piper voice at 24 kHz (synthesised once, then cached)."""
    key = hashlib.sha256("\n".join(SENTENCES).encode()).hexdigest()[:12]
    path = cache_dir / f"piper-24k-{key}.npz"
    if path.exists():
        with np.load(path) as data:
            return [data[f"u{i}"] for i in range(len(SENTENCES))]
    from engines.speech.tts import TtsConfig, shared_tts
    from media.audio import resample

    tts = shared_tts(TtsConfig(noise_scale=0.0, noise_w_scale=0.0))
    out = [trim_silence(resample(tts.synthesize_all(s), tts.sample_rate, RATE)) for s in SENTENCES]
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    arrays: dict[str, Any] = {f"u{i}": a.astype(np.float32) for i, a in enumerate(out)}
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return out


def build_speech_bank(
    source: str, *, append_ms: int, speech_ms: int = 2000, cache_dir: Path | None = None
) -> SpeechBank:
    if source == "piper":
        raw = piper_utterances(cache_dir or Path(".omniduplex") / "loadtest-cache")
    elif source == "tone":
        raw = [tone_utterance(speech_ms, seed) for seed in range(3)]
    else:
        raise ValueError(f"unknown speech source {source!r}")
    silence = append_event(bytes(RATE * append_ms // 1000 * 2))
    return SpeechBank(tuple(encode_utterance(a, append_ms) for a in raw), silence, append_ms)


_SPEECH_48K: dict[int, tuple[SpeechBank, tuple[np.ndarray, ...]]] = {}


def rtc_speech(bank: SpeechBank) -> tuple[np.ndarray, ...]:
    """The bank's utterances as 48 kHz float32 (decoded from its append events once per bank)."""
    cached = _SPEECH_48K.get(id(bank))
    if cached is not None and cached[0] is bank:
        return cached[1]
    out = []
    for utterance in bank.utterances:
        pcm = b"".join(base64.b64decode(json.loads(frame)["audio"]) for frame in utterance.frames)
        samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        samples = samples[: round(utterance.speech_ms * RATE / 1000.0)]
        out.append(resample(samples, RATE, OPUS_RATE))
    speech = tuple(out)
    _SPEECH_48K[id(bank)] = (bank, speech)
    return speech
