"""Scenario ``world``: one world-model video session over ``/v1/realtime/video`` (WebSocket).

Each session sends ``session.start`` (model, JPEG/m4s, size and fps from the workload), then
reads ``video.chunk_metadata`` + binary chunk pairs until the level ends, while a second task
presses and releases movement keys (``session.interaction`` with ``actions``) at a random
phase against the chunk clock. What it measures (client monotonic seconds):

* **fps**: frames delivered per second after a warm-up of one second;
* **frame-interval jitter**: each chunk's arrival minus the previous one's, minus the play
  time of the previous chunk (``frame_count / fps``); with one frame per chunk this is exactly
  *frame interval − 1/fps*. Positive: late. A chunk more than half a period late is *late*;
* **action latency**: ``session.interaction`` sent → the first chunk the server says it shaped
  arrived (the ``session.interaction.applied`` event precedes that chunk's metadata), and
  ``queued`` → ``applied`` as the client saw them (and as the server reports, ``latency_ms``);
* **errors by code** (``error`` events, refused upgrades, unexpected closes).

The runner and reports see a :class:`WorldSessionResult`: a voice ``SessionResult`` with no
turns and a :class:`WorldStats` attached; :func:`world_summary` aggregates a level.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from loadtest.stats import summarize
from loadtest.voice_common import (
    LiveCounters,
    SessionResult,
    book_connect_failure,
    book_refusal,
    count_error,
)
from loadtest.voice_ws import refusal_code
from loadtest.workload import Workload
from runtime.metrics import percentile

DEFAULT_MODEL = "tiny-jepa"
WARMUP_S = 1.0  # chunks in the first second after video.start are not counted
KEYS = "wasd"


@dataclass(slots=True)
class Action:
    sent_at: float
    queued_at: float | None = None
    applies_at: int | None = None  # the chunk the server declared
    applied_at: float | None = None  # session.interaction.applied arrival
    applied_chunk: int | None = None
    server_ms: float | None = None  # the server's queued → its chunk going out
    frame_at: float | None = None  # the applied chunk's binary arrival

    def late(self) -> bool:
        """Applied on a later chunk than the server declared when it queued the action."""
        return (
            self.applied_chunk is not None
            and self.applies_at is not None
            and self.applied_chunk > self.applies_at
        )


@dataclass(slots=True)
class WorldStats:
    """What one world session saw."""

    fps_requested: float
    started_at: float | None = None  # video.start arrival
    chunk_at: list[float] = field(default_factory=list)  # binary arrival of each chunk
    chunk_frames: list[int] = field(default_factory=list)
    chunk_bytes: int = 0
    actions: dict[str, Action] = field(default_factory=dict)
    done_reason: str | None = None

    @property
    def frames(self) -> int:
        return sum(self.chunk_frames)

    def counted(self) -> int:
        """Index of the first chunk after the warm-up."""
        if self.started_at is None:
            return len(self.chunk_at)
        start = self.started_at + WARMUP_S
        return next((i for i, t in enumerate(self.chunk_at) if t >= start), len(self.chunk_at))

    def fps(self) -> float | None:
        """Frames per second delivered after the warm-up (None with fewer than 3 chunks)."""
        k = self.counted()
        times = self.chunk_at[k:]
        if len(times) < 3 or times[-1] <= times[0]:
            return None
        return sum(self.chunk_frames[k:-1]) / (times[-1] - times[0])

    def jitter_ms(self) -> list[float]:
        """Per chunk after the warm-up: arrival interval − previous chunk's play time (ms)."""
        k = max(1, self.counted())
        period = 1.0 / self.fps_requested
        return [
            (self.chunk_at[i] - self.chunk_at[i - 1] - self.chunk_frames[i - 1] * period) * 1000.0
            for i in range(k, len(self.chunk_at))
        ]

    def late_chunks(self) -> int:
        period_ms = 1000.0 / self.fps_requested
        return sum(1 for j in self.jitter_ms() if j > 0.5 * period_ms)

    def action_ms(self) -> list[float]:
        """Interaction sent → the first chunk it shaped arrived."""
        return [(a.frame_at - a.sent_at) * 1000.0 for a in self.actions.values() if a.frame_at is not None]

    def queued_to_applied_ms(self) -> list[float]:
        return [
            (a.applied_at - a.queued_at) * 1000.0
            for a in self.actions.values()
            if a.applied_at is not None and a.queued_at is not None
        ]

    def to_json(self) -> dict[str, Any]:
        fps = self.fps()
        applied = [a for a in self.actions.values() if a.applied_chunk is not None]
        return {
            "fps": None if fps is None else round(fps, 2),
            "frames": self.frames,
            "chunks": len(self.chunk_at),
            "mbytes": round(self.chunk_bytes / 2**20, 2),
            "late_chunks": self.late_chunks(),
            "actions_sent": len(self.actions),
            "actions_applied": len(applied),
            "applied_later_than_declared": sum(1 for a in applied if a.late()),
            "done_reason": self.done_reason,
        }


@dataclass(slots=True)
class WorldSessionResult(SessionResult):
    world: WorldStats | None = None


def start_event(w: Workload, index: int) -> dict[str, Any]:
    return {
        "type": "session.start",
        "model": w.model or DEFAULT_MODEL,
        "format": w.video_format,
        "width": w.width,
        "height": w.height,
        "fps": w.fps,
        "seed": w.seed * 1000 + index,
    }


class WorldSession:
    def __init__(
        self,
        index: int,
        url: str,
        workload: Workload,
        counters: LiveCounters,
        *,
        clock: Callable[[], float] = time.monotonic,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        self.url = url
        self.w = workload
        self.counters = counters
        self.clock = clock
        self.headers = headers or {}
        self.stats = WorldStats(float(workload.fps))
        self.result = WorldSessionResult(index, world=self.stats)
        self._rng = random.Random(workload.seed * 100_003 + index)
        self._ws: ClientConnection | None = None
        self._started = asyncio.Event()
        self._done = asyncio.Event()
        self._refused = asyncio.Event()  # an error before video.start
        self._by_chunk: dict[int, list[Action]] = {}  # applied chunk index → its actions
        self._ids = 0

    async def run(self, end_at: float) -> SessionResult:
        try:
            self._ws = await connect(
                self.url, compression=None, max_size=2**24, open_timeout=30, additional_headers=self.headers
            )
        except InvalidStatus as exc:
            return book_refusal(self.result, self.counters, refusal_code(exc))
        except (OSError, TimeoutError) as exc:
            return book_connect_failure(self.result, self.counters, exc)
        self.counters.live += 1
        try:
            await self._session(end_at)
        except ConnectionClosed as exc:  # a send on a socket the server closed
            self._on_close(exc)
        finally:
            self.counters.live -= 1
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await self._ws.close()
        return self.result

    async def _session(self, end_at: float) -> None:
        ws = self._ws
        assert ws is not None
        await ws.send(json.dumps(start_event(self.w, self.index)))
        reader = asyncio.create_task(self._read(), name=f"w{self.index}:reader")
        try:
            if not await self._until(self._started, end_at + 30.0, reader, also=self._refused):
                if self.result.admission == "not_attempted":
                    self.result.admission = "no_video_start"
                    self._count_error("no_video_start")
                return
            self.result.admission = "admitted"
            self.counters.admitted += 1
            await self._press_keys(end_at, reader)
            if not reader.done():
                await ws.send(json.dumps({"type": "session.stop"}))
                await self._until(self._done, self.clock() + 5.0, reader)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await reader

    async def _until(
        self,
        event: asyncio.Event,
        deadline: float,
        reader: asyncio.Task[None],
        *,
        also: asyncio.Event | None = None,
    ) -> bool:
        """Wait for ``event`` (or ``also``) until ``deadline`` or until the reader ends."""
        waiters = {asyncio.create_task(e.wait()) for e in (event, also) if e is not None}
        try:
            await asyncio.wait(
                {*waiters, reader},
                timeout=max(0.0, deadline - self.clock()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        return event.is_set()

    async def _press_keys(self, end_at: float, reader: asyncio.Task[None]) -> None:
        """Alternate keydown / keyup of a random movement key every ``action_every_s`` (± 50 %)."""
        ws = self._ws
        assert ws is not None
        held: str | None = None
        while not reader.done():
            delay = self.w.action_every_s * self._rng.uniform(0.5, 1.5)
            if self.clock() + delay >= end_at:
                await self._until(self._done, end_at, reader)
                return
            await asyncio.sleep(delay)
            if reader.done():
                return
            if held is None:
                held = self._rng.choice(KEYS)
                actions = [{"event": "keydown", "key": held}]
            else:
                actions = [{"event": "keyup", "key": held}]
                held = None
            self._ids += 1
            event_id = f"a{self.index}-{self._ids}"
            self.stats.actions[event_id] = Action(self.clock())
            event = {"type": "session.interaction", "event_id": event_id, "actions": actions}
            await ws.send(json.dumps(event, separators=(",", ":")))

    # --- server events -------------------------------------------------------------------

    async def _read(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            await self._read_events(ws)
        except ConnectionClosed as exc:
            self._on_close(exc)

    async def _read_events(self, ws: ClientConnection) -> None:
        meta: dict[str, Any] | None = None
        async for message in ws:
            now = self.clock()
            if isinstance(message, bytes):
                if meta is None:
                    self._count_error("binary_without_metadata")
                    continue
                self._on_chunk(meta, len(message), now)
                meta = None
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "video.chunk_metadata":
                meta = event
            elif kind == "video.start":
                self.stats.started_at = now
                self._started.set()
            elif kind == "session.interaction.queued":
                action = self.stats.actions.get(str(event.get("event_id")))
                if action is not None:
                    action.queued_at, action.applies_at = now, int(event["applies_at_chunk"])
            elif kind == "session.interaction.applied":
                self._on_applied(event, now)
            elif kind == "session.done":
                self.stats.done_reason = str(event.get("reason"))
                self._done.set()
            elif kind == "error":
                code = str(event.get("code"))
                self._count_error(code)
                if not self._started.is_set() and self.result.admission == "not_attempted":
                    self.result.admission = code  # e.g. capacity_exceeded at session.start
                    self._refused.set()

    def _on_chunk(self, meta: dict[str, Any], size: int, now: float) -> None:
        self.stats.chunk_at.append(now)
        self.stats.chunk_frames.append(int(meta.get("frame_count", 1)))
        self.stats.chunk_bytes += size
        for action in self._by_chunk.pop(int(meta["chunk_index"]), []):
            action.frame_at = now

    def _on_applied(self, event: dict[str, Any], now: float) -> None:
        chunk = int(event["chunk_index"])
        for event_id in event.get("event_ids", []):
            action = self.stats.actions.get(str(event_id))
            if action is None:
                continue
            action.applied_at, action.applied_chunk = now, chunk
            action.server_ms = float(event.get("latency_ms", 0.0))
            self._by_chunk.setdefault(chunk, []).append(action)

    def _on_close(self, exc: ConnectionClosed) -> None:
        if self.result.close is not None or (exc.rcvd is not None and exc.rcvd.code == 1000):
            return
        self.result.close = f"{exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd is not None else "no close frame"
        self._count_error("connection_closed")

    def _count_error(self, code: str) -> None:
        count_error(self.result, self.counters, code)


async def warm_up(
    url: str, w: Workload, headers: dict[str, str] | None = None, timeout_s: float = 300.0
) -> None:
    """Start (and stop) one session so the model's pipeline is loaded before the clock starts."""
    async with (
        asyncio.timeout(timeout_s),
        connect(url, max_size=2**24, open_timeout=30, additional_headers=headers or {}) as ws,
    ):
        await ws.send(json.dumps(start_event(w, 10_000)))
        chunks = 0
        async for message in ws:
            if isinstance(message, bytes):
                chunks += 1
                if chunks >= 3:
                    break
            elif json.loads(message).get("type") == "error":
                raise RuntimeError(f"world warm-up refused: {message}")
        await ws.send(json.dumps({"type": "session.stop"}))


def world_summary(stats: list[WorldStats]) -> dict[str, Any]:
    """A level's world measures (JSON-ready); distributions keep 101 quantiles for plots."""
    jitter = np.array([j for s in stats for j in s.jitter_ms()], dtype=np.float64)
    action = [v for s in stats for v in s.action_ms()]
    fps = [s.fps() for s in stats]
    return {
        "sessions": len(stats),
        "fps_requested": stats[0].fps_requested if stats else None,
        "fps": summarize(fps, digits=2),
        "frames": sum(s.frames for s in stats),
        "chunks": sum(len(s.chunk_at) for s in stats),
        "frame_jitter_ms": summarize(jitter.tolist()),
        "frame_jitter_abs_ms": summarize(np.abs(jitter).tolist()),
        "frame_jitter_quantiles_ms": (
            [round(percentile(jitter, q), 2) for q in range(101)] if jitter.size else []
        ),
        "late_chunks": sum(s.late_chunks() for s in stats),
        "action_ms": summarize(action),
        "action_samples_ms": [round(v, 1) for v in action],
        "queued_to_applied_ms": summarize(v for s in stats for v in s.queued_to_applied_ms()),
        "server_action_ms": summarize(a.server_ms for s in stats for a in s.actions.values()),
        "actions_sent": sum(len(s.actions) for s in stats),
        "actions_applied": sum(1 for s in stats for a in s.actions.values() if a.applied_chunk is not None),
        "applied_later_than_declared": sum(1 for s in stats for a in s.actions.values() if a.late()),
    }
