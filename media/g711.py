"""G.711 μ-law and A-law (ITU-T G.711), bit-exact with the classic Sun `g711.c` / `audioop`.

Encoding goes through a 65,536-entry lookup table (one byte per int16 value) and decoding
through a 256-entry table; both are built on first use, never at import.
"""

from __future__ import annotations

from functools import cache

import numpy as np

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)
_ULAW_CLIP = 8159  # 14-bit magnitude limit
_ULAW_BIAS = 0x21  # 0x84 >> 2


def _all_int16() -> np.ndarray:
    return np.arange(-32768, 32768, dtype=np.int32)


@cache
def _ulaw_encode_table() -> np.ndarray:
    """uint8[65536], indexed by `int16 value + 32768`."""
    pcm = _all_int16() >> 2  # 14-bit
    negative = pcm < 0
    mag = np.where(negative, -pcm, pcm)
    mask = np.where(negative, 0x7F, 0xFF)
    mag = np.minimum(mag, _ULAW_CLIP) + _ULAW_BIAS
    seg = np.searchsorted(_ULAW_SEG_END, mag, side="left")
    code = (seg << 4) | ((mag >> (seg + 1)) & 0x0F)
    code = np.where(seg >= 8, 0x7F, code)
    return ((code ^ mask) & 0xFF).astype(np.uint8)


@cache
def _alaw_encode_table() -> np.ndarray:
    """uint8[65536], indexed by `int16 value + 32768`."""
    pcm = _all_int16() >> 3  # 13-bit
    negative = pcm < 0
    mask = np.where(negative, 0x55, 0xD5)
    mag = np.where(negative, -pcm - 1, pcm)
    seg = np.searchsorted(_ALAW_SEG_END, mag, side="left")
    shift = np.where(seg < 2, 1, seg)
    code = (np.minimum(seg, 7) << 4) | ((mag >> shift) & 0x0F)
    code = np.where(seg >= 8, 0x7F, code)
    return ((code ^ mask) & 0xFF).astype(np.uint8)


@cache
def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = ((u & 0x0F) << 3) + 0x84
    t = t << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


@cache
def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, t + 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples → μ-law bytes (one byte per sample)."""
    idx = pcm.astype(np.int32, copy=False) + 32768
    return bytes(_ulaw_encode_table()[idx])


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples → A-law bytes (one byte per sample)."""
    idx = pcm.astype(np.int32, copy=False) + 32768
    return bytes(_alaw_encode_table()[idx])


def ulaw_decode(data: bytes) -> np.ndarray:
    """μ-law bytes → int16 samples."""
    return _ulaw_decode_table()[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes → int16 samples."""
    return _alaw_decode_table()[np.frombuffer(data, dtype=np.uint8)]
