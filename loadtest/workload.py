"""The workload: how many sessions, how they arrive, what each one says and when.

One :class:`Workload` describes one load level; a sweep runs the same workload at several
session counts. Every option has a command-line flag (:func:`add_workload_args`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

SpeechSource = Literal["piper", "tone"]
TurnDetection = Literal["server_vad", "manual"]

SCENARIOS = ("voice-ws", "voice-webrtc", "world", "robot", "live")


@dataclass(frozen=True, slots=True)
class Workload:
    scenario: str = "voice-ws"
    sessions: int = 4
    ramp_s: float = 2.0  # session starts are spread evenly over the ramp
    duration_s: float = 20.0  # after the ramp; no turn starts later, running turns finish
    max_turns: int = 0  # per session; 0: as many as fit in the duration
    speech: SpeechSource = "piper"  # Piper utterances, or a synthetic voice-band tone burst
    speech_ms: int = 2000  # utterance length with speech="tone"
    turn_detection: TurnDetection = "server_vad"  # manual: commit + response.create at end of speech
    silence_ms: int = 500  # server_vad silence_duration_ms
    vad_threshold: float = 0.5
    append_ms: int = 40  # input_audio_buffer.append cadence (20 or 40)
    pause_s: float = 1.0  # after the reply has played out, before the next turn
    barge_in: float = 0.0  # fraction of turns the client interrupts
    barge_in_after_ms: int = 600  # of reply audio received before interrupting
    prebuffer_ms: int = 100  # simulated client playout buffer
    response_timeout_s: float = 60.0  # end of speech → response.done
    max_output_tokens: int = 0  # response.create cap (manual turns); 0: the server's default
    model: str | None = None  # voice: ?model= (default: the server's pipeline); world: the model
    seed: int = 0
    # world sessions (scenario "world"): session.start and the key presses
    fps: float = 15.0
    width: int = 256
    height: int = 256
    video_format: str = "jpeg"
    action_every_s: float = 0.3  # mean interval between key events (keydown, keyup, ...)

    @property
    def total_s(self) -> float:
        return self.ramp_s + self.duration_s

    def at(self, sessions: int) -> Workload:
        return replace(self, sessions=sessions)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}")
        if self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if self.append_ms not in (10, 20, 40, 50, 100):
            raise ValueError("append_ms must be one of 10, 20, 40, 50, 100")
        if not 0.0 <= self.barge_in <= 1.0:
            raise ValueError("barge_in is a fraction in [0, 1]")
        if self.duration_s <= 0 or self.ramp_s < 0:
            raise ValueError("duration_s must be > 0 and ramp_s >= 0")
        if not 0.0 < self.fps <= 120.0:
            raise ValueError("fps must be in (0, 120]")
        if self.width < 16 or self.height < 16:
            raise ValueError("width and height must be >= 16")
        if self.action_every_s <= 0:
            raise ValueError("action_every_s must be > 0")


def parse_levels(text: str) -> list[int]:
    """``"1,2,4"`` or ``"1-16"`` (powers of two from 1 to 16 inclusive) → session counts."""
    levels: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            n = lo
            while n < hi:
                levels.append(n)
                n *= 2
            levels.append(hi)
        elif part:
            levels.append(int(part))
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"bad session levels {text!r}")
    return sorted(set(levels))


def add_workload_args(p: argparse.ArgumentParser, *, levels: bool = True) -> None:
    d = Workload()
    g = p.add_argument_group("workload")
    g.add_argument("--scenario", default=d.scenario, choices=SCENARIOS)
    if levels:
        g.add_argument(
            "--sessions",
            type=parse_levels,
            default=[d.sessions],
            help="concurrent sessions; a list ('1,2,4') or a doubling range ('1-16') runs a sweep",
        )
    g.add_argument("--ramp", type=float, default=d.ramp_s, help="seconds over which sessions start")
    g.add_argument("--duration", type=float, default=d.duration_s, help="seconds after the ramp")
    g.add_argument("--max-turns", type=int, default=d.max_turns, help="per session (0: unbounded)")
    g.add_argument("--speech", default=d.speech, choices=("piper", "tone"))
    g.add_argument("--speech-ms", type=int, default=d.speech_ms, help="utterance length with --speech tone")
    g.add_argument("--turn-detection", default=d.turn_detection, choices=("server_vad", "manual"))
    g.add_argument("--silence-ms", type=int, default=d.silence_ms, help="server_vad silence_duration_ms")
    g.add_argument("--vad-threshold", type=float, default=d.vad_threshold)
    g.add_argument("--append-ms", type=int, default=d.append_ms, help="audio per append event (20 or 40)")
    g.add_argument(
        "--pause", type=float, default=d.pause_s, help="seconds between a reply's end and the next turn"
    )
    g.add_argument("--barge-in", type=float, default=d.barge_in, help="fraction of turns to interrupt")
    g.add_argument("--barge-in-after-ms", type=int, default=d.barge_in_after_ms)
    g.add_argument("--prebuffer-ms", type=int, default=d.prebuffer_ms, help="client playout prebuffer")
    g.add_argument("--response-timeout", type=float, default=d.response_timeout_s)
    g.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    g.add_argument("--model", default=None, help="voice: ?model=; world: session.start model (tiny-jepa)")
    g.add_argument("--seed", type=int, default=d.seed)
    v = p.add_argument_group("world sessions (--scenario world)")
    v.add_argument("--fps", type=float, default=d.fps, help="session.start fps")
    v.add_argument("--width", type=int, default=d.width)
    v.add_argument("--height", type=int, default=d.height)
    v.add_argument("--video-format", default=d.video_format, choices=("jpeg", "m4s"))
    v.add_argument(
        "--action-every", type=float, default=d.action_every_s, help="mean seconds between key events"
    )


def workload_from_args(args: argparse.Namespace, sessions: int | None = None) -> Workload:
    levels: list[int] = getattr(args, "sessions", None) or [Workload().sessions]
    w = Workload(
        scenario=args.scenario,
        sessions=sessions if sessions is not None else levels[0],
        ramp_s=args.ramp,
        duration_s=args.duration,
        max_turns=args.max_turns,
        speech=args.speech,
        speech_ms=args.speech_ms,
        turn_detection=args.turn_detection,
        silence_ms=args.silence_ms,
        vad_threshold=args.vad_threshold,
        append_ms=args.append_ms,
        pause_s=args.pause,
        barge_in=args.barge_in,
        barge_in_after_ms=args.barge_in_after_ms,
        prebuffer_ms=args.prebuffer_ms,
        response_timeout_s=args.response_timeout,
        max_output_tokens=args.max_output_tokens,
        model=args.model,
        seed=args.seed,
        fps=args.fps,
        width=args.width,
        height=args.height,
        video_format=args.video_format,
        action_every_s=args.action_every,
    )
    w.check()
    return w
