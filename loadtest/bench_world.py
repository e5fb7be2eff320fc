"""World-model streaming benchmark: /v1/realtime/video with tiny-jepa (and tiny-video-random).

Measures, with real WebSocket clients against ``omniduplex serve`` in another process (so client
work does not share the server's event loop, and the sessions are hosted as in production:
admission, store, records), after one short warm-up session per model (a model loads on its
first session):

1. one tiny-jepa session, 256×256 JPEG, requested 30 fps: delivered fps (target ≥ 30);
2. action → first frame reflecting it: key events at random phases; latency from sending the
   keydown to receiving the chunk the server declared for it (``applies_at_chunk``; target
   ≤ 100 ms);
3. 8 concurrent tiny-jepa sessions (``--sessions``) at 15 fps: delivered fps per session, late chunks;
4. tiny-video-random prompt updates: update → ``session.interaction.applied`` latency, and
   whether each landed on the declared chunk (never later).

    python -m loadtest.bench_world                 # spawns `omniduplex serve` on a free port
    python -m loadtest.bench_world --seconds 3 --sessions 2   # a quick check
    python -m loadtest.bench_world --url http://127.0.0.1:8000 --seconds 20 --out world.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from loadtest.server_process import ConfigSpec, ServerProcess, server_cpu_s
from loadtest.stats import summarize


@dataclass
class SessionRecord:
    """What one client saw: chunk arrivals, and latencies of its interactions."""

    frames: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk's binary
    action_ms: list[float] = field(default_factory=list)  # keydown sent → its chunk arrived
    applied_ms: list[float] = field(default_factory=list)  # prompt sent → applied event arrived
    on_declared_chunk: int = 0  # applied.chunk_index == queued.applies_at_chunk
    later_than_declared: int = 0
    boundary_gap: list[int] = field(default_factory=list)  # applies_at - last chunk seen at send
    errors: list[str] = field(default_factory=list)

    def fps(self, skip_s: float = 1.0) -> float:
        """Delivered frames per second after a warm-up of ``skip_s``."""
        if len(self.chunk_times) < 3:
            return 0.0
        start = self.chunk_times[0] + skip_s
        times = [t for t in self.chunk_times if t >= start]
        if len(times) < 2:
            return 0.0
        per_chunk = self.frames / len(self.chunk_times)
        return (len(times) - 1) * per_chunk / (times[-1] - times[0])

    def late_chunks(self, period_s: float) -> int:
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]
        return sum(1 for g in gaps[5:] if g > 1.5 * period_s)


class StreamClient:
    """Reads a video stream and matches interactions to the chunks they land on."""

    def __init__(self, ws: ClientConnection, record: SessionRecord) -> None:
        self.ws = ws
        self.record = record
        self.last_chunk = -1
        self._sent: dict[str, tuple[float, int, str]] = {}  # event_id → (sent at, last chunk, kind)
        self._declared: dict[str, int] = {}
        self._awaiting_chunk: dict[int, list[float]] = {}  # chunk index → keydown send times
        self._ids = 0

    async def start(self, **fields: Any) -> dict[str, Any]:
        await self.ws.send(json.dumps({"type": "session.start", **fields}))
        while True:
            event = json.loads(await self.ws.recv())
            if event["type"] == "video.start":
                return event
            if event["type"] == "error":
                raise RuntimeError(f"session.start refused: {event}")

    async def interact(self, kind: str, **fields: Any) -> None:
        self._ids += 1
        event_id = f"{kind}-{self._ids}"
        self._sent[event_id] = (time.perf_counter(), self.last_chunk, kind)
        await self.ws.send(json.dumps({"type": "session.interaction", "event_id": event_id, **fields}))

    async def read(self, until: float) -> None:
        meta: dict[str, Any] | None = None
        while time.perf_counter() < until:
            try:
                async with asyncio.timeout(max(0.01, until - time.perf_counter())):
                    message = await self.ws.recv()
            except TimeoutError:
                return
            now = time.perf_counter()
            if isinstance(message, bytes):
                assert meta is not None, "binary frame without chunk_metadata"
                self._on_chunk(meta, now)
                meta = None
                continue
            event = json.loads(message)
            kind = event["type"]
            if kind == "video.chunk_metadata":
                meta = event
            elif kind == "session.interaction.queued":
                self._on_queued(event)
            elif kind == "session.interaction.applied":
                self._on_applied(event, now)
            elif kind == "error":
                self.record.errors.append(f"{event['code']}: {event['message']}")

    def _on_chunk(self, meta: dict[str, Any], now: float) -> None:
        index = meta["chunk_index"]
        self.last_chunk = index
        self.record.frames += meta["frame_count"]
        self.record.chunk_times.append(now)
        for sent_at in self._awaiting_chunk.pop(index, []):
            self.record.action_ms.append((now - sent_at) * 1e3)

    def _on_queued(self, event: dict[str, Any]) -> None:
        event_id = event["event_id"]
        sent = self._sent.get(event_id)
        if sent is None:
            return
        sent_at, last_seen, kind = sent
        at = event["applies_at_chunk"]
        self._declared[event_id] = at
        self.record.boundary_gap.append(at - last_seen)
        if kind == "key-down":
            self._awaiting_chunk.setdefault(at, []).append(sent_at)

    def _on_applied(self, event: dict[str, Any], now: float) -> None:
        for event_id in event["event_ids"]:
            sent = self._sent.pop(event_id, None)
            declared = self._declared.pop(event_id, None)
            if sent is None or declared is None:
                continue
            if event["chunk_index"] == declared:
                self.record.on_declared_chunk += 1
            elif event["chunk_index"] > declared:
                self.record.later_than_declared += 1
            if sent[2] == "prompt":
                self.record.applied_ms.append((now - sent[0]) * 1e3)


@contextlib.asynccontextmanager
async def session(url: str) -> AsyncIterator[ClientConnection]:
    ws_url = url.replace("http://", "ws://") + "/v1/realtime/video"
    async with connect(ws_url, max_size=2**24, open_timeout=30) as ws:
        yield ws


async def run_session(
    url: str, start: dict[str, Any], seconds: float, *, keys: bool, prompts: bool
) -> SessionRecord:
    record = SessionRecord()
    rng = random.Random(hash(json.dumps(start, sort_keys=True)) & 0xFFFF)
    async with session(url) as ws:
        client = StreamClient(ws, record)
        await client.start(**start)
        reader = asyncio.create_task(client.read(time.perf_counter() + seconds), name="bench-reader")
        try:
            held = False
            deadline = time.perf_counter() + seconds - 0.5
            await asyncio.sleep(1.0)  # warm up
            while time.perf_counter() < deadline and not reader.done():
                await asyncio.sleep(rng.uniform(0.15, 0.45))  # a random phase against the chunk clock
                if keys:
                    held = not held
                    kind = "keydown" if held else "keyup"
                    key = rng.choice("wasd") if held else "wasd"
                    actions = [{"event": kind, "key": k} for k in key]
                    await client.interact("key-down" if held else "key-up", actions=actions)
                if prompts:
                    await client.interact("prompt", prompt=f"scene {rng.randrange(10**6)}")
            await reader
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        with contextlib.suppress(Exception):
            await ws.send(json.dumps({"type": "session.stop"}))
    return record


# ----------------------------------------------------------------------------------- server


# ----------------------------------------------------------------------------------- report


async def warm_up(url: str) -> None:
    """One short session per model first: the server loads a model on its first session, and
    that load is not what the phases measure."""
    for model in ("tiny-jepa", "tiny-video-random"):
        start = {"model": model, "format": "jpeg", "width": 256, "height": 256, "fps": 15}
        await run_session(url, start, 1.5, keys=False, prompts=False)


async def bench(url: str, seconds: float, sessions: int, pid: int | None) -> dict[str, Any]:
    """The phases against ``url``; ``pid``: the server's process, when we started it (its CPU)."""
    results: dict[str, Any] = {"cpus": os.cpu_count(), "seconds": seconds, "sessions": sessions}
    await warm_up(url)

    async def phase(name: str, coro: Any) -> Any:
        cpu0 = server_cpu_s(pid) if pid is not None else None
        began = time.perf_counter()
        out = await coro
        if pid is not None and cpu0 is not None:
            used = server_cpu_s(pid) - cpu0
            results[f"{name}_server_cpu"] = round(used / (time.perf_counter() - began), 2)
        return out

    jepa = {"model": "tiny-jepa", "format": "jpeg", "width": 256, "height": 256}
    one = await phase("single", run_session(url, {**jepa, "fps": 30}, seconds, keys=True, prompts=False))
    results["single_fps"] = round(one.fps(), 2)
    results["single_late_chunks"] = one.late_chunks(2 / 30)
    results["action_to_frame_ms"] = summarize(one.action_ms)
    results["single_errors"] = one.errors

    many = await phase(
        "concurrent",
        asyncio.gather(
            *(
                run_session(url, {**jepa, "fps": 15, "seed": i}, seconds, keys=True, prompts=False)
                for i in range(sessions)
            )
        ),
    )
    results["concurrent_fps"] = summarize([r.fps() for r in many], digits=2)
    results["concurrent_late_chunks"] = sum(r.late_chunks(2 / 15) for r in many)
    results["concurrent_action_to_frame_ms"] = summarize([v for r in many for v in r.action_ms])
    results["concurrent_errors"] = [e for r in many for e in r.errors]

    video = {"model": "tiny-video-random", "format": "jpeg", "width": 256, "height": 256, "fps": 30}
    prompts = await phase("prompt", run_session(url, video, seconds, keys=False, prompts=True))
    results["prompt_fps"] = round(prompts.fps(), 2)
    results["prompt_to_applied_ms"] = summarize(prompts.applied_ms)
    results["prompt_on_declared_chunk"] = prompts.on_declared_chunk
    results["prompt_later_than_declared"] = prompts.later_than_declared
    results["prompt_boundary_gap"] = dict(sorted(_count(prompts.boundary_gap).items()))
    results["prompt_errors"] = prompts.errors
    return results


def _count(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def render(results: dict[str, Any]) -> str:
    a, c, p = results["action_to_frame_ms"], results["concurrent_fps"], results["prompt_to_applied_ms"]
    c_act = results["concurrent_action_to_frame_ms"]
    rows = [
        ("tiny-jepa 256² JPEG, 1 session: delivered fps (target ≥ 30)", f"{results['single_fps']}"),
        (
            "  action → first frame reflecting it, ms p50 / p95 / max (≤ 100)",
            f"{a['p50']} / {a['p95']} / {a['max']} (n={a['n']})",
        ),
        ("  late chunks (gap > 1.5 × chunk period)", f"{results['single_late_chunks']}"),
        (f"{results['sessions']} sessions at 15 fps: delivered fps min / mean", f"{c['min']} / {c['mean']}"),
        ("  late chunks, all sessions", f"{results['concurrent_late_chunks']}"),
        ("  action → frame ms p50 / p95", f"{c_act['p50']} / {c_act['p95']} (n={c_act['n']})"),
        (
            "tiny-video-random prompt update → applied, ms p50 / p95 / max",
            f"{p['p50']} / {p['p95']} / {p['max']} (n={p['n']})",
        ),
        (
            "  applied on the declared chunk / later",
            f"{results['prompt_on_declared_chunk']} / {results['prompt_later_than_declared']}",
        ),
        ("  applies_at − last chunk received when sent", json.dumps(results["prompt_boundary_gap"])),
    ]
    for key in ("single_server_cpu", "concurrent_server_cpu", "prompt_server_cpu"):
        if key in results:
            rows.append((f"server CPU (cores busy), {key.removesuffix('_server_cpu')}", str(results[key])))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Against ``--url``, or an ``omniduplex serve`` we start on a free loopback port (its log
    in a temporary folder, removed after) and stop."""
    if args.url:
        return await bench(args.url, args.seconds, args.sessions, None)
    with tempfile.TemporaryDirectory(prefix="bench-world-") as logs:
        async with ServerProcess(ConfigSpec("world", []), log_dir=Path(logs)) as target:
            return await bench(target.base_url, args.seconds, args.sessions, target.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_world", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", default=None, help="a running server (default: spawn one)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent tiny-jepa sessions")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    print(render(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
