"""Unit tests of the WebRTC media pieces on virtual time: pacer, playout buffer, tracks,
offer checks and ICE server parsing. No network."""

from __future__ import annotations

import asyncio
import fractions

import av
import numpy as np
import pytest

from media.pacing import FramePacer, PlayoutBuffer
from media.tracks import (
    InboundAudioPump,
    MediaStreamError,
    MediaStreamTrack,
    OutboundAudioTrack,
    frame_to_mono,
)
from media.webrtc import OfferError, check_offer, parse_ice_servers

pytestmark = pytest.mark.system


class VirtualTime:
    """A monotonic clock that only moves when something sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def tone(seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


# --- pacer ---------------------------------------------------------------------------------


async def test_pacer_releases_frames_on_a_fixed_grid() -> None:
    vt = VirtualTime()
    pacer = FramePacer(0.02, clock=vt.clock, sleep=vt.sleep)
    start = vt.now
    for n in range(50):
        assert await pacer.next_frame() == n
        assert vt.now == pytest.approx(start + n * 0.02)
        vt.now += 0.003  # producing a frame takes time: the grid must not drift with it
    assert max(pacer.lateness) == pytest.approx(0.0, abs=1e-9)


async def test_pacer_reanchors_after_a_stall_instead_of_bursting() -> None:
    vt = VirtualTime()
    pacer = FramePacer(0.02, clock=vt.clock, sleep=vt.sleep, max_lag_frames=5)
    for _ in range(3):
        await pacer.next_frame()
    vt.now += 0.5  # the loop stalled for 25 frames
    index = await pacer.next_frame()
    assert index == 3 and pacer.resyncs == 1
    before = vt.now
    await pacer.next_frame()
    assert vt.now - before == pytest.approx(0.02)  # one frame later, not a burst


# --- playout buffer ------------------------------------------------------------------------


def test_playout_buffer_pulls_frames_and_counts_playout() -> None:
    buf = PlayoutBuffer(48_000)
    buf.push("r1", tone(0.1, 24_000), 24_000)
    buf.finish("r1")
    assert buf.buffered_ms == pytest.approx(100, abs=1)
    played: dict[str, float] = {}
    drained: list[str] = []
    audible = 0
    for _ in range(10):
        frame = buf.pull(960)
        assert frame.samples.dtype == np.int16 and len(frame.samples) == 960
        played.update(frame.played_ms)
        drained += frame.drained
        audible += frame.audible
    assert played["r1"] == pytest.approx(100, abs=1)
    assert drained == ["r1"]
    assert audible == 5
    assert not buf.pull(960).audible


def test_playout_buffer_clear_drops_only_that_response() -> None:
    buf = PlayoutBuffer(48_000)
    buf.push("a", tone(0.2, 48_000), 48_000)
    buf.push("b", tone(0.2, 48_000), 48_000)
    buf.pull(960)
    dropped = buf.clear("a")
    assert dropped == int(0.2 * 48_000) - 960
    assert buf.holds("b") and not buf.holds("a")
    assert set(buf.pull(960).played_ms) == {"b"}
    buf.clear()
    assert buf.buffered_samples == 0 and not buf.pull(960).audible


def test_playout_buffer_is_bounded() -> None:
    buf = PlayoutBuffer(48_000, max_buffered_s=1.0)
    buf.push("r", tone(3.0, 48_000), 48_000)
    assert buf.buffered_samples == 48_000
    assert buf.dropped_samples == 2 * 48_000


def test_resampled_playout_has_no_seams() -> None:
    """Chunked 24 kHz input through the streaming resampler equals one-shot resampling."""
    signal = tone(0.5, 24_000, 0.3)
    buf = PlayoutBuffer(48_000)
    for chunk in np.array_split(signal, 7):
        buf.push("r", chunk, 24_000)
    buf.finish("r")
    out = np.concatenate([buf.pull(960).samples for _ in range(26)]).astype(np.float32) / 32767
    ref = tone(0.5, 48_000, 0.3)
    n = min(len(ref), 23_000)
    # Same sine up to the resampler's group delay; compare energy and spectrum peak.
    assert np.sqrt(np.mean(out[:n] ** 2)) == pytest.approx(np.sqrt(np.mean(ref[:n] ** 2)), rel=0.02)
    spectrum = np.abs(np.fft.rfft(out[1000:n]))
    assert np.argmax(spectrum) * 48_000 / len(out[1000:n]) == pytest.approx(440, abs=3)


# --- outbound track ------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.played: list[tuple[str, float]] = []
        self.finished: list[str] = []

    def playout(self, response_id: str, played_ms: float) -> None:
        self.played.append((response_id, played_ms))

    def playout_finished(self, response_id: str) -> None:
        self.finished.append(response_id)


async def test_outbound_track_is_silent_when_idle_and_paced() -> None:
    vt = VirtualTime()
    track = OutboundAudioTrack(clock=vt.clock, sleep=vt.sleep)
    frames = [await track.recv() for _ in range(5)]
    assert [f.pts for f in frames] == [0, 960, 1920, 2880, 3840]
    assert all(f.sample_rate == 48_000 and f.samples == 960 for f in frames)
    assert all(not np.any(f.to_ndarray()) for f in frames)
    assert vt.sleeps == pytest.approx([0.02] * 4)


async def test_outbound_track_reports_playout_and_finish() -> None:
    vt = VirtualTime()
    rec = Recorder()
    track = OutboundAudioTrack(rec, clock=vt.clock, sleep=vt.sleep)
    track.play("r1", tone(0.1, 24_000), 24_000)
    assert not np.any((await track.recv()).to_ndarray())  # one frame of pre-roll
    for _ in range(3):
        await track.recv()
    assert rec.played[-1] == ("r1", pytest.approx(60, abs=0.5))
    track.finish("r1")  # the response is complete while audio is still queued
    assert rec.finished == []
    for _ in range(3):
        await track.recv()
    assert rec.finished == ["r1"]  # reported when its last sample went out
    assert rec.played[-1][1] == pytest.approx(100, abs=1)


async def test_outbound_track_underrun_then_finish_reports_once_complete() -> None:
    vt = VirtualTime()
    rec = Recorder()
    track = OutboundAudioTrack(rec, clock=vt.clock, sleep=vt.sleep)
    track.play("r1", tone(0.02, 48_000), 48_000)
    await track.recv()  # pre-roll
    await track.recv()
    assert rec.finished == ["r1"]  # drained (the session ignores this while r1 still runs)
    track.finish("r1")
    assert rec.finished == ["r1", "r1"]


async def test_clear_silences_the_next_frame() -> None:
    vt = VirtualTime()
    track = OutboundAudioTrack(clock=vt.clock, sleep=vt.sleep)
    track.play("r1", tone(1.0, 48_000), 48_000)
    assert np.any((await track.recv()).to_ndarray())
    track.clear("r1")
    assert not np.any((await track.recv()).to_ndarray())
    assert track.buffer.buffered_samples == 0


async def test_stopped_track_raises() -> None:
    track = OutboundAudioTrack()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


# --- inbound -------------------------------------------------------------------------------


def stereo_frame(samples: np.ndarray, pts: int) -> av.AudioFrame:
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    interleaved = np.repeat(pcm, 2).reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(interleaved, format="s16", layout="stereo")
    frame.sample_rate = 48_000
    frame.pts = pts
    frame.time_base = fractions.Fraction(1, 48_000)
    return frame


def test_frame_to_mono_handles_packed_and_planar() -> None:
    signal = tone(0.02, 48_000, 0.25)
    mono = frame_to_mono(stereo_frame(signal, 0))
    assert mono.dtype == np.float32 and len(mono) == 960
    np.testing.assert_allclose(mono, signal, atol=1e-4)
    planar = av.AudioFrame.from_ndarray(np.stack([signal, signal]), format="fltp", layout="stereo")
    np.testing.assert_allclose(frame_to_mono(planar), signal, atol=1e-6)


class ListTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, frames: list[av.AudioFrame]) -> None:
        super().__init__()
        self.frames = frames

    async def recv(self) -> av.AudioFrame:
        if not self.frames:
            raise MediaStreamError
        return self.frames.pop(0)


async def test_inbound_pump_resamples_48k_to_16k() -> None:
    signal = tone(1.0, 48_000, 0.3)
    frames = [stereo_frame(signal[i : i + 960], i) for i in range(0, len(signal), 960)]
    got: list[np.ndarray] = []
    pump = InboundAudioPump(ListTrack(frames), lambda samples, rate: got.append(samples), rate=16_000)
    pump.start()
    for _ in range(100):
        await asyncio.sleep(0)
    await pump.aclose()
    out = np.concatenate(got)
    assert pump.frames == 50
    assert 16_000 - 400 <= len(out) <= 16_000  # the resampler holds back its ~21 ms filter delay
    assert np.sqrt(np.mean(out[1000:-1000] ** 2)) == pytest.approx(0.3 / np.sqrt(2), rel=0.02)


# --- offers and ICE servers ----------------------------------------------------------------

AUDIO_OFFER = (
    "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"
    "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=mid:0\r\na=sendrecv\r\na=rtcp-mux\r\n"
    "a=rtpmap:111 opus/48000/2\r\na=ice-ufrag:abcd\r\na=ice-pwd:0123456789abcdefghijkl\r\n"
    "a=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\na=setup:actpass\r\n"
)


def test_check_offer_accepts_an_audio_offer() -> None:
    assert [m.kind for m in check_offer(AUDIO_OFFER).media] == ["audio"]


@pytest.mark.parametrize(
    ("sdp", "why"),
    [
        ("", "empty"),
        ("hello", "must start with 'v=0'"),
        ("v=0\r\n", "no media sections"),
        (AUDIO_OFFER.replace("m=audio", "m=video"), "Unsupported media section 'video'"),
        (AUDIO_OFFER.replace("opus/48000/2", "L16/16000"), "No supported audio codec"),
        (AUDIO_OFFER.replace("a=ice-pwd:0123456789abcdefghijkl\r\n", ""), "no ICE credentials"),
        ("v=0\r\n" + AUDIO_OFFER.split("t=0 0\r\n")[1].replace("a=fingerprint", "a=x-fp"), "no DTLS"),
        (AUDIO_OFFER + AUDIO_OFFER.split("t=0 0\r\n")[1].replace("mid:0", "mid:1"), "exactly one audio"),
        ("v=0\r\nm=audio x\r\n", "Malformed SDP"),
    ],
)
def test_check_offer_says_why(sdp: str, why: str) -> None:
    with pytest.raises(OfferError, match=why):
        check_offer(sdp)


def test_parse_ice_servers() -> None:
    assert parse_ice_servers() == []
    stun, turn, turns = parse_ice_servers(
        ["stun.example.org:3478"],
        ["turn:alice:s3cret@turn.example.org:3478", "turns:bob:pw@t.example.org:5349"],
    )
    assert stun.to_browser() == {"urls": ["stun:stun.example.org:3478"]}
    assert turn.to_browser() == {
        "urls": ["turn:turn.example.org:3478?transport=udp"],
        "username": "alice",
        "credential": "s3cret",
    }
    assert turns.url == "turns:t.example.org:5349?transport=tcp"
    assert turn.to_aiortc().username == "alice"
    with pytest.raises(ValueError, match="STUN"):
        parse_ice_servers(["stun:user@host"])
    with pytest.raises(ValueError, match="TURN"):
        parse_ice_servers([], ["turn:user:pw@"])


async def test_underruns_count_only_real_gaps() -> None:
    vt = VirtualTime()
    track = OutboundAudioTrack(clock=vt.clock, sleep=vt.sleep)
    track.play("r1", tone(0.04, 48_000), 48_000)
    for _ in range(6):  # 1 frame of pre-roll, 2 frames of audio, then 3 frames dry
        await track.recv()
    assert track.underrun_frames == 0  # maybe it was all: not an underrun yet
    assert track.stats()["preroll_frames"] == 1
    track.play("r1", tone(0.04, 48_000), 48_000)  # more came 20 ms before the next frame
    assert np.any((await track.recv()).to_ndarray())
    assert track.underrun_frames == 3  # those 3 frames were a gap
    for _ in range(4):
        await track.recv()
    track.finish("r1")  # complete: the trailing silence was no underrun
    assert track.underrun_frames == 3
    assert track.stats()["underrun_frames"] == 3


def test_immediate_audio_buffer_hands_packets_on_at_once() -> None:
    from aiortc.rtp import RtpPacket

    from media.webrtc import ImmediateAudioBuffer

    buf = ImmediateAudioBuffer()

    def packet(seq: int) -> RtpPacket:
        p = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * 960, payload=bytes([seq % 256]))
        p._data = p.payload  # type: ignore[attr-defined]
        return p

    got = [buf.add(packet(s))[1] for s in (65534, 65535, 0, 0, 65535, 2, 1)]
    frames = [None if f is None else f.timestamp for f in got]
    # In order (across the sequence wrap) at once; the duplicate and the late ones dropped.
    assert frames == [65534 * 960, 65535 * 960, 0, None, None, 2 * 960, None]


def test_configured_ice_servers_reach_the_service_and_bad_ones_stop_startup() -> None:
    from web.app import create_app
    from web.settings import ServerSettings
    from web.transports.webrtc import WebRtcService

    service = WebRtcService(
        ServerSettings(stun=["stun:stun.example.org:3478"], turn=["u:p@turn.example.org"])
    )
    assert [s.url for s in service.ice_servers] == [
        "stun:stun.example.org:3478",
        "turn:turn.example.org?transport=udp",
    ]
    assert WebRtcService(ServerSettings()).ice_servers == []  # nothing public by default
    with pytest.raises(ValueError, match="TURN"):
        create_app(ServerSettings(turn=["turn:"]))
