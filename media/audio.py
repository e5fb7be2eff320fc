"""Audio sample formats for voice sessions: PCM16 ⇄ float32, base64, G.711, resampling, framing.

Rates used across the project: 24 kHz on the OpenAI Realtime wire (`audio/pcm`), 8 kHz for
G.711 (`audio/pcmu`, `audio/pcma`), 16 kHz for VAD and ASR, 22.05 kHz from Piper TTS,
48 kHz for Opus/WebRTC. Everything here is pure computation on numpy arrays and bytes.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pybase64
import soxr

from media.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

WIRE_RATE = 24_000
VAD_RATE = 16_000
ASR_RATE = 16_000
TTS_RATE = 22_050
OPUS_RATE = 48_000
G711_RATE = 8_000

WireFormatName = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]


class AudioFormatError(ValueError):
    """Audio bytes that cannot be decoded in the declared format."""


# --- PCM16 ⇄ float32 ---------------------------------------------------------------------


def int16_to_float32(pcm: np.ndarray) -> np.ndarray:
    """int16 samples → float32 in [-1, 1)."""
    return pcm.astype(np.float32) / 32768.0


def float32_to_int16(samples: np.ndarray) -> np.ndarray:
    """float32 samples (clipped to [-1, 1]) → int16, rounded to nearest. One temporary,
    worked in place (it runs for every output delta): ~25 % cheaper than clip-scale-round."""
    scaled = np.multiply(np.asarray(samples, dtype=np.float32), 32767.0, dtype=np.float32)
    np.clip(scaled, -32767.0, 32767.0, out=scaled)
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int16)


def float32_to_int16_exact(samples: np.ndarray) -> np.ndarray:
    """The exact inverse of `int16_to_float32` (scale 32768, rounded, saturated): int16 →
    float32 → int16 is lossless, and audio that was resampled in between comes back within
    half a step. For storing input audio compactly without changing it (ASR output has been
    seen to change with the 32767 scale of `float32_to_int16`, meant for output audio)."""
    scaled = np.multiply(samples, 32768.0, dtype=np.float32)
    np.rint(scaled, out=scaled)
    np.clip(scaled, -32768.0, 32767.0, out=scaled)
    return scaled.astype(np.int16)


def pcm16_to_float32(data: bytes) -> np.ndarray:
    """16-bit little-endian mono PCM bytes → float32 samples."""
    if len(data) % 2:
        raise AudioFormatError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
    return int16_to_float32(np.frombuffer(data, dtype="<i2"))


def float32_to_pcm16(samples: np.ndarray) -> bytes:
    """float32 samples → 16-bit little-endian mono PCM bytes."""
    return float32_to_int16(samples).astype("<i2", copy=False).tobytes()


# --- base64 ------------------------------------------------------------------------------


# Every audio append and every output delta carries base64: pybase64's SIMD codec takes a
# tenth of binascii's time on a 40 ms chunk (0.6 against 5 µs to decode 1920 bytes).


def b64encode_audio(data: bytes) -> str:
    return pybase64.b64encode(data).decode("ascii")


def b64decode_audio(text: str) -> bytes:
    """Strict base64 (standard alphabet, padding required, nothing after it) → bytes."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioFormatError(f"invalid base64 audio: {exc}") from None


# --- wire formats ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireFormat:
    """One of the three OpenAI Realtime audio formats (mono)."""

    name: WireFormatName
    rate: int
    bytes_per_sample: int

    def decode(self, data: bytes) -> np.ndarray:
        """Wire bytes → float32 samples at `self.rate`."""
        return int16_to_float32(self.decode_int16(data))

    def decode_int16(self, data: bytes) -> np.ndarray:
        """Wire bytes → int16 samples at `self.rate` (PCM: a zero-copy, read-only view of
        `data`), so hot paths can batch the float conversion with the resampling."""
        if self.name == "audio/pcm":
            if len(data) % 2:
                raise AudioFormatError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
            return np.frombuffer(data, dtype="<i2")
        return ulaw_decode(data) if self.name == "audio/pcmu" else alaw_decode(data)

    def encode(self, samples: np.ndarray) -> bytes:
        """float32 samples at `self.rate` → wire bytes."""
        pcm = float32_to_int16(samples)
        if self.name == "audio/pcm":
            return pcm.astype("<i2", copy=False).tobytes()
        return ulaw_encode(pcm) if self.name == "audio/pcmu" else alaw_encode(pcm)

    def bytes_for_ms(self, ms: float) -> int:
        """Byte length of `ms` milliseconds, whole samples, rounded down."""
        return int(self.rate * ms / 1000) * self.bytes_per_sample

    def duration_ms(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_sample * 1000.0 / self.rate


PCM24K = WireFormat("audio/pcm", WIRE_RATE, 2)
PCMU = WireFormat("audio/pcmu", G711_RATE, 1)
PCMA = WireFormat("audio/pcma", G711_RATE, 1)


def wire_format(name: str) -> WireFormat:
    """The `WireFormat` for a Realtime format `type` (`audio/pcm`, `audio/pcmu`, `audio/pcma`)."""
    for fmt in (PCM24K, PCMU, PCMA):
        if fmt.name == name:
            return fmt
    raise AudioFormatError(f"unknown audio format {name!r}")


# --- resampling --------------------------------------------------------------------------


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """One-shot resampling of a whole float32 signal (soxr HQ)."""
    samples = np.asarray(samples, dtype=np.float32)
    if src_rate == dst_rate or samples.size == 0:
        return samples.copy()
    out = soxr.resample(samples, src_rate, dst_rate, quality="HQ")
    return np.asarray(out, dtype=np.float32)


RESAMPLE_SLICE = 2048  # input samples per soxr call (bounds the stream's memory; see process)


class StreamingResampler:
    """Resamples a continuous float32 mono stream chunk by chunk.

    The filter state carries across `process` calls, so chunk boundaries leave no clicks and
    the output equals one-shot resampling of the concatenated input (up to the tail that
    `flush` returns). After `flush` the resampler starts a fresh stream.
    """

    def __init__(self, src_rate: int, dst_rate: int, *, quality: str = "HQ") -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {src_rate} → {dst_rate}")
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._quality = quality
        self._stream: soxr.ResampleStream | None = None

    @property
    def passthrough(self) -> bool:
        return self.src_rate == self.dst_rate

    def process(self, samples: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self.passthrough:
            return samples.copy()
        if self._stream is None:
            self._stream = soxr.ResampleStream(
                self.src_rate, self.dst_rate, 1, dtype="float32", quality=self._quality
            )
        if len(samples) <= RESAMPLE_SLICE:
            return np.asarray(self._stream.resample_chunk(samples), dtype=np.float32)
        # soxr grows its buffers to the largest chunk it was given and keeps them: 1 s of
        # 24 kHz at once left ~280 KB in every session's input stream, slices of 2048 ~70 KB.
        parts = [
            self._stream.resample_chunk(samples[i : i + RESAMPLE_SLICE])
            for i in range(0, len(samples), RESAMPLE_SLICE)
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def flush(self) -> np.ndarray:
        """End the stream: return the samples still held in the filter."""
        stream, self._stream = self._stream, None
        if stream is None:
            return np.zeros(0, dtype=np.float32)
        return np.asarray(stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True), dtype=np.float32)


# --- framing -----------------------------------------------------------------------------


class AudioFramer:
    """Slices a byte stream into frames of exactly `frame_bytes` (the last one may be short).

    Used to cut model audio into `response.output_audio.delta` payloads of a configured
    duration (20–100 ms) regardless of how the engine chunked it.
    """

    def __init__(self, frame_bytes: int) -> None:
        if frame_bytes <= 0:
            raise ValueError(f"frame size must be positive, got {frame_bytes}")
        self.frame_bytes = frame_bytes
        self._pending = bytearray()

    @classmethod
    def for_duration(cls, fmt: WireFormat, frame_ms: int) -> AudioFramer:
        if not 20 <= frame_ms <= 100:
            raise ValueError(f"output frames must be 20–100 ms, got {frame_ms}")
        return cls(fmt.bytes_for_ms(frame_ms))

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def push(self, data: bytes) -> list[bytes]:
        """Add bytes; return every complete frame now available."""
        self._pending += data
        n = len(self._pending) // self.frame_bytes
        if n == 0:
            return []
        cut = n * self.frame_bytes
        frames = [bytes(self._pending[i : i + self.frame_bytes]) for i in range(0, cut, self.frame_bytes)]
        del self._pending[:cut]
        return frames

    def flush(self) -> bytes:
        """Return (and drop) the incomplete tail frame; empty when nothing is pending."""
        tail = bytes(self._pending)
        self._pending.clear()
        return tail

    def discard(self) -> None:
        self._pending.clear()
