from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from media.audio import (
    PCM24K,
    PCMA,
    PCMU,
    AudioFormatError,
    AudioFramer,
    StreamingResampler,
    b64decode_audio,
    b64encode_audio,
    float32_to_pcm16,
    pcm16_to_float32,
    resample,
    wire_format,
)
from media.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

pytestmark = pytest.mark.system

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)

# Golden digests of the full encode tables (every int16 value, ascending) and decode tables
# (bytes 0..255 → int16 LE), bit-exact with the Sun g711.c reference that audioop wraps.
ULAW_ENCODE_SHA256 = "81d633c9e6972a18c74a58720b96cb8ca0bdd096d4060b646dd708c3b846019a"
ALAW_ENCODE_SHA256 = "38488f6fd710f4686360edc4d38639f96c491595ef93f8eb8d62d5e07ca6ce7b"


def test_ulaw_golden_bytes() -> None:
    samples = np.array([0, 1, -1, 1000, -1000, 32767, -32768, 8031, -8031], dtype=np.int16)
    assert ulaw_encode(samples) == bytes([0xFF, 0xFF, 0x7E, 0xCE, 0x4E, 0x80, 0x00, 0xA0, 0x20])
    assert hashlib.sha256(ulaw_encode(ALL_INT16)).hexdigest() == ULAW_ENCODE_SHA256
    # decode: silence codes and the extremes
    assert ulaw_decode(bytes([0xFF, 0x7F, 0x80, 0x00])).tolist() == [0, 0, 32124, -32124]


def test_alaw_golden_bytes() -> None:
    samples = np.array([0, 1, -1, 1000, -1000, 32767, -32768], dtype=np.int16)
    assert alaw_encode(samples) == bytes([0xD5, 0xD5, 0x55, 0xFA, 0x7A, 0xAA, 0x2A])
    assert hashlib.sha256(alaw_encode(ALL_INT16)).hexdigest() == ALAW_ENCODE_SHA256
    assert alaw_decode(bytes([0xD5, 0x55, 0xAA, 0x2A])).tolist() == [8, -8, 32256, -32256]


def test_g711_matches_audioop_when_available() -> None:
    audioop = pytest.importorskip("audioop")
    raw = ALL_INT16.astype("<i2").tobytes()
    codes = bytes(range(256))
    assert ulaw_encode(ALL_INT16) == audioop.lin2ulaw(raw, 2)
    assert alaw_encode(ALL_INT16) == audioop.lin2alaw(raw, 2)
    assert ulaw_decode(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes, 2)
    assert alaw_decode(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes, 2)


def test_g711_round_trip_is_within_quantization() -> None:
    x = np.linspace(-30000, 30000, 1001).astype(np.int16)
    for enc, dec in ((ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)):
        y = dec(enc(x)).astype(np.int32)
        assert np.all(np.abs(y - x) <= np.maximum(np.abs(x.astype(np.int32)) // 16, 16))


def test_pcm16_float_round_trip_and_clipping() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0], dtype=np.float32)
    data = float32_to_pcm16(x)
    assert np.frombuffer(data, "<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767]
    back = pcm16_to_float32(data)
    assert back.dtype == np.float32
    assert np.allclose(back[:5], x[:5], atol=1e-4)
    with pytest.raises(AudioFormatError):
        pcm16_to_float32(b"\x00\x01\x02")


def test_base64_strict() -> None:
    assert b64decode_audio(b64encode_audio(b"\x01\x02\x03")) == b"\x01\x02\x03"
    for bad in ("not base64!", "AAA", "AA=A"):
        with pytest.raises(AudioFormatError):
            b64decode_audio(bad)


def test_wire_formats() -> None:
    assert wire_format("audio/pcm") is PCM24K and PCM24K.rate == 24000
    assert wire_format("audio/pcmu") is PCMU and wire_format("audio/pcma") is PCMA
    assert PCM24K.bytes_for_ms(20) == 960 and PCMU.bytes_for_ms(20) == 160
    assert PCM24K.duration_ms(48000) == 1000.0
    x = np.sin(np.linspace(0, 20, 800)).astype(np.float32) * 0.5
    for fmt in (PCM24K, PCMU, PCMA):
        assert np.abs(fmt.decode(fmt.encode(x)) - x).max() < 0.02
    with pytest.raises(AudioFormatError):
        wire_format("audio/opus")


@pytest.mark.parametrize(("src", "dst"), [(24000, 16000), (22050, 24000), (48000, 16000), (8000, 24000)])
def test_streaming_resampler_is_continuous_across_chunks(src: int, dst: int) -> None:
    t = np.arange(src * 2) / src
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    rs = StreamingResampler(src, dst)
    sizes = [1, 7, 160, 480, 333, 2048]
    parts, i, k = [], 0, 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        parts.append(rs.process(x[i : i + n]))
        i, k = i + n, k + 1
    parts.append(rs.flush())
    streamed = np.concatenate(parts)
    whole = resample(x, src, dst)
    assert len(streamed) == len(whole) == len(x) * dst // src
    assert np.abs(streamed - whole).max() < 1e-5
    # no clicks: the signal stays a smooth sine (max step bounded by the sine's slope)
    steps = np.abs(np.diff(streamed[dst // 10 : -dst // 10]))
    assert steps.max() < 2 * np.pi * 440 / dst * 0.5 * 1.05


def test_streaming_resampler_gives_the_same_samples_for_large_chunks() -> None:
    """Chunks longer than RESAMPLE_SLICE are fed to soxr in slices: same output."""
    x = (0.3 * np.sin(2 * np.pi * 330 * np.arange(48000) / 24000)).astype(np.float32)
    sliced, small = StreamingResampler(24000, 16000), StreamingResampler(24000, 16000)
    big = np.concatenate([sliced.process(x[:24000]), sliced.process(x[24000:]), sliced.flush()])
    ref = np.concatenate([small.process(x[i : i + 960]) for i in range(0, len(x), 960)] + [small.flush()])
    assert len(big) == len(ref) == 32000
    np.testing.assert_allclose(big, ref, atol=1e-6)


def test_streaming_resampler_memory_does_not_grow_with_the_chunk_size() -> None:
    """soxr keeps buffers sized to the largest chunk it saw: fed 1 s at a time, every open
    stream held ~280 KB (a session keeps one open for its input); sliced, ~70 KB."""
    code = (
        "import numpy as np, psutil\n"
        "from media.audio import StreamingResampler\n"
        "p = psutil.Process(); x = np.zeros(24000, np.float32)\n"
        "StreamingResampler(24000, 16000).process(x)\n"
        "before = p.memory_info().rss; keep = []\n"
        "for _ in range(200):\n"
        "    r = StreamingResampler(24000, 16000); r.process(x); r.process(x); keep.append(r)\n"
        "print((p.memory_info().rss - before) / 200)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    per_stream = float(out.stdout.strip())
    assert per_stream < 128 * 1024, f"{per_stream / 1024:.0f} KB per open stream"


def test_streaming_resampler_passthrough_and_restart() -> None:
    rs = StreamingResampler(24000, 24000)
    x = np.ones(10, dtype=np.float32)
    assert np.array_equal(rs.process(x), x)
    rs = StreamingResampler(24000, 16000)
    rs.process(np.zeros(4800, dtype=np.float32))
    assert len(rs.flush()) > 0
    assert len(rs.flush()) == 0  # a fresh stream holds nothing


def test_framer_slices_fixed_frames() -> None:
    framer = AudioFramer.for_duration(PCM24K, 40)
    assert framer.frame_bytes == 1920
    frames = framer.push(b"\x00" * 1000) + framer.push(b"\x01" * 3000)
    assert [len(f) for f in frames] == [1920, 1920]
    assert framer.pending_bytes == 160
    assert framer.flush() == b"\x01" * 160
    assert framer.flush() == b""
    with pytest.raises(ValueError):
        AudioFramer.for_duration(PCM24K, 10)
    assert AudioFramer.for_duration(PCMU, 20).frame_bytes == 160
