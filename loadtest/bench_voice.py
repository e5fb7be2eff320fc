"""Voice-cascade latency and load, measured by WebSocket clients against ``omniduplex serve``.

Starts the server as a subprocess (``python -m web.cli serve``, voice-cascade, on loopback),
then runs four scenarios with clients that stream Piper speech as 20 ms
``input_audio_buffer.append`` events paced to real time (pre-encoded, so the client stays cheap):

* **turn latency, 1 and 8 sessions**: the client's last speech frame (the append carrying the
  utterance's last audible sample) → the first ``response.output_audio.delta``. Server VAD
  (``silence_duration_ms``) must hear that much silence first, so the target is
  ``silence + 400 ms`` (1 session) and ``silence + 800 ms`` (8 sessions). Each user listens
  to the whole reply, thinks 0.3–0.8 s and speaks again; the 8 sessions start staggered.
  The split: last speech → ``speech_stopped`` (VAD), → first transcript delta (ASR and the
  responder), → first audio delta (TTS of the first clause).
* **barge-in**: while a long response streams, the client starts speaking; first speech frame
  → ``response.done`` (cancelled), against the VAD onset: the end of the audio frame on which
  Silero fired (the earliest any detector could know). Target: ``done ≤ onset + 150 ms``.
* **CPU, 32 sessions**: 32 clients stream 24 kHz speech with pauses in real time, server VAD
  on, ``create_response: false`` (no responses); the server process's CPU (psutil), as % of
  one core, over the window. Target ≤ 50 %.

    .venv/bin/python -m loadtest.bench_voice --out bench_voice.json   # Markdown table on stdout

``--input-transcription`` has the sessions ask for input transcription, so the pipeline's live
ASR also transcribes the user while they speak (deltas); without it only the pause's transcript
the response starts on is made.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

from loadtest.server_process import server_cpu_s
from runtime.metrics import percentile

RATE = 24_000
CHUNK_MS = 20
CHUNK = RATE * CHUNK_MS // 1000
SENTENCE = "The quick brown fox jumps over the lazy dog."
INTERRUPTION = "Wait, stop please."
TURN_WAIT_S = 60.0  # per event of a turn; --turn-wait-s (an LM responder on a loaded box needs more)
INPUT_TRANSCRIPTION = False  # --input-transcription: sessions ask for the user's words as they speak
LONG_REPLY = ", ".join(f"the story goes on with chapter {k}" for k in range(1, 30)) + "."


# --- audio, prepared before the load ------------------------------------------------------


def synthesize(text: str) -> np.ndarray:
    """Deterministic Piper speech at 24 kHz with leading/trailing near-silence trimmed, so the
    first and last 20 ms chunks carry speech."""
    import soxr

    from engines.speech.tts import TtsConfig, shared_tts

    tts = shared_tts(TtsConfig(noise_scale=0.0, noise_w_scale=0.0))
    audio = np.asarray(soxr.resample(tts.synthesize_all(text), tts.sample_rate, RATE), dtype=np.float32)
    loud = np.flatnonzero(np.abs(audio) > 0.02 * float(np.abs(audio).max()))
    return audio[loud[0] : loud[-1] + 1]


def append_frames(audio: np.ndarray) -> list[str]:
    """`input_audio_buffer.append` events, one per 20 ms (the last one may be shorter)."""
    pcm = np.rint(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    return [
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(pcm[i : i + CHUNK].tobytes()).decode(),
            }
        )
        for i in range(0, len(pcm), CHUNK)
    ]


SILENCE_FRAME = append_frames(np.zeros(CHUNK, dtype=np.float32))[0]


# --- the server under test ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_server(port: int, data_dir: str, extra_args: list[str]) -> subprocess.Popen[bytes]:
    """`python -m web.cli serve` on loopback, its output in `<data_dir>/server.log`."""
    cmd = [sys.executable, "-m", "web.cli", "serve", "--port", str(port), "--data-dir", data_dir]
    if "--responder" not in extra_args:
        cmd += ["--responder", "echo"]  # deterministic replies unless a run asks for the LM
    with open(Path(data_dir) / "server.log", "wb") as log:  # the child keeps its own handle
        return subprocess.Popen([*cmd, "--log-level", "warning", *extra_args], stdout=log, stderr=log)


@contextlib.asynccontextmanager
async def server_process(extra_args: list[str]) -> AsyncIterator[tuple[str, int]]:
    """`omniduplex serve` in a subprocess; yields (WebSocket URL, pid)."""
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix="bench-voice-")
    proc = await asyncio.to_thread(spawn_server, port, data_dir, extra_args)
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}); see {data_dir}/server.log")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("server not ready in 300 s")
                await asyncio.sleep(0.2)
        yield f"ws://127.0.0.1:{port}/v1/realtime?model=voice-cascade", proc.pid
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown (stops the embedded Redis)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
        shutil.rmtree(data_dir, ignore_errors=True)


# --- one client session -------------------------------------------------------------------


@dataclass(slots=True)
class Arrival:
    at: float
    event: dict[str, Any]


class VoiceClient:
    """One realtime session: a real-time audio sender (silence unless an utterance is queued)
    and a reader that timestamps every server event."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[Arrival] = []
        self._waiters: list[tuple[Callable[[dict[str, Any]], bool], asyncio.Future[Arrival]]] = []
        self._script: list[str] = []
        self._sent: list[float] = []  # send time of each frame of the current utterance
        self.samples_sent = 0  # input audio timeline position (24 kHz samples)
        self._utterance_start_sample = 0
        self._done: asyncio.Future[None] | None = None

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._read())
            tg.create_task(self._send())

    async def _read(self) -> None:
        async for message in self.ws:
            arrival = Arrival(time.monotonic(), json.loads(message))
            self.events.append(arrival)
            for waiter in list(self._waiters):
                if not waiter[1].done() and waiter[0](arrival.event):
                    waiter[1].set_result(arrival)
                    self._waiters.remove(waiter)

    async def _send(self) -> None:
        start = time.monotonic()
        k = 0
        while True:
            delay = start + k * CHUNK_MS / 1000 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            k += 1
            scripted = bool(self._script)
            await self.ws.send(self._script.pop(0) if scripted else SILENCE_FRAME)
            self.samples_sent += CHUNK
            if scripted:
                self._sent.append(time.monotonic())
                if not self._script and self._done is not None and not self._done.done():
                    self._done.set_result(None)

    def wait(
        self, predicate: Callable[[dict[str, Any]], bool], within_s: float = 60.0
    ) -> Coroutine[Any, Any, Arrival]:
        """The first event ``predicate`` takes from now on (watched from this call, not from
        the await: send what it answers after); TimeoutError ``within_s`` after the await."""
        future: asyncio.Future[Arrival] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        return _within(future, within_s)

    async def speak(self, frames: list[str]) -> tuple[float, float, int]:
        """Queue an utterance; returns (first frame sent, last frame sent, timeline sample of
        its first frame) once it has all gone out."""
        self._sent = []
        self._done = asyncio.get_running_loop().create_future()
        self._utterance_start_sample = self.samples_sent
        self._script = list(frames)
        await self._done
        return self._sent[0], self._sent[-1], self._utterance_start_sample

    async def configure(self, **session: Any) -> None:
        updated = self.wait(lambda e: e["type"] == "session.updated")
        await self.ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", **session}}))
        await updated


async def _within(future: asyncio.Future[Arrival], within_s: float) -> Arrival:
    async with asyncio.timeout(within_s):  # not wait_for: on 3.11 it can swallow a cancel
        return await future


@contextlib.asynccontextmanager
async def session(url: str) -> AsyncIterator[VoiceClient]:
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        client = VoiceClient(ws)
        created = client.wait(lambda e: e["type"] == "session.created")
        task = asyncio.create_task(client.run(), name="voice-client")
        try:
            await created
            yield client
        finally:
            task.cancel()
            await asyncio.wait([task])


def vad(silence_ms: int, *, create_response: bool = True) -> dict[str, Any]:
    audio_input: dict[str, Any] = {
        "turn_detection": {
            "type": "server_vad",
            "silence_duration_ms": silence_ms,
            "create_response": create_response,
        }
    }
    if INPUT_TRANSCRIPTION:  # deltas of the user's words while they speak, then completed
        audio_input["transcription"] = {"model": "whisper-1"}
    return {"input": audio_input}


# --- scenarios ----------------------------------------------------------------------------


@dataclass(slots=True)
class TurnTiming:
    last_speech_to_stopped_ms: float
    last_speech_to_text_ms: float
    last_speech_to_audio_ms: float


async def one_turn(client: VoiceClient, frames: list[str]) -> TurnTiming:
    def first(kind: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e["type"] == kind

    stopped = client.wait(first("input_audio_buffer.speech_stopped"), TURN_WAIT_S)
    text = client.wait(first("response.output_audio_transcript.delta"), TURN_WAIT_S)
    audio = client.wait(first("response.output_audio.delta"), TURN_WAIT_S)
    done = client.wait(first("response.done"), TURN_WAIT_S)
    _, last, _ = await client.speak(frames)
    t_stopped, t_text, t_audio, t_done = await asyncio.gather(stopped, text, audio, done)
    response = t_done.event["response"]
    assert response["status"] == "completed", response["status_details"]
    # The user listens to the whole reply before speaking again (playback starts on arrival).
    b64_chars = sum(
        len(a.event["delta"])
        for a in client.events
        if a.event["type"] == "response.output_audio.delta" and a.event["response_id"] == response["id"]
    )
    await asyncio.sleep(max(0.0, t_audio.at + b64_chars * 3 / 4 / 2 / RATE - time.monotonic()))
    return TurnTiming((t_stopped.at - last) * 1000, (t_text.at - last) * 1000, (t_audio.at - last) * 1000)


async def turn_latency(
    url: str, sessions: int, turns: int, silence_ms: int, frames: list[str]
) -> list[TurnTiming]:
    # speech, silence, ~0.5 s to the reply, ~3.5 s of reply audio, a pause
    cycle_s = len(frames) * CHUNK_MS / 1000 + silence_ms / 1000 + 4.5

    async def run_one(index: int) -> list[TurnTiming]:
        async with session(url) as client:
            await client.configure(audio=vad(silence_ms))
            await asyncio.sleep(0.3 + index * cycle_s / sessions)  # stagger: turns end at different times
            out = []
            for _ in range(turns):
                out.append(await one_turn(client, frames))
                await asyncio.sleep(random.uniform(0.3, 0.8))  # the user thinks
            return out

    results = await asyncio.gather(*(run_one(k) for k in range(sessions)))
    return [t for per_session in results for t in per_session]


@dataclass(slots=True)
class BargeIn:
    onset_ms: float  # first speech frame sent → end of the frame Silero fired on (audio time)
    started_ms: float  # first speech frame sent → speech_started received
    done_ms: float  # first speech frame sent → response.done (cancelled) received


async def barge_in(url: str, trials: int, silence_ms: int, frames: list[str]) -> list[BargeIn]:
    out: list[BargeIn] = []
    prefix_ms = 300  # the server VAD's default prefix_padding_ms
    for _ in range(trials):
        # A fresh session per trial: an unanswered interruption would join the next prompt.
        async with session(url) as client:
            await client.configure(audio=vad(silence_ms, create_response=False))
            await asyncio.sleep(0.5)  # some audio history before the long reply starts
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": LONG_REPLY}],
            }
            await client.ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            first_audio = client.wait(lambda e: e["type"] == "response.output_audio.delta")
            await client.ws.send(json.dumps({"type": "response.create"}))
            await first_audio
            await asyncio.sleep(random.uniform(0.2, 1.0))  # the reply is playing
            started = client.wait(lambda e: e["type"] == "input_audio_buffer.speech_started")
            done = client.wait(lambda e: e["type"] == "response.done")
            speaking = asyncio.create_task(client.speak(frames))
            t_started, t_done = await asyncio.gather(started, done)
            first, _, start_sample = await speaking
            response = t_done.event["response"]
            assert response["status"] == "cancelled", "the reply ended before the barge-in"
            assert response["status_details"]["reason"] == "turn_detected"
            # audio_start_ms = onset frame start - prefix padding (16 kHz timeline, in ms).
            onset_frame_end_ms = t_started.event["audio_start_ms"] + prefix_ms + 32
            onset_ms = onset_frame_end_ms - start_sample * 1000 / RATE
            out.append(BargeIn(onset_ms, (t_started.at - first) * 1000, (t_done.at - first) * 1000))
    return out


async def cpu_load(url: str, pid: int, sessions: int, seconds: float, frames: list[str]) -> dict[str, Any]:
    """Server CPU (% of one core, the process and its threads) in 5 s windows while
    `sessions` clients stream speech with pauses in real time, no responses."""
    import psutil

    server = psutil.Process(pid)
    me = psutil.Process(os.getpid())
    pause = [SILENCE_FRAME] * 40  # 0.8 s between utterances

    async def stream(client: VoiceClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await client.speak(frames + pause)

    def busy(p: Any) -> float:
        t = p.cpu_times()
        return float(t.user + t.system)

    windows: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(session(url)) for _ in range(sessions)]
        for client in clients:
            await client.configure(audio=vad(500, create_response=False))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            for k, client in enumerate(clients):
                tg.create_task(_delayed(stream(client, stop), k * 0.05))
            await asyncio.sleep(3.0)  # warm-up: every session streaming
            sent0, c0, t0 = sum(c.samples_sent for c in clients), busy(me), time.monotonic()
            for _ in range(max(1, round(seconds / 5))):
                w0, s0 = time.monotonic(), busy(server)
                await asyncio.sleep(5.0)
                windows.append(100 * (busy(server) - s0) / (time.monotonic() - w0))
            sent1, c1, t1 = sum(c.samples_sent for c in clients), busy(me), time.monotonic()
            stop.set()
        responses = sum(1 for c in clients for a in c.events if a.event["type"] == "response.created")
        turns = sum(1 for c in clients for a in c.events if a.event["type"] == "input_audio_buffer.committed")
    wall = t1 - t0
    return {
        "windows_pct": [round(w, 1) for w in windows],
        "server_cpu_pct": percentile(windows, 50),
        "client_cpu_pct": 100 * (c1 - c0) / wall,
        # Audio the clients sent per second of wall time, over what real time would be.
        "realtime_ratio": (sent1 - sent0) / RATE / wall / sessions,
        "turns_committed": turns,
        "responses": responses,
    }


async def _delayed(coro: Any, delay: float) -> None:
    await asyncio.sleep(delay)
    await coro


def log(message: str) -> None:
    print(f"[bench_voice {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- report -------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    p50, p90 = percentile(values, 50), percentile(values, 90)
    return {"p50": p50, "p90": p90, "max": max(values), "n": len(values)}


@dataclass(slots=True)
class Report:
    silence_ms: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)  # 1-min load average as each run began

    def note_load(self, scenario: str) -> None:
        """Other work on the machine skews every figure here: keep the load next to them."""
        self.load[scenario] = round(os.getloadavg()[0], 2)

    def add(
        self, metric: str, sessions: int, values: list[float], target: float | None, unit: str = "ms"
    ) -> None:
        s = summary(values)
        ok = None if target is None else s["p50"] <= target
        self.rows.append(
            {"metric": metric, "sessions": sessions, **s, "target": target, "unit": unit, "meets": ok}
        )

    def markdown(self) -> str:
        lines = [
            "| metric | sessions | p50 | p90 | max | n | target (p50) | |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            target = "" if r["target"] is None else f"≤ {r['target']:.0f} {r['unit']}"
            verdict = "" if r["meets"] is None else ("meets" if r["meets"] else "**MISSES**")
            lines.append(
                f"| {r['metric']} | {r['sessions']} | {num(r['p50'])} | {num(r['p90'])} | {num(r['max'])} | "
                f"{r['n']} | {target} | {verdict} |"
            )
        return "\n".join(lines)


def num(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


SCENARIOS = ("turns", "barge", "cpu")


async def main_async(args: argparse.Namespace) -> Report:
    speech = append_frames(synthesize(SENTENCE))
    interruption = append_frames(synthesize(INTERRUPTION))
    report = Report(args.silence_ms)
    s = args.silence_ms
    async with server_process(args.server_arg) as (url, pid):
        log(f"server ready (pid {pid}); warm-up turn")
        await turn_latency(url, 1, 1, s, speech)  # warm-up: first-call costs of every model
        if "turns" in args.scenarios:
            for sessions, slack in ((1, 400), (args.sessions, 800)):
                log(f"turn latency: {sessions} session(s) x {args.turns} turns")
                report.note_load(f"turns_{sessions}")
                cpu0 = server_cpu_s(pid)
                timings = await turn_latency(url, sessions, args.turns, s, speech)
                report.add(
                    "server CPU per turn (all of it)",
                    sessions,
                    [(server_cpu_s(pid) - cpu0) / len(timings)],
                    None,
                    "s",
                )
                report.raw[f"turns_{sessions}"] = [vars_of(t) for t in timings]
                stopped = [t.last_speech_to_stopped_ms for t in timings]
                report.add("last speech → speech_stopped", sessions, stopped, None)
                text = [t.last_speech_to_text_ms for t in timings]
                report.add("last speech → first reply text (transcript delta)", sessions, text, None)
                audio = [t.last_speech_to_audio_ms for t in timings]
                report.add("last speech → first audio delta", sessions, audio, s + slack)
        if "barge" in args.scenarios:
            log(f"barge-in: {args.barge_trials} trials")
            report.note_load("barge_in")
            trials = await barge_in(url, args.barge_trials, s, interruption)
            report.raw["barge_in"] = [vars_of(t) for t in trials]
            report.add("barge-in: first frame → VAD onset (audio)", 1, [t.onset_ms for t in trials], None)
            report.add("barge-in: first frame → speech_started", 1, [t.started_ms for t in trials], None)
            onset_p50 = percentile([t.onset_ms for t in trials], 50)
            report.add(
                "barge-in: first frame → response.done", 1, [t.done_ms for t in trials], onset_p50 + 150
            )
            report.add(
                "barge-in: response.done − VAD onset", 1, [t.done_ms - t.onset_ms for t in trials], 150
            )
        if "cpu" in args.scenarios:
            log(f"CPU: {args.cpu_sessions} sessions streaming for {args.cpu_seconds:g} s")
            report.note_load("cpu")
            cpu = await cpu_load(url, pid, args.cpu_sessions, args.cpu_seconds, speech)
            assert cpu["responses"] == 0, "the CPU run must not create responses"
            report.raw["cpu"] = cpu
            report.add("server CPU, streaming, no responses", args.cpu_sessions, cpu["windows_pct"], 50, "%")
    return report


def vars_of(obj: Any) -> dict[str, float]:
    return {name: round(getattr(obj, name), 1) for name in obj.__slots__}


def main(argv: list[str] | None = None) -> int:
    global TURN_WAIT_S, INPUT_TRANSCRIPTION
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--silence-ms", type=int, default=500, help="server VAD silence_duration_ms")
    parser.add_argument("--turns", type=int, default=4, help="turns per session in the latency runs")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions in the second run")
    parser.add_argument("--barge-trials", type=int, default=6)
    parser.add_argument("--cpu-sessions", type=int, default=32)
    parser.add_argument("--cpu-seconds", type=float, default=20.0)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `omniduplex serve` argument")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--turn-wait-s", type=float, default=TURN_WAIT_S, help="how long a turn may take (LM replies: longer)"
    )
    parser.add_argument(
        "--input-transcription",
        action="store_true",
        help="sessions ask for input audio transcription (the user's words while they speak)",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        help="what to run (default: all)",
    )
    args = parser.parse_args(argv)
    TURN_WAIT_S = args.turn_wait_s
    INPUT_TRANSCRIPTION = args.input_transcription
    report = asyncio.run(main_async(args))
    print(f"voice-cascade, silence_duration_ms={args.silence_ms}, {os.cpu_count()} CPUs\n")
    print(report.markdown())
    print("\n1-min load average as each run began: " + ", ".join(f"{k} {v}" for k, v in report.load.items()))
    if args.out is not None:
        doc = {
            "silence_ms": report.silence_ms,
            "cpus": os.cpu_count(),
            "rows": report.rows,
            "raw": report.raw,
            "load_average": report.load,
        }
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
