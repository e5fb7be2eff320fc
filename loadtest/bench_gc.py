"""What a full collection of the cyclic GC costs with many long conversations in the process:
the pause, with the event loop stopped, that every session's audio stream sits through.

    .venv/bin/python -m loadtest.bench_gc --sessions 200 --turns 100,700

Each session's conversation gets `turns` voice turns, shaped as the core leaves them once
their audio is dropped (a user item with an input-audio part and its transcript, an assistant
item with an output-audio part and its transcript). Side `untracked` is the code as it is
(session/realtime/gc_untrack.py); side `tracked` replaces the conversation's untracking with a
no-op (the code before it). Each side runs in a fresh interpreter; the figure is the median of
`--repeats` full collections. This measures the collector alone, on a quiet process: in a
loaded server the same objects cost more (cache misses, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time


def _measure(sessions: int, turns: int, repeats: int, tracked: bool) -> dict[str, float]:
    from session.realtime import conversation as conversation_module
    from session.realtime.conversation import Content, Conversation, Item

    if tracked:
        conversation_module._leave_gc_scans = lambda item: None  # type: ignore[assignment]
    conversations = []
    for s in range(sessions):
        conversation = Conversation()
        for t in range(turns):
            user = Content(type="input_audio", transcript="what is the weather like", dropped_ms=1800.0)
            answer = Content(type="output_audio", transcript="it is sunny and warm today", dropped_ms=2000.0)
            conversation.insert(Item(f"item_{s}_{t}_u", "message", role="user", content=[user]))
            conversation.insert(Item(f"item_{s}_{t}_a", "message", role="assistant", content=[answer]))
        conversations.append(conversation)
    gc.collect()
    pauses = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - start) * 1000.0)
    tracked_objects = len(gc.get_objects())
    del conversations
    return {"full_collection_ms": statistics.median(pauses), "tracked_objects": float(tracked_objects)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", default="100,700", help="turns per conversation, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--side", choices=("tracked", "untracked"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side is not None:  # one measurement, in this (fresh) interpreter
        result = _measure(args.sessions, int(args.turns), args.repeats, args.side == "tracked")
        print(json.dumps(result))
        return 0
    print("| turns per session | side | tracked objects | full collection (median) |")
    print("|---:|---|---:|---:|")
    for turns in (int(t) for t in args.turns.split(",")):
        for side in ("tracked", "untracked"):
            cmd = [sys.executable, "-m", "loadtest.bench_gc", "--side", side, "--turns", str(turns)]
            cmd += ["--sessions", str(args.sessions), "--repeats", str(args.repeats)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            objects, pause = out["tracked_objects"], out["full_collection_ms"]
            print(f"| {turns} | {side} | {objects:,.0f} | {pause:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
