"""`omniduplex run`: one request through a pipeline, a WAV out, the per-stage timeline printed."""

from __future__ import annotations

import argparse
import asyncio
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from runtime.payloads import AudioChunk, TextDelta


def _edge_modes(items: list[str]) -> dict[str, str]:
    modes: dict[str, str] = {}
    for item in items:
        edge, sep, mode = item.partition("=")
        if not sep:
            raise SystemExit(f"--edge-mode {item!r}: expected FROM->TO=MODE")
        modes[edge.strip()] = mode.strip()
    return modes


def write_wav(path: Path, samples: np.ndarray, sample_rate: int) -> None:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


async def _run(args: argparse.Namespace) -> int:
    from runtime.orchestrator import Orchestrator
    from runtime.spec import load_pipeline

    spec = load_pipeline(args.pipeline)
    orch = Orchestrator.from_spec(spec)
    await orch.start()
    try:
        params: dict[str, Any] = {"text": args.text, "seed": args.seed}
        if args.max_tokens is not None:
            params["max_tokens"] = args.max_tokens
        if args.max_frames is not None:
            params["max_frames"] = args.max_frames
        t0 = time.perf_counter()
        handle = await orch.submit(params, edge_modes=_edge_modes(args.edge_mode) or None)
        text: list[str] = []
        audio: list[np.ndarray] = []
        rate = 24000
        first_audio: float | None = None
        status: Any = None
        async for out in handle:
            if isinstance(out, TextDelta):
                text.append(out.text)
            elif isinstance(out, AudioChunk):
                if first_audio is None:
                    first_audio = time.perf_counter() - t0
                audio.append(out.samples)
                rate = out.sample_rate
            elif hasattr(out, "status"):
                status = out
        total = time.perf_counter() - t0
    finally:
        await orch.close()
    samples = np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
    out_path = Path(args.out)
    write_wav(out_path, samples, rate)
    error = getattr(status, "error", None)
    print(f"status: {getattr(status, 'status', '?')}" + (f" ({error})" if error else ""))
    print(f"text: {''.join(text)!r}")
    dur = len(samples) / rate
    print(f"audio: {dur:.2f} s at {rate} Hz -> {out_path}")
    if first_audio is not None:
        print(
            f"time to first audio: {first_audio * 1000:.1f} ms; total {total * 1000:.1f} ms; "
            f"RTF {total / dur if dur else float('nan'):.3f}"
        )
    print("timeline (ms since admission):")
    head = ("stage", "replica", "started", "first out", "done", "steps", "busy")
    print("  {:<10} {:>7} {:>9} {:>9} {:>9} {:>6} {:>9}".format(*head))

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for stage, t in (getattr(status, "timings", None) or {}).items():
        print(
            f"  {stage:<10} {t.replica:>7} {ms(t.started_ms):>9} {ms(t.first_output_ms):>9} "
            f"{ms(t.done_ms):>9} {t.steps:>6} {ms(t.busy_ms):>9}"
        )
    return 0 if getattr(status, "status", None) == "completed" and dur > 0 else 1


def run_once(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
