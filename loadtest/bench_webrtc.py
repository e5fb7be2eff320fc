"""WebRTC against WebSocket on the same server and pipeline (voice-cascade, loopback).

Starts ``omniduplex serve`` as a subprocess, then measures, one session at a time:

* **first-audio latency, WebRTC − WebSocket.** Both clients stream the same Piper sentence in
  real time (WebSocket: 20 ms PCM16 appends; WebRTC: 20 ms frames on the Opus track) and wait
  for the answer. End of speech is when the utterance's last frame left the client; first
  audio is when the answer's first audible sample (|x| > 0.02) could play: over WebSocket the
  first delta's arrival plus that sample's offset (playback starts with the first delta), over
  WebRTC the arrival of the RTP packet carrying it (tapped before aiortc's jitter buffer) plus
  its offset in the packet. Turns alternate between transports. Target: median difference
  ≤ 40 ms. Also reported: the track path alone, first audible packet − the
  ``output_audio_buffer.started`` event (sent when the first audio is queued on the track).
* **outbound pacing jitter** of the server's track (one session, during the turns): p99 of
  |packet inter-arrival − 20 ms| at the client. Target ≤ 5 ms. Also at the client: each
  packet's arrival against the 20 ms grid its RTP timestamp puts it on (arrival − timestamp,
  minus the smallest of the last second's), and on the server (the track's own log line per call): wake-up
  and hand-on time of each frame against the grid, and hand-on interval − 20 ms. Underruns:
  digitally silent packets inside an answer while the pipeline runs ahead of real time
  (server count: the track's; client count: silent packets between audible ones). Target 0.
  The load average is recorded at start and end: the figures depend on it.
* **barge-in**: while the answer plays, the client speaks again; interruption onset (its first
  frame sent) → the server's track is silent (the first packet from which every packet is
  silent until the next answer), against the VAD onset (``speech_started`` arrival).
  Target: silent ≤ VAD onset + 100 ms.

    .venv/bin/python -m loadtest.bench_webrtc --trials 6 --out bench_webrtc.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from loadtest.report import publish
from loadtest.server_process import ConfigSpec, ServerProcess, Target
from loadtest.stats import summarize
from runtime.metrics import percentile

WS_RATE = 24_000
RTC_RATE = 48_000
FRAME_MS = 20
AUDIBLE = 0.02  # first-audio threshold, full scale 1.0
SILENT = 1e-3  # a packet whose decoded peak is below this is silence
SENTENCE = "The quick brown fox jumps over the lazy dog."
INTERRUPTION = "Wait, stop please, I have another question."
SESSION = {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}


def synthesize(text: str, rate: int) -> np.ndarray:
    """Deterministic Piper speech, trimmed so its first and last frames carry speech."""
    import soxr

    from engines.speech.tts import TtsConfig, shared_tts

    tts = shared_tts(TtsConfig(noise_scale=0.0, noise_w_scale=0.0))
    audio = np.asarray(soxr.resample(tts.synthesize_all(text), tts.sample_rate, rate), dtype=np.float32)
    loud = np.flatnonzero(np.abs(audio) > 0.02 * float(np.abs(audio).max()))
    return audio[loud[0] : loud[-1] + 1]


# --- WebSocket turns -----------------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    transport: str
    speech_end: float
    first_audio: float | None = None
    started_event: float | None = None  # WebRTC: output_audio_buffer.started arrival
    onset_ms: float | None = None  # WebSocket: first audible sample's offset into the answer

    @property
    def latency_ms(self) -> float | None:
        return None if self.first_audio is None else (self.first_audio - self.speech_end) * 1000

    @property
    def track_path_ms(self) -> float | None:
        if self.first_audio is None or self.started_event is None:
            return None
        return (self.first_audio - self.started_event) * 1000


def pcm16_append(samples: np.ndarray) -> str:
    pcm = np.rint(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


async def websocket_turn(target: Target, speech: np.ndarray) -> Turn:
    chunk = WS_RATE * FRAME_MS // 1000
    frames = [pcm16_append(speech[i : i + chunk]) for i in range(0, len(speech), chunk)]
    silence = pcm16_append(np.zeros(chunk, np.float32))
    async with websockets.connect(f"{target.ws_url}?model=voice-cascade", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        speech_end: list[float] = []

        async def sender() -> None:
            start = time.monotonic()
            for k in range(100_000):
                delay = start + k * FRAME_MS / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                speaking = 25 <= k < 25 + len(frames)  # half a second of silence first
                await ws.send(frames[k - 25] if speaking else silence)
                if k == 24 + len(frames):
                    speech_end.append(time.monotonic())

        task = asyncio.create_task(sender(), name="ws-bench-sender")
        try:
            offset = 0
            first_delta: float | None = None
            async for message in ws:
                now = time.monotonic()
                event = json.loads(message)
                if event["type"] != "response.output_audio.delta" or not speech_end:
                    continue
                pcm = np.frombuffer(base64.b64decode(event["delta"]), "<i2").astype(np.float32) / 32768
                first_delta = now if first_delta is None else first_delta
                loud = np.flatnonzero(np.abs(pcm) > AUDIBLE)
                if len(loud):
                    # Playback started with the first delta; this sample plays `offset + k` later.
                    onset = (offset + int(loud[0])) / WS_RATE
                    at = max(now, first_delta + onset)
                    return Turn("websocket", speech_end[0], at, onset_ms=onset * 1000)
                offset += len(pcm)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    raise RuntimeError("the WebSocket closed before any answer audio")


# --- WebRTC turns --------------------------------------------------------------------------


@dataclass(slots=True)
class Packets:
    """Tapped RTP packets of one call, decoded: arrival times and 48 kHz samples."""

    at: np.ndarray
    samples: list[np.ndarray]

    @classmethod
    def of(cls, client: Any) -> Packets:
        import av

        from media.tracks import frame_to_mono

        codec = av.CodecContext.create("opus", "r")
        arrivals = list(client.rtp)
        samples = []
        for packet in arrivals:
            frames = codec.decode(av.Packet(packet.payload))
            samples.append(np.concatenate([frame_to_mono(f) for f in frames]) if frames else np.zeros(0))
        return cls(np.array([p.at for p in arrivals]), samples)

    def peak(self, k: int) -> float:
        return float(np.abs(self.samples[k]).max()) if len(self.samples[k]) else 0.0

    def first_audible(self, after: float) -> float | None:
        for k in np.flatnonzero(self.at > after):
            loud = np.flatnonzero(np.abs(self.samples[k]) > AUDIBLE)
            if len(loud):
                return float(self.at[k]) + int(loud[0]) / RTC_RATE
        return None


@contextlib.asynccontextmanager
async def webrtc_call(target: Target) -> AsyncIterator[Any]:
    from loadtest.webrtc_client import RealtimeCallClient

    client = RealtimeCallClient(target.base_url, keep_audio=False, tap_rtp=True)
    await client.connect()
    try:
        client.send({"type": "session.update", "session": SESSION})
        await client.wait_event("session.updated")
        await asyncio.sleep(0.5)
        yield client
    finally:
        # Hang up first: a peer that just goes away keeps its session (and slot) for the grace period.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10.0):
                await client.hangup()
        await client.close()


def grid_offsets_ms(packets: Packets, timestamps: list[int], window: int = 50) -> list[float]:
    """Each packet's arrival against the grid of its RTP timestamp (48 kHz, unwrapped): its
    transit (arrival − timestamp) minus the smallest of the `window` packets up to it (1 s),
    i.e. how late it came relative to the recent punctual ones. The window lets a re-anchored
    pacer (after a stall) set a new grid instead of counting every later packet as late."""
    if not timestamps:
        return []
    ts = np.unwrap(np.asarray(timestamps, dtype=np.float64), period=2**32)
    transit = packets.at - (ts - ts[0]) / RTC_RATE
    floor = [transit[max(0, k - window + 1) : k + 1].min() for k in range(len(transit))]
    return ((transit - np.asarray(floor)) * 1000).tolist()


async def webrtc_turn(
    target: Target,
    speech: np.ndarray,
    jitter: list[float],
    underruns: list[int],
    grid: list[float],
    calls: list[dict[str, float]],
) -> Turn:
    async with webrtc_call(target) as client:
        utterance = client.say("user", speech, RTC_RATE)
        started_at, _ = await client.wait_event("output_audio_buffer.started", timeout_s=60)
        stopped_at, _ = await client.wait_event("output_audio_buffer.stopped", timeout_s=60)
        await asyncio.sleep(0.2)
        packets = Packets.of(client)
        timestamps = [p.timestamp for p in client.rtp]
    assert utterance.ended_at is not None
    call_jitter = np.abs(np.diff(packets.at) * 1000 - FRAME_MS)
    call_grid = grid_offsets_ms(packets, timestamps)
    jitter.extend(call_jitter.tolist())
    grid.extend(call_grid)
    calls.append(
        {
            "load1": round(os.getloadavg()[0], 2),
            "jitter_p99_ms": round(percentile(call_jitter, 99), 2),
            "grid_p99_ms": round(percentile(call_grid, 99), 2),
        }
    )
    first = packets.first_audible(utterance.ended_at)
    if first is not None:
        # Digital silence between the answer's first and last audible packets: an underrun.
        start = int(np.searchsorted(packets.at, first))
        audible = [
            k
            for k in range(start, len(packets.at))
            if packets.at[k] <= stopped_at and packets.peak(k) > AUDIBLE
        ]
        if audible:
            underruns.append(sum(1 for k in range(start, audible[-1]) if packets.peak(k) < 1e-4))
    return Turn("webrtc", utterance.ended_at, first, started_at)


@dataclass(slots=True)
class BargeIn:
    vad_ms: float  # interruption onset → speech_started arrival
    silent_ms: float  # interruption onset → the track is silent
    margin_ms: float = field(init=False)

    def __post_init__(self) -> None:
        self.margin_ms = self.silent_ms - self.vad_ms


async def webrtc_barge_in(target: Target, speech: np.ndarray, interruption: np.ndarray) -> BargeIn:
    async with webrtc_call(target) as client:
        client.say("user", speech, RTC_RATE)
        await client.wait_event("output_audio_buffer.started", timeout_s=60)
        await asyncio.sleep(0.8)  # let the answer play a while
        mark = len(client.events)
        utterance = client.say("interruption", interruption, RTC_RATE)
        vad_at, _ = await client.wait_event("input_audio_buffer.speech_started", after=mark, timeout_s=30)
        await client.wait_event("output_audio_buffer.cleared", after=mark, timeout_s=30)
        await asyncio.sleep(0.6)
        packets = Packets.of(client)
    assert utterance.started_at is not None
    onset = utterance.started_at
    # The first packet after the onset from which everything up to now is silent.
    after = np.flatnonzero(packets.at > onset)
    silent_from = None
    for k in reversed(after):
        if packets.peak(int(k)) >= SILENT:
            break
        silent_from = float(packets.at[k])
    if silent_from is None:
        raise RuntimeError("the track never went silent after the interruption")
    return BargeIn(vad_ms=(vad_at - onset) * 1000, silent_ms=(silent_from - onset) * 1000)


# --- the run -------------------------------------------------------------------------------


async def run(trials: int, barge_trials: int, log_dir: Path) -> dict[str, Any]:
    speech24 = await asyncio.to_thread(synthesize, SENTENCE, WS_RATE)
    speech48 = await asyncio.to_thread(synthesize, SENTENCE, RTC_RATE)
    interruption48 = await asyncio.to_thread(synthesize, INTERRUPTION, RTC_RATE)
    turns: list[Turn] = []
    jitter: list[float] = []
    underruns: list[int] = []
    grid: list[float] = []
    calls: list[dict[str, float]] = []
    barge: list[BargeIn] = []
    load_start = os.getloadavg()
    server = ServerProcess(ConfigSpec("webrtc-bench", ["--log-level", "info"]), log_dir=log_dir)
    async with server as target:
        await websocket_turn(target, speech24)  # warm-up: models, caches
        for k in range(trials):
            print(f"turn {k + 1}/{trials}", file=sys.stderr)
            turns.append(await websocket_turn(target, speech24))
            turns.append(await webrtc_turn(target, speech48, jitter, underruns, grid, calls))
        for k in range(barge_trials):
            print(f"barge-in {k + 1}/{barge_trials}", file=sys.stderr)
            barge.append(await webrtc_barge_in(target, speech48, interruption48))
        await asyncio.sleep(1.0)  # the last call's summary reaches the log
    load_end = os.getloadavg()
    tracks = track_summaries(server.log_path)
    turn_tracks = tracks[:trials]  # the voice turns' calls (the barge-in calls come after)
    ws = [t.latency_ms for t in turns if t.transport == "websocket"]
    rtc = [t.latency_ms for t in turns if t.transport == "webrtc"]
    return {
        "first_audio_ms": {"websocket": summarize(ws), "webrtc": summarize(rtc)},
        "first_audio_diff_ms": median_diff(rtc, ws),
        "track_path_ms": summarize(t.track_path_ms for t in turns if t.transport == "webrtc"),
        "ws_onset_ms": summarize(t.onset_ms for t in turns if t.transport == "websocket"),
        "transport_added_ms": median_diff(
            [t.track_path_ms for t in turns if t.transport == "webrtc"],
            [t.onset_ms for t in turns if t.transport == "websocket"],
        ),
        "pacing_jitter_ms": summarize(jitter, digits=2),
        "arrival_vs_grid_ms": summarize(grid, digits=2),
        "server_pacer_late_p99_ms": max((t["late_p99_ms"] for t in turn_tracks), default=None),
        "server_sent_late_p99_ms": max((t.get("sent_p99_ms", 0.0) for t in turn_tracks), default=None),
        "server_sent_gap_p99_ms": max((t.get("gap_p99_ms", 0.0) for t in turn_tracks), default=None),
        "server_underrun_frames": sum(int(t["underrun_frames"]) for t in tracks),
        "load_average": {"start": [round(v, 2) for v in load_start], "end": [round(v, 2) for v in load_end]},
        "silent_packets_inside_answers": sum(underruns),
        "barge_in": {
            "vad_onset_ms": summarize(b.vad_ms for b in barge),
            "silent_ms": summarize(b.silent_ms for b in barge),
            "silent_minus_vad_ms": summarize(b.margin_ms for b in barge),
        },
        "webrtc_calls": [
            call
            | {
                "server_gap_p99_ms": track.get("gap_p99_ms"),
                "server_underrun_frames": track.get("underrun_frames"),
            }
            for call, track in zip(calls, turn_tracks + [{}] * len(calls), strict=False)
        ],
        "turns": [asdict(t) | {"latency_ms": t.latency_ms} for t in turns],
        "barge_trials": [asdict(b) for b in barge],
        "server_tracks": tracks,
    }


def median_diff(a: list[float | None], b: list[float | None]) -> float | None:
    a_ok = [v for v in a if v is not None]
    b_ok = [v for v in b if v is not None]
    return round(percentile(a_ok, 50) - percentile(b_ok, 50), 1) if a_ok and b_ok else None


def track_summaries(log_path: Path) -> list[dict[str, Any]]:
    """The server's per-call outbound track stats (web/transports/webrtc.py logs one line per call)."""
    marker = "outbound track "
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if marker in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line.split(marker, 1)[1]))
    return out


def report(result: dict[str, Any]) -> str:
    fa = result["first_audio_ms"]
    jit = result["pacing_jitter_ms"]
    barge = result["barge_in"]
    diff = result["first_audio_diff_ms"]
    added = result["transport_added_ms"]
    margin = barge["silent_minus_vad_ms"]["p50"]
    under = result["server_underrun_frames"]

    def verdict(value: float | None, target: float) -> str:
        return "–" if value is None else ("met" if value <= target else "MISSED")

    rows = [
        ("first audio, WebSocket (median)", f"{fa['websocket']['p50']} ms", "", ""),
        ("first audio, WebRTC (median)", f"{fa['webrtc']['p50']} ms", "", ""),
        ("WebRTC − WebSocket, end to end (medians)", f"{diff} ms", "≤ 40 ms", verdict(diff, 40)),
        (
            "WebRTC track path − WebSocket playback offset (medians)",
            f"{added} ms",
            "≤ 40 ms",
            verdict(added, 40),
        ),
        (
            "pacing jitter p99, client (|inter-arrival − 20 ms|)",
            f"{jit['p99']} ms",
            "≤ 5 ms",
            verdict(jit["p99"], 5),
        ),
        ("arrival − RTP-timestamp grid p99, client", f"{result['arrival_vs_grid_ms']['p99']} ms", "", ""),
        (
            "frame hand-on interval − 20 ms p99, server track (worst call)",
            f"{result['server_sent_gap_p99_ms']} ms",
            "≤ 5 ms",
            verdict(result["server_sent_gap_p99_ms"], 5),
        ),
        (
            "pacer wake-up / hand-on − grid p99, server track (worst call)",
            f"{result['server_pacer_late_p99_ms']} / {result['server_sent_late_p99_ms']} ms",
            "",
            "",
        ),
        ("underrun frames (server track)", str(under), "0", verdict(under, 0)),
        ("silent packets inside answers (client)", str(result["silent_packets_inside_answers"]), "0", ""),
        ("barge-in: onset → VAD speech_started (median)", f"{barge['vad_onset_ms']['p50']} ms", "", ""),
        ("barge-in: onset → track silent (median)", f"{barge['silent_ms']['p50']} ms", "", ""),
        ("barge-in: silent − VAD onset (median)", f"{margin} ms", "≤ 100 ms", verdict(margin, 100)),
    ]
    lines = ["| measure | value | target | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    load = result["load_average"]
    lines.append(f"\nload average (1/5/15 min): start {load['start']}, end {load['end']}")
    lines.append("per voice call: load1 → client jitter p99 / server hand-on interval p99 / underrun frames")
    for c in result["webrtc_calls"]:
        server = f"{c['server_gap_p99_ms']} ms / {c['server_underrun_frames']}"
        lines.append(f"  {c['load1']:5.2f} → {c['jitter_p99_ms']} / {server}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6, help="voice turns per transport")
    parser.add_argument("--barge-trials", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")
    parser.add_argument("--log-dir", type=Path, default=None, help="server log directory")
    args = parser.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-webrtc-"))
    result = asyncio.run(run(args.trials, args.barge_trials, log_dir))
    publish(report(result), result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
