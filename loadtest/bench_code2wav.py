"""code2wav's batched decode against one request's: the tiny model, one thread, no orchestrator.

Each case decodes windows of codec frames (a window is a chunk's left context + its new frames:
the 4 / 25 / 25 recipe gives a first chunk of 4 frames, a second of 4 + 25 and a steady one of
25 + 25) either in one call (``decode_windows``, what a batched step runs), one call per row
(what a step of one request runs, eight times), or through ``Code2WavEngine.step`` (its grouping
by length included). Times are the median (and minimum) wall time of one call over ``--reps``.

    .venv/bin/python -m loadtest.bench_code2wav                  # Markdown table
    .venv/bin/python -m loadtest.bench_code2wav --out c2w.json   # and the figures as JSON

Run it under the shared bench lock; for a before / after pair run it from both trees in one lock
(``PYTHONPATH=<tree>``): the script only uses ``decode_windows`` and the engine's ``step``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from engines.qwen3_omni.code2wav_rows import decode_windows
from engines.qwen3_omni.stages import Code2WavEngine
from runtime.engine import EdgeChunk, EngineRequest, StepInput
from runtime.payloads import CodecCodes, Payload

FIRST, SECOND, STEADY = 4, 4 + 25, 25 + 25

# name, window lengths, how: "batched" (one decode_windows call), "rows" (one call per window),
# "engine" (one Code2WavEngine.step of first chunks, new requests).
CASES: list[tuple[str, list[int], str]] = [
    ("first x1", [FIRST], "batched"),
    ("first x4", [FIRST] * 4, "batched"),
    ("first x8, per row", [FIRST] * 8, "rows"),
    ("first x8", [FIRST] * 8, "batched"),
    ("first 4/5 mixed x8", [FIRST, FIRST + 1] * 4, "batched"),
    ("second x1", [SECOND], "batched"),
    ("second x8, per row", [SECOND] * 8, "rows"),
    ("second x8", [SECOND] * 8, "batched"),
    ("steady x1", [STEADY], "batched"),
    ("steady x8, per row", [STEADY] * 8, "rows"),
    ("steady x8", [STEADY] * 8, "batched"),
    ("engine: first x1", [FIRST], "engine"),
    ("engine: first x8", [FIRST] * 8, "engine"),
]


def _timed(call: Callable[[], object], reps: int) -> tuple[float, float]:
    call()  # warm-up: lazily built kernels and buffers
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def _case(engine: Code2WavEngine, lengths: Sequence[int], how: str, seed: int) -> Callable[[], object]:
    rng = np.random.default_rng(seed)
    quantizers = engine.loaded.num_code_groups
    windows = [torch.from_numpy(rng.integers(0, 128, size=(quantizers, n))) for n in lengths]
    code2wav = engine.loaded.model.code2wav
    if how == "batched":
        return lambda: decode_windows(code2wav, windows)
    if how == "rows":
        return lambda: [decode_windows(code2wav, [w]) for w in windows]
    chunks = []
    for w in windows:
        frames: list[Payload] = [CodecCodes(w[:, t : t + 1].T.numpy()) for t in range(w.shape[1])]
        chunks.append(EdgeChunk(items=frames))

    def step() -> object:
        states = [engine.start(EngineRequest(f"bench{i}", {})) for i in range(len(chunks))]
        return engine.step([StepInput(state=s, chunks=[c]) for s, c in zip(states, chunks, strict=True)])

    return step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed calls per case (default 15)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    engine = Code2WavEngine({"model": "tiny", "seed": 0})
    engine.load()
    rows = []
    print(f"torch threads: {torch.get_num_threads()}\n")
    print("| case | windows (frames) | median ms | min ms |\n|---|---|---:|---:|")
    with torch.inference_mode():
        for seed, (name, lengths, how) in enumerate(CASES):
            median, fastest = _timed(_case(engine, lengths, how, seed), args.reps)
            row = {"case": name, "lengths": lengths, "how": how, "median_ms": median, "min_ms": fastest}
            rows.append(row)
            shapes = f"{'/'.join(map(str, sorted(set(lengths))))} × {len(lengths)}"
            print(f"| {name} | {shapes} | {median:.1f} | {fastest:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"reps": args.reps, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
