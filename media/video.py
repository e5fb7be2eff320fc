"""Video chunk encoders: JPEG per frame, and fragmented MP4 (H.264) with one fragment per chunk.

A chunk is the frames one world-model step made (uint8 ``[N, H, W, 3]``). The encoders are
synchronous and CPU-bound: callers run them in a worker thread (``asyncio.to_thread``),
never on the event loop. One encoder instance serves one stream and is not thread-safe;
a session encodes its chunks one after the other.

* ``jpeg``: one baseline JPEG per frame (Pillow); the chunk's bytes are the JPEGs back to
  back and :attr:`EncodedChunk.frame_byte_lengths` says where each one ends.
* ``m4s``: H.264 (``libx264``, bundled with PyAV's FFmpeg; ``ultrafast``/``zerolatency``,
  every chunk starts with an IDR frame) in fragmented MP4. The first chunk carries the init
  segment (``ftyp`` + ``moov``) followed by its ``moof`` + ``mdat``; every later chunk is one
  ``moof`` + ``mdat``. Concatenating all chunks gives a playable fMP4 file, and the pieces
  can be appended to a Media Source Extensions ``SourceBuffer`` as they come.

FFmpeg's mp4 muxer writes a fragment only when the next one starts (a chunk late), so each
chunk is muxed by its own short-lived muxer from packets of one long-lived encoder, and the
fragment's sequence number (``mfhd``) and decode time (``tfdt``) are patched to continue
the stream.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import numpy as np

FORMATS = ("jpeg", "m4s")


@dataclass(slots=True)
class EncodedChunk:
    data: bytes
    frame_count: int
    frame_byte_lengths: list[int] = field(default_factory=list)  # jpeg: one per frame
    init_byte_length: int = 0  # m4s: leading init segment bytes (first chunk only)


class ChunkEncoder(Protocol):
    format: str
    mime_type: str

    def encode(self, frames: np.ndarray) -> EncodedChunk: ...

    def close(self) -> None: ...


def _check_frames(frames: np.ndarray) -> np.ndarray:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"frames must be uint8 [N>0, H, W, 3], got {frames.dtype} {frames.shape}")
    return frames


class JpegEncoder:
    """One JPEG per frame (Pillow)."""

    format = "jpeg"
    mime_type = "image/jpeg"

    def __init__(self, quality: int = 80) -> None:
        if not 1 <= quality <= 95:
            raise ValueError(f"JPEG quality must lie in 1..95, got {quality}")
        self.quality = quality

    def encode(self, frames: np.ndarray) -> EncodedChunk:
        from PIL import Image

        pieces = []
        for frame in _check_frames(frames):
            buf = io.BytesIO()
            Image.fromarray(frame, "RGB").save(buf, "JPEG", quality=self.quality)
            pieces.append(buf.getvalue())
        return EncodedChunk(b"".join(pieces), len(pieces), [len(p) for p in pieces])

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------ fragmented MP4


def iter_boxes(data: bytes, start: int = 0, end: int | None = None) -> list[tuple[str, int, int]]:
    """Top-level ISO BMFF boxes in ``data[start:end]`` as (type, offset, size)."""
    end = len(data) if end is None else end
    boxes = []
    offset = start
    while offset + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, offset)
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, offset + 8)
        elif size == 0:
            size = end - offset
        if size < 8 or offset + size > end:
            raise ValueError(f"corrupt box {kind!r} at {offset} (size {size})")
        boxes.append((kind.decode("latin-1"), offset, size))
        offset += size
    return boxes


def find_box(data: bytes, path: str, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(offset, size) of the first box at ``path`` ("moof/traf/tfdt"); KeyError if absent."""
    head, _, rest = path.partition("/")
    for kind, offset, size in iter_boxes(data, start, end):
        if kind != head:
            continue
        if not rest:
            return offset, size
        body = offset + 8
        if kind == "stsd":
            body += 8  # full box header + entry count
        elif kind == "avc1":
            body += 78  # visual sample entry fields
        return find_box(data, rest, body, offset + size)
    raise KeyError(path)


def h264_codec_string(init: bytes) -> str:
    """RFC 6381 ``avc1.PPCCLL`` from the init segment's ``avcC`` box."""
    offset, _ = find_box(init, "moov/trak/mdia/minf/stbl/stsd/avc1/avcC")
    profile, compat, level = init[offset + 9 : offset + 12]
    return f"avc1.{profile:02X}{compat:02X}{level:02X}"


def h264_encoder_name() -> str:
    """The H.264 encoder this PyAV build has (libx264 in the PyPI wheels)."""
    import av

    for name in ("libx264", "libopenh264", "h264"):
        try:
            av.codec.Codec(name, "w")
        except Exception:
            continue
        return name
    raise RuntimeError("this PyAV/FFmpeg build has no H.264 encoder")


class Fmp4Encoder:
    """H.264 in fragmented MP4, one fragment per chunk (see the module docstring)."""

    format = "m4s"

    def __init__(self, width: int, height: int, fps: float, *, crf: int = 23) -> None:
        import av

        if width % 2 or height % 2:
            raise ValueError(f"H.264 (yuv420p) needs even width and height, got {width}x{height}")
        self.width, self.height = width, height
        self.rate = Fraction(fps).limit_denominator(1001)
        encoder: Any = av.CodecContext.create(h264_encoder_name(), "w")
        encoder.width, encoder.height = width, height
        encoder.pix_fmt = "yuv420p"
        encoder.time_base = 1 / self.rate
        encoder.framerate = self.rate
        encoder.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": str(crf)}
        encoder.open()
        self._encoder = encoder
        self._frames = 0  # frames encoded so far: the next chunk's first pts
        self._fragments = 0
        self._timescale = 0  # track timescale of the init segment (mdhd)
        self.mime_type = 'video/mp4; codecs="avc1.42E01E"'  # replaced by the real one after chunk 0

    def encode(self, frames: np.ndarray) -> EncodedChunk:
        import av

        packets = []
        for i, frame in enumerate(_check_frames(frames)):
            picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            picture.pts = i  # rebased per chunk; tfdt carries the stream position
            picture.time_base = self._encoder.time_base
            if i == 0:
                picture.pict_type = av.video.frame.PictureType.I  # each fragment starts decodable
            packets.extend(self._encoder.encode(picture))
        if len(packets) != len(frames):
            raise RuntimeError(f"encoder held frames back ({len(packets)}/{len(frames)} packets)")
        muxed = self._mux(packets)
        moof, _ = find_box(muxed, "moof")
        mdat, mdat_size = find_box(muxed, "mdat")
        fragment = bytearray(muxed[moof : mdat + mdat_size])
        init = b""
        if self._fragments == 0:
            init = muxed[:moof]
            offset, _ = find_box(init, "moov/trak/mdia/mdhd")
            version = init[offset + 8]
            self._timescale = struct.unpack_from(">I", init, offset + (28 if version else 20))[0]
            self.mime_type = f'video/mp4; codecs="{h264_codec_string(init)}"'
        self._patch_fragment(fragment)
        self._fragments += 1
        self._frames += len(frames)
        return EncodedChunk(init + bytes(fragment), len(frames), init_byte_length=len(init))

    def _mux(self, packets: list[Any]) -> bytes:
        import av

        buf = io.BytesIO()
        options = {"movflags": "empty_moov+default_base_moof+frag_keyframe"}
        with av.open(buf, "w", format="mp4", options=options) as container:
            stream = container.add_mux_stream("h264", rate=self.rate, width=self.width, height=self.height)
            stream.time_base = self._encoder.time_base
            for packet in packets:
                packet.stream = stream
                container.mux(packet)
        return buf.getvalue()

    def _patch_fragment(self, fragment: bytearray) -> None:
        """Continue the stream: fragment sequence number and base media decode time."""
        data = bytes(fragment)
        mfhd, _ = find_box(data, "moof/mfhd")
        struct.pack_into(">I", fragment, mfhd + 12, self._fragments + 1)
        tfdt, _ = find_box(data, "moof/traf/tfdt")
        decode_time = round(self._frames * self._timescale / self.rate)
        if data[tfdt + 8] == 1:
            struct.pack_into(">Q", fragment, tfdt + 12, decode_time)
        elif decode_time < 2**32:
            struct.pack_into(">I", fragment, tfdt + 12, decode_time)
        else:
            raise OverflowError("32-bit tfdt overflowed")

    def close(self) -> None:
        self._encoder = None  # the codec context frees itself when collected


def make_encoder(fmt: str, width: int, height: int, fps: float, *, jpeg_quality: int = 80) -> ChunkEncoder:
    """The encoder for a wire format (``jpeg`` or ``m4s``)."""
    if fmt == "jpeg":
        return JpegEncoder(jpeg_quality)
    if fmt == "m4s":
        return Fmp4Encoder(width, height, fps)
    raise ValueError(f"unknown video format {fmt!r} (expected one of {', '.join(FORMATS)})")
