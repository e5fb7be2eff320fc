"""The client side of the realtime tests: every server event passes through `ServerEvents`.

`ServerEvents` reads one connection (an `openai` SDK realtime connection, or a raw
`websockets` client) in a background task, validates every event strictly against the SDK's
`RealtimeServerEvent` (`tests.session.realtime_harness.assert_valid_server_event`: real
validation, no undeclared fields, `omni.*` exempt), checks `event_id`s are unique, and stamps
each with its arrival time. Tests then wait for the events they need.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter
from websockets.exceptions import ConnectionClosed

from tests.live_server import LiveServer
from tests.session.realtime_harness import assert_valid_server_event

_SERVER_EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
WIRE_RATE = 24_000


@dataclass(frozen=True, slots=True)
class Received:
    at: float  # time.monotonic() when it arrived
    raw: dict[str, Any]
    event: Any  # the validated SDK model (the raw dict for `omni.*` events)

    @property
    def type(self) -> str:
        return str(self.raw["type"])


class ServerEvents:
    """Strictly validated server events of one connection, in arrival order."""

    def __init__(self, recv: Callable[[], Awaitable[str | bytes]]) -> None:
        self._recv = recv
        self._queue: asyncio.Queue[Received | None] = asyncio.Queue()
        self.log: list[Received] = []
        self.closed: ConnectionClosed | None = None
        self._problem: BaseException | None = None
        self._ids: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ServerEvents:
        self._task = asyncio.create_task(self._read(), name="test-server-events")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # re-raises only our own cancellation
        if self._problem is not None and exc[0] is None:
            raise self._problem

    async def _read(self) -> None:
        try:
            while True:
                data = await self._recv()
                at = time.monotonic()
                raw = json.loads(data)
                assert_valid_server_event(raw)
                assert raw["event_id"] not in self._ids, f"duplicate event_id {raw['event_id']}"
                self._ids.add(raw["event_id"])
                event = raw if raw["type"].startswith("omni.") else _SERVER_EVENTS.validate_python(raw)
                received = Received(at, raw, event)
                self.log.append(received)
                self._queue.put_nowait(received)
        except ConnectionClosed as exc:
            self.closed = exc
        except Exception as exc:  # a schema violation: fail the test at its next wait
            self._problem = exc
        self._queue.put_nowait(None)

    async def next(self, within_s: float = 30.0) -> Received:
        """The next event; raises the validation failure or `ConnectionClosed` if that came."""
        item = await asyncio.wait_for(self._queue.get(), within_s)
        if item is None:
            self._queue.put_nowait(None)  # stays at the end for later waits
            if self._problem is not None:
                raise self._problem
            assert self.closed is not None
            raise self.closed
        return item

    async def wait_for(self, *types: str, within_s: float = 30.0) -> Received:
        """Skip events until one of `types` arrives (within `within_s` seconds in all)."""
        deadline = time.monotonic() + within_s
        while True:
            got = await self.next(max(0.0, deadline - time.monotonic()))
            if got.type in types:
                return got

    async def collect_until(self, *types: str, within_s: float = 60.0) -> list[Received]:
        """Every event up to and including the first of `types`."""
        deadline = time.monotonic() + within_s
        out: list[Received] = []
        while True:
            got = await self.next(max(0.0, deadline - time.monotonic()))
            out.append(got)
            if got.type in types:
                return out

    async def close_code(self, within_s: float = 30.0) -> int | None:
        """Wait for the server to close the connection (events meanwhile are kept in `log`)."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                await self.next(max(0.0, deadline - time.monotonic()))
            except ConnectionClosed as exc:
                return None if exc.rcvd is None else exc.rcvd.code

    def types(self) -> list[str]:
        return [r.type for r in self.log]


@asynccontextmanager
async def sdk_session(
    server: LiveServer, *, api_key: str = "unused", model: str = "voice-cascade"
) -> AsyncIterator[tuple[Any, ServerEvents]]:
    """An SDK realtime connection and its validated event stream (`session.created` consumed)."""
    client = AsyncOpenAI(api_key=api_key, base_url=server.base_url)
    async with client.realtime.connect(model=model) as conn, ServerEvents(conn.recv_bytes) as events:
        first = await events.next()
        assert first.type == "session.created", first.raw
        yield conn, events


async def ping(conn: Any, events: ServerEvents) -> None:
    """Prove the socket is still open and served: `input_audio_buffer.clear` → `.cleared`."""
    await conn.input_audio_buffer.clear()
    await events.wait_for("input_audio_buffer.cleared", within_s=10)


# --- audio ----------------------------------------------------------------------------------


def pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.rint(np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def decode_pcm16(b64_chunks: Iterable[str]) -> np.ndarray:
    """base64 PCM16 deltas → float32 samples."""
    data = b"".join(base64.b64decode(c) for c in b64_chunks)
    assert len(data) % 2 == 0, "PCM16 deltas must hold whole samples"
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples)))) if samples.size else 0.0


def chunks(samples: np.ndarray, ms: int, rate: int = WIRE_RATE) -> list[np.ndarray]:
    step = rate * ms // 1000
    return [samples[i : i + step] for i in range(0, len(samples), step)]


async def stream_realtime(
    conn: Any,
    samples: np.ndarray,
    *,
    chunk_ms: int = 20,
    rate: int = WIRE_RATE,
    on_chunk: Callable[[int, float], None] | None = None,
) -> float:
    """Append `samples` (float32 at `rate`) as `chunk_ms` appends paced to real time, on an
    absolute schedule (no drift); `on_chunk(index, sent_at)` sees every send. Returns the
    send time of the last chunk."""
    start = time.monotonic()
    last = start
    for k, piece in enumerate(chunks(samples, chunk_ms, rate)):
        delay = start + k * chunk_ms / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await conn.input_audio_buffer.append(audio=pcm16_b64(piece))
        last = time.monotonic()
        if on_chunk is not None:
            on_chunk(k, last)
    return last


def silence(seconds: float, rate: int = WIRE_RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)
