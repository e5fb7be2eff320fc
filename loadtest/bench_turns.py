"""End of turn: server_vad (500 ms) against semantic_vad at each eagerness, in one run.

Starts ``omniduplex serve`` on a null pipeline (no responder model: a fixed 1 s answer 200 ms
after admission) with the live request of voice-cascade (Silero VAD, then the end-of-turn
stage: Smart Turn v3.2), and streams the evaluation set (:mod:`loadtest.turn_set`: finished
sentences, and sentences with a 0.6-2 s pause mid-clause) in real time, 40 ms appends of 24 kHz
PCM16, over several sessions per configuration, all configurations at once. Per clip it
reads the VAD events and ``response.created``:

- false cut-off: a paused sentence whose turn ended inside its pause (``speech_stopped`` with
  ``audio_end_ms`` in the pause);
- answered once with the whole sentence: one ``speech_stopped`` (at the sentence's end) and
  one ``response.created`` for the clip;
- end of speech -> ``response.created`` (finished sentences answered once): wall time from
  sending the clip's last speech sample to receiving the event; and to the response's first
  ``response.output_audio.delta``;
- CPU per decision: the model's thread CPU time for one score (features and ONNX), measured
  in this process on the set's clips; decisions per session-second from the server's
  ``end_of_turn`` stage counter; sessions one core holds = 1 / (decisions per second x CPU).

With ``--transcripts`` the pipeline also has voice-cascade's live ASR (and an ASR before the
answer, so the session transcribes its pauses ahead): semantic_vad then decides on the words of
the turn so far too (``session.realtime.semantic_turn.TurnCues``).

    python -m loadtest.bench_turns [--sessions 4] [--clips 120] [--transcripts] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from engines.speech.int8_kernels import exact_int8_compute_type
from loadtest.realtime_client import RealtimeClient
from loadtest.server_process import free_port, wait_ready
from loadtest.stats import summarize
from loadtest.turn_set import RATE, Clip, turn_set

WIRE = 24_000
APPEND_S = 0.04
LEAD_S = 0.4  # silence before each clip
CONFIGS: dict[str, dict[str, Any]] = {
    "server_vad": {"type": "server_vad", "silence_duration_ms": 500},
    "semantic_low": {"type": "semantic_vad", "eagerness": "low"},
    "semantic_medium": {"type": "semantic_vad", "eagerness": "medium"},
    "semantic_high": {"type": "semantic_vad", "eagerness": "high"},
    "semantic_auto": {"type": "semantic_vad", "eagerness": "auto"},
}
MAX_WAIT_S = {
    "server_vad": 0.5,
    "semantic_low": 8,
    "semantic_medium": 4,
    "semantic_high": 2,
    "semantic_auto": 4,
}


def pipeline(
    folder: Path,
    transcripts: bool = False,
    gated: bool = True,
    coalesce: bool = True,
    asr_workers: int = 1,
    asr_threads: int = 1,
    lane_nice: int | None = None,
    lane_process: bool | None = None,
    asr_process: bool | None = None,
    words: bool = True,
) -> Path:
    doc: dict[str, Any] = {
        "name": "null-turns",
        "entry": "respond",
        "entries": {"live": "vad"},
        "stages": [
            {
                "name": "respond",
                "engine": "null.audio",
                "options": {"delay_ms": 200, "audio_ms": 1000, "chunk_ms": 40, "sample_rate": 24000,
                            "realtime": True, "tick_ms": 10},
                "budget": {"max_concurrency": 256, "max_batch": 64, "worker": "thread", "workers": 1},
            },
            {
                "name": "vad",
                "engine": "engines.speech.vad_stage:VadEngine",
                "budget": {"max_concurrency": 1024, "max_batch": 256, "worker": "thread", "workers": 1,
                           "gather_ms": 10},
            },
            {
                "name": "end_of_turn",
                "engine": "engines.speech.turn_stage:EndOfTurnEngine",
                "budget": {"max_concurrency": 1024, "max_batch": 16, "worker": "thread", "workers": 1},
            },
        ],
        "edges": [{"from": "vad", "to": "end_of_turn", "mode": "async_chunk", "connector": "inproc",
                   "chunk": {"first": 1, "steady": 1, "left_context": 0}, "gated": gated,
                   "coalesce": coalesce}],
    }  # fmt: skip
    if transcripts:  # voice-cascade's live ASR too: semantic_vad's second cue (TurnCues)
        # `asr_workers`: Whisper runs at once on the one model (and live_asr calls in flight);
        # voice-cascade has 2, the earlier rounds measured 1 (one run at a time).
        # `asr_threads`: CTranslate2's threads a run (voice-cascade: 0, i.e. min(4, cores)).
        asr_options = {"compute_type": "int8", "cpu_threads": asr_threads, "num_workers": asr_workers}
        lane: dict[str, Any] = {} if lane_nice is None else {"background_nice": lane_nice}
        # The lane's and the asr stage's Whisper in processes a decision's draft holds still.
        if lane_process is not None:
            lane["background_process"] = lane_process
        process = {} if asr_process is None else {"background_process": asr_process}
        doc["stages"] += [
            {
                "name": "live_asr",
                "engine": "engines.speech.live_asr:LiveAsrEngine",
                "options": {**asr_options, "partial_interval_ms": 700, **lane},
                "budget": {
                    "max_concurrency": 1024,
                    "max_batch": 64,
                    "worker": "thread",
                    "workers": asr_workers,
                },
            },
            {
                "name": "asr",
                "engine": "speech.asr",
                "options": {
                    **asr_options,
                    **process,
                },
                "budget": {"max_concurrency": 64, "max_batch": 1, "worker": "thread", "workers": 1},
            },
        ]
        doc["entry"] = "asr"
        if words:  # voice-cascade's end-of-turn stage: the words of an undecided sentence too
            doc["stages"][2]["engine"] = "engines.speech.words_turn_stage:EndOfTurnWordsEngine"
        doc["edges"] += [
            {
                "from": "vad",
                "to": "live_asr",
                "mode": "async_chunk",
                "connector": "inproc",
                "coalesce": coalesce,  # voice-cascade's: a Whisper run never stops the VAD
                "chunk": {"first": 1, "steady": 1, "left_context": 0},
            },
            {"from": "asr", "to": "respond", "mode": "full", "connector": "inproc"},
        ]
    path = folder / "null-turns.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@dataclass(slots=True)
class ClipResult:
    config: str
    name: str
    paused: bool
    pause_s: float
    cut_off: bool = False
    answered_once: bool = False
    latency_ms: float | None = None
    first_audio_ms: float | None = None  # answered once: end of speech -> first audio delta
    stops: list[int] = field(default_factory=list)  # clip-relative ms
    turn_end_lag_ms: int | None = None  # answered once: where the turn ended after the speech (timeline)
    stopped_after_ms: list[float] = field(default_factory=list)  # speech_stopped, after speech end
    responses: int = 0


def _wire(audio16k: np.ndarray) -> np.ndarray:
    from media.audio import resample

    return resample(audio16k, RATE, WIRE)


async def run_session(url: str, config: str, clips: list[Clip], results: list[ClipResult]) -> float:
    """Stream `clips` on one session; returns the seconds of audio streamed."""
    client = await RealtimeClient.open(url)
    td = CONFIGS[config]
    session = {"type": "realtime", "audio": {"input": {"turn_detection": td}}}
    await client.send({"type": "session.update", "session": session})
    await client.until("session.updated", 30)
    log: list[tuple[float, dict[str, Any]]] = []

    async def read() -> None:
        while True:
            event = await client.next(3600)
            log.append((time.monotonic(), event))
            arrived.set()

    arrived = asyncio.Event()
    reader = asyncio.create_task(read())
    step = int(APPEND_S * WIRE)
    sent = 0  # wire samples appended so far
    clock = time.monotonic()
    spans: list[tuple[Clip, int, float | None]] = []  # clip, timeline ms of its speech, speech end sent
    try:
        for clip in clips:
            audio = _wire(np.concatenate([np.zeros(int(LEAD_S * RATE), np.float32), clip.audio]))
            speech_end = len(audio)
            seen = len(log)
            t_end: float | None = None
            # In audio, every turn has ended by then (the longest wait, and 2 s to spare): a
            # loaded server's events may come later, and are matched to clips by position.
            tail_limit = len(audio) + int((MAX_WAIT_S[config] + 2.0) * WIRE)
            begin_ms = sent * 1000 // WIRE + int(LEAD_S * 1000)
            pos = 0
            done_at: float | None = None
            while pos < tail_limit:
                piece = audio[pos : pos + step] if pos < len(audio) else np.zeros(step, np.float32)
                if len(piece) < step:
                    piece = np.concatenate([piece, np.zeros(step - len(piece), np.float32)])
                clock += APPEND_S
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                pcm = np.clip(np.round(piece * 32767), -32768, 32767).astype("<i2").tobytes()
                b64 = base64.b64encode(pcm).decode()
                await client.send({"type": "input_audio_buffer.append", "audio": b64})
                if pos <= speech_end < pos + step:
                    t_end = time.monotonic() + (speech_end - pos) / WIRE
                pos += step
                sent += step
                if pos >= speech_end and done_at is None and _settled([e for _, e in log[seen:]]):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() - done_at > 0.3:
                    break
            spans.append((clip, begin_ms, t_end))
        deadline = time.monotonic() + 20  # the last events of a loaded server
        while not _settled([e for _, e in log], at_least=0):
            arrived.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await arrived.wait()
            except TimeoutError:
                break
    finally:
        reader.cancel()
        await client.close()  # a reader that missed its cancel ends on the closed connection
        await asyncio.gather(reader, return_exceptions=True)
    results.extend(_score_all(config, spans, log))
    return sent / WIRE


def _settled(events: list[dict[str, Any]], at_least: int = 1) -> bool:
    """Every turn has ended and every response is done (and there was one, by default)."""
    kinds = [e["type"] for e in events]
    started = kinds.count("input_audio_buffer.speech_started")
    return (
        started >= at_least
        and started == kinds.count("input_audio_buffer.speech_stopped")
        and kinds.count("response.created") == kinds.count("response.done") >= at_least
    )


def _score_all(
    config: str, spans: list[tuple[Clip, int, float | None]], log: list[tuple[float, dict[str, Any]]]
) -> list[ClipResult]:
    """Each clip's turn ends (`speech_stopped` by its `audio_end_ms` on the timeline) and the
    responses they started (`response.created` after a clip's `speech_stopped`)."""
    starts = [begin for _, begin, _ in spans]

    def clip_of(ms: int) -> int:
        k = 0
        while k + 1 < len(starts) and ms >= starts[k + 1] - int(LEAD_S * 1000):
            k += 1
        return k

    stops: list[list[tuple[int, float]]] = [[] for _ in spans]
    created: list[list[float]] = [[] for _ in spans]
    audio: list[float | None] = [None for _ in spans]
    last: int | None = None
    for t, e in log:
        if e["type"] == "input_audio_buffer.speech_stopped":
            last = clip_of(int(e["audio_end_ms"]))
            stops[last].append((int(e["audio_end_ms"]) - starts[last], t))
        elif e["type"] == "response.created" and last is not None:
            created[last].append(t)
        elif e["type"] == "response.output_audio.delta" and last is not None and audio[last] is None:
            audio[last] = t
    return [
        _score(config, clip, stops[k], created[k], t_end, audio[k])
        for k, (clip, _, t_end) in enumerate(spans)
    ]


def _score(
    config: str,
    clip: Clip,
    stops: list[tuple[int, float]],
    created: list[float],
    t_end: float | None,
    first_audio: float | None = None,
) -> ClipResult:
    res = ClipResult(config, clip.name, clip.paused, clip.pause_s)
    res.stops = [ms for ms, _ in stops]
    res.responses = len(created)
    if t_end is not None:
        res.stopped_after_ms = [round((t - t_end) * 1000, 1) for _, t in stops]
    end_ms = len(clip.audio) * 1000 // RATE
    if clip.paused:
        lo = clip.pause_at * 1000 // RATE - 150
        hi = lo + 150 + int(clip.pause_s * 1000) + 50
        res.cut_off = any(lo <= s <= hi for s in res.stops)
    res.answered_once = len(res.stops) == 1 and res.stops[0] >= end_ms - 300 and len(created) == 1
    if res.answered_once:
        res.turn_end_lag_ms = res.stops[0] - end_ms
    if res.answered_once and t_end is not None:
        res.latency_ms = round((created[0] - t_end) * 1000, 1)
        if first_audio is not None:
            res.first_audio_ms = round((first_audio - t_end) * 1000, 1)
    return res


def _asdict(r: ClipResult) -> dict[str, Any]:
    return {name: getattr(r, name) for name in ClipResult.__dataclass_fields__}


def cpu_per_decision(clips: list[Clip], n: int = 30) -> dict[str, Any]:
    from engines.speech.smart_turn import SmartTurn

    model = SmartTurn(threads=1)
    model.scores([clips[0].audio])
    one = []
    for clip in clips[:n]:
        t = time.thread_time()
        model.scores([clip.audio])
        one.append((time.thread_time() - t) * 1000)
    t = time.thread_time()
    model.scores([c.audio for c in clips[:8]])
    batch8 = (time.thread_time() - t) * 1000 / 8
    return {"cpu_ms": summarize(one), "cpu_ms_batch8_each": round(batch8, 1)}


def _spawn(folder: Path, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    spec = pipeline(
        folder,
        args.transcripts,
        not args.ungated,
        not args.no_coalesce,
        args.asr_workers,
        args.asr_threads,
        args.lane_nice,
        None if args.lane_process is None else args.lane_process == "on",
        None if args.asr_process is None else args.asr_process == "on",
        args.words == "on",
    )
    cmd = [sys.executable, "-m", "web.cli", "serve", "--pipeline", str(spec),
           "--port", str(port), "--data-dir", str(folder / "data"), "--log-level", "warning",
           "--max-sessions", "256"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())


def _metric(metrics: str, name: str, stage: str | None = None) -> float:
    """A metric's value from /metrics text (the `stage` label's, when given); 0 if absent."""
    label = r"\{[^}]*stage=\"" + re.escape(stage) + r"\"[^}]*\}" if stage else r"(?:\{[^}]*\})?"
    found = re.search("^" + re.escape(name) + label + r" ([0-9.e+-]+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _mean_ms(metrics: str, histogram: str, stage: str | None = None) -> float:
    count = _metric(metrics, f"{histogram}_count", stage)
    return round(1000 * _metric(metrics, f"{histogram}_sum", stage) / max(1.0, count), 1)


def _counter(metrics: str, name: str, stage: str = "end_of_turn") -> float:
    """A stage's engine counter from /metrics text (either label order)."""
    for labels in (f'counter="{name}",stage="{stage}"', f'stage="{stage}",counter="{name}"'):
        found = re.search(r"stage_engine_total\{" + labels + r"\} ([0-9.e+]+)", metrics)
        if found:
            return float(found.group(1))
    return 0.0


def _decision_words(metrics: str) -> dict[str, float]:
    made = _counter(metrics, "decision_words", "live_asr")
    return {
        "made": made,
        "mean_wait_ms": round(_counter(metrics, "decision_wait_ms", "live_asr") / max(1.0, made), 1),
        "mean_run_ms": round(_counter(metrics, "decision_run_ms", "live_asr") / max(1.0, made), 1),
        # Drafts that held the background lane's process still (``background_process``).
        "lane_holds": _counter(metrics, "lane_holds", "live_asr"),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    clips = turn_set()[: args.clips]
    cpu = cpu_per_decision(clips)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        port = free_port()
        server = _spawn(folder, port, args)
        try:
            await wait_ready(f"http://127.0.0.1:{port}", 180, server)
            url = f"ws://127.0.0.1:{port}/v1/realtime"
            results: list[ClipResult] = []
            jobs = []
            for config in args.configs:
                for s in range(args.sessions):
                    share = clips[s :: args.sessions]
                    jobs.append(run_session(url, config, share, results))
            load_before = os.getloadavg()
            async with httpx.AsyncClient() as http:
                metrics_before = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            began = time.monotonic()
            seconds = await asyncio.gather(*jobs)
            wall = time.monotonic() - began
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            if args.metrics_out is not None:  # every counter, for what the report leaves out
                args.metrics_out.write_text(metrics)
        finally:
            server.terminate()
            server.wait(timeout=30)
    decisions = _counter(metrics, "decisions")
    model_ms = _counter(metrics, "model_ms")
    kinds = [c for c in args.configs for _ in range(args.sessions)]
    semantic_s = sum(s for s, kind in zip(seconds, kinds, strict=True) if kind.startswith("semantic"))
    per_s = decisions / semantic_s if semantic_s else 0.0
    cpu_p50 = cpu["cpu_ms"]["p50"] or 0.0
    cpu_metric = "process_cpu_seconds_total"
    cpu_used = _metric(metrics, cpu_metric) - _metric(metrics_before, cpu_metric)
    made = _counter(metrics, "transcripts", "live_asr")
    report: dict[str, Any] = {
        "clips": len(clips),
        "sessions_per_config": args.sessions,
        "wall_s": round(wall, 1),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "decisions": decisions,
        "decisions_per_session_s": round(per_s, 3),
        "server_model_wall_ms_per_decision": round(model_ms / decisions, 1) if decisions else None,
        **cpu,
        "sessions_per_core": round(1000.0 / (per_s * cpu_p50), 0) if per_s and cpu_p50 else None,
        "end_of_turn_gated": not args.ungated,
        "asr_workers": args.asr_workers,
        "asr_threads": args.asr_threads,
        "lane_nice": args.lane_nice,
        "lane_process": args.lane_process,
        "asr_process": args.asr_process,
        "words": args.words if args.transcripts else "off",
        # The words model's compute type on this host: float32 where int8 products saturate.
        "words_compute_type": exact_int8_compute_type(),
        # semantic_vad's words cue: sentences the model left open whose words were scored, and
        # the language model's wall ms per text (session.realtime.words_turn).
        "word_decisions": _counter(metrics, "word_decisions"),
        "words_model_ms_per_text": round(
            _counter(metrics, "words_model_ms") / max(1.0, _counter(metrics, "word_decisions")), 1
        ),
        "vad_edges_coalesce": not args.no_coalesce,
        "server_cpu_s": round(cpu_used, 1),
        "stage_steps": {
            stage: {
                "steps": int(_metric(metrics, "omniduplex_stage_step_seconds_count", stage)),
                "mean_ms": _mean_ms(metrics, "omniduplex_stage_step_seconds", stage),
            }
            for stage in ("vad", "end_of_turn", "live_asr")
        },
        # The live ASR's pause transcripts: made, answered with no words (the user had spoken
        # past the pause), and the mean wait from the step that took the ask to its transcript.
        "live_asr_transcripts": {
            "made": made,
            "dropped": _counter(metrics, "transcripts_dropped", "live_asr"),
            "mean_wait_ms": round(_counter(metrics, "transcript_wait_ms", "live_asr") / max(1.0, made), 1),
        },
        # Of those, the words a decision waits on (Whisper's first run of a pause, made on the
        # stage's step): the mean wait to start and the mean run, wall time.
        "live_asr_decision_words": _decision_words(metrics),
        "event_loop_lag_mean_ms": _mean_ms(metrics, "omniduplex_event_loop_lag_seconds"),
        "configs": {},
    }
    if args.details:
        report["details"] = [_asdict(r) for r in results]
    for config in args.configs:
        mine = [r for r in results if r.config == config]
        paused = [r for r in mine if r.paused]
        upto = [r for r in paused if r.pause_s <= 1.5]
        finished = [r for r in mine if not r.paused]
        report["configs"][config] = {
            "false_cutoffs": f"{sum(r.cut_off for r in paused)}/{len(paused)}",
            "false_cutoff_rate_upto_1.5s": round(sum(r.cut_off for r in upto) / max(1, len(upto)), 3),
            "paused_answered_once_whole": f"{sum(r.answered_once for r in paused)}/{len(paused)}",
            "finished_answered_once": f"{sum(r.answered_once for r in finished)}/{len(finished)}",
            "finished_eos_to_created_ms": summarize(r.latency_ms for r in finished),
            # Of that: where the turn ended on the audio timeline after the speech (the VAD's
            # silence onset, which speech_stopped reports); the rest is deciding (wall time).
            "finished_turn_end_after_speech_ms": summarize(
                r.turn_end_lag_ms for r in finished if r.latency_ms is not None
            ),
            "paused_eos_to_created_ms": summarize(r.latency_ms for r in paused),
            # The null responder's first audio comes 200 ms after its request is admitted,
            # which waits for the response's words (a doubted draft's redo, say).
            "finished_eos_to_first_audio_ms": summarize(r.first_audio_ms for r in finished),
        }
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sessions", type=int, default=4, help="sessions per configuration (clips split among them)"
    )
    p.add_argument("--clips", type=int, default=120, help="clips of the set to use (at most 120)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument(
        "--transcripts",
        action="store_true",
        help="voice-cascade's live ASR and an ASR before the answer: semantic_vad decides on the words too",
    )
    p.add_argument("--details", action="store_true", help="every clip's events in the report")
    p.add_argument(
        "--asr-workers",
        type=int,
        default=1,
        help="with --transcripts: Whisper runs at once (1: one at a time, as measured before; "
        "voice-cascade has 2)",
    )
    p.add_argument(
        "--asr-threads",
        type=int,
        default=1,
        help="with --transcripts: CTranslate2 threads per Whisper run (1, as measured before; "
        "voice-cascade has 0: min(4, cores))",
    )
    p.add_argument(
        "--lane-nice",
        type=int,
        default=None,
        help="with --transcripts: the live ASR's background_nice (default: the engine's own)",
    )
    p.add_argument(
        "--lane-process",
        choices=("on", "off"),
        default=None,
        help="with --transcripts: the live ASR's background_process (default: the engine's own)",
    )
    p.add_argument(
        "--asr-process",
        choices=("on", "off"),
        default=None,
        help="with --transcripts: the asr stage's background_process (default: the engine's own)",
    )
    p.add_argument(
        "--words",
        choices=("on", "off"),
        default="on",
        help="with --transcripts: the end-of-turn stage scores an undecided sentence's words too "
        "(voice-cascade's; off: Smart Turn and the words' punctuation alone, as before)",
    )
    p.add_argument(
        "--ungated",
        action="store_true",
        help="the edge into the end-of-turn stage not gated: every session's audio reaches it (as before)",
    )
    p.add_argument(
        "--no-coalesce",
        action="store_true",
        help="the VAD's edges not coalescing: a slow live ASR or end-of-turn step pauses the VAD (as before)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument(
        "--metrics-out", type=Path, default=None, help="write the server's /metrics text at the end here"
    )
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
