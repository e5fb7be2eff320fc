"""Memory of the audio deltas a session's writer holds for a resume (issue 33): the heap they
take (``tracemalloc``), what the writer counts (``held_bytes``), and what holding and
replaying cost per delta.

One writer per session on a store stand-in that is never flushed (no Redis: holding never
reaches it), fed the audio deltas of responses one after another, as the realtime core makes
them (``event_id`` second, 40 ms of 24 kHz PCM16 each by default).
Run it on two checkouts to compare them (it uses only ``SessionWriter``'s public calls):

    PYTHONPATH=. .venv/bin/python -m loadtest.bench_held --sessions 20 --seconds 55
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import os
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

from session.store import SessionWriter
from session.store.log_budget import WriterLimits
from session.store.redis_store import HELD_EVENT_TYPES, SessionRecord


class _Store:
    """What ``SessionWriter`` reads off its store when it only appends (no flush, no hub)."""

    def __init__(self, held_max_bytes: int, held_window_s: float) -> None:
        self.writer_limits = WriterLimits(
            log_max_bytes=16 * 2**20,
            held_event_types=HELD_EVENT_TYPES,
            held_max_bytes=held_max_bytes,
            held_window_s=held_window_s,
        )
        self.policy = SimpleNamespace(idle_ttl_s=600.0)
        self.first: dict[str, dict[str, Any]] = {}  # each session's one logged event

    async def events_after(self, session_id: str, last_event_id: str | None) -> list[dict[str, Any]]:
        return [self.first[session_id]]


def _writer(store: _Store, i: int) -> SessionWriter:
    """A new session's writer that has logged its first event (the ones after it are held)."""
    record = SessionRecord(f"sess_{i:08d}abcdefgh", "t", "active", {}, 0.0, 0.0, 0.0, 0)
    writer = SessionWriter(store, record)  # type: ignore[arg-type]
    created = {"type": "session.created", "event_id": None, "session": {"id": record.session_id}}
    store.first[record.session_id] = writer.append(created)
    return writer


def _delta(response: str, pcm: bytes) -> dict[str, Any]:
    return {
        "type": "response.output_audio.delta",
        "event_id": None,
        "response_id": response,
        "item_id": "item_" + response[5:],
        "output_index": 0,
        "content_index": 0,
        "delta": base64.b64encode(pcm).decode(),
    }


def _feed(writers: list[SessionWriter], audio: list[bytes], deltas: int, per_reply: int) -> tuple[int, float]:
    """Every writer's deltas; (JSON bytes sent, seconds spent in ``append``)."""
    sent_bytes = 0
    hold_s = 0.0
    response = ""
    for w in writers:
        for k in range(deltas):
            if k % per_reply == 0:
                response = f"resp_{k // per_reply:04d}{id(w) % 10**12:012d}"
            event = _delta(response, audio[k % len(audio)])
            t0 = time.perf_counter()
            stamped = w.append(event)
            hold_s += time.perf_counter() - t0
            sent_bytes += len(stamped.wire)  # type: ignore[attr-defined]
    return sent_bytes, hold_s


def run(sessions: int, seconds: float, frame_ms: int, reply_s: float) -> dict[str, float]:
    frame = 48 * frame_ms  # bytes of 24 kHz PCM16
    deltas = int(seconds * 1000 / frame_ms)
    per_reply = max(1, int(reply_s * 1000 / frame_ms))
    audio = [os.urandom(frame) for _ in range(64)]  # speech-like: incompressible bytes
    store = _Store(held_max_bytes=64 * 2**20, held_window_s=3600.0)
    # Time first, without tracemalloc (it slows every allocation down).
    timed = [_writer(store, i) for i in range(sessions)]
    _, hold_s = _feed(timed, audio, deltas, per_reply)
    t0 = time.perf_counter()
    replayed = asyncio.run(_replay_all(timed))
    replay_s = time.perf_counter() - t0
    del timed
    gc.collect()
    tracemalloc.start()
    writers = [_writer(store, sessions + i) for i in range(sessions)]
    gc.collect()
    made = tracemalloc.get_traced_memory()[0]
    sent_bytes, _ = _feed(writers, audio, deltas, per_reply)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    n = sessions * deltas
    return {
        "sessions": sessions,
        "deltas_per_session": deltas,
        "audio_s_per_session": deltas * frame_ms / 1000,
        "sent_json_mb_per_session": sent_bytes / sessions / 2**20,
        "heap_mb_per_session": (held - made) / sessions / 2**20,
        "held_bytes_mb_per_session": sum(w.held_bytes for w in writers) / sessions / 2**20,
        "hold_us_per_delta": hold_s / n * 1e6,
        "replay_us_per_delta": replay_s / max(1, replayed) * 1e6,
    }


async def _replay_all(writers: list[SessionWriter]) -> int:
    count = 0
    for w in writers:
        w.flush = _nothing  # type: ignore[method-assign]
        replay = await w.replay(None)
        count += len(replay.events) - 1
    return count


async def _nothing() -> int:
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--seconds", type=float, default=55.0, help="audio held per session")
    p.add_argument("--frame-ms", type=int, default=40)
    p.add_argument("--reply-s", type=float, default=2.0, help="audio per response")
    args = p.parse_args(argv)
    result = run(args.sessions, args.seconds, args.frame_ms, args.reply_s)
    for key, value in result.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
