"""One transport attached to a session driver: its bounded outbox, sender and receiver.

A session outlives its connections (resume), so the driver keeps what belongs to the session
(core, responses, timers) and a :class:`TransportLink` holds what belongs to one connection:

* a bounded outbox of server events, drained in order by one sender task, bounded both in
  events (``limit``) and in bytes of event JSON (``max_bytes``: 4,096 retrieved 1.9 MB items
  would be 8 GB). Full means the client stopped reading: the link ends with close 1008 and the
  outbox is dropped, so memory never grows with a slow client (the session's event log keeps
  the events for a resume). The transport itself never blocks longer than its send deadline
  (web/edge/uvicorn_guards.py closes a socket whose send buffer stays full), and closing it is
  bounded too (``CLOSE_TIMEOUT_S``), so an ending session never waits on a silent peer;
* a fast path past the sender: an event pushed while the sender waits with nothing queued is
  written at once when the transport can take it without waiting (``send_nowait``, e.g. a
  WebSocket whose send buffer has room), in the loop iteration that made it; otherwise it is
  queued as before (and always past ``DIRECT_MAX_BYTES``). Order is kept: the sender is idle
  only once everything before is written;
* a receiver task that hands each client text frame to the driver (or, with ``deliver``, has
  the connection hand each frame to it as it is parsed, in the transport's data callback);
* a *held* start for resumes: events queue while the missed ones are read from the store,
  then :meth:`release` sends a preamble (``omni.session.resumed`` and the replay) first and
  skips queued events the replay already covered.

The link owns its two tasks and ends exactly once (:attr:`end`), for one :class:`LinkEnd`
reason; :meth:`wait` returns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from session import json_text
from session.realtime.effects import PlayAudio

log = logging.getLogger(__name__)

SLOW_CLIENT_CODE = 1008
SLOW_CLIENT_REASON = "client is not reading its events"
CLOSE_TIMEOUT_S = 5.0  # closing a transport (its close frame) waits at most this long
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
# The largest event the fast path writes past the outbox: audio deltas and the like (a 40 ms
# delta is ~2.7 KB). A larger one (a retrieved item of MBs) always goes through the outbox, so
# a client that stops reading meets the outbox's byte bound, not a transport buffer it never
# drains.
DIRECT_MAX_BYTES = 64 * 1024


def event_size(event: dict[str, Any]) -> int:
    """Bytes of an event's JSON: a logged event carries it (``wire``); others (connection
    events, unlogged sessions) are serialized to measure them."""
    wire = getattr(event, "wire", None)
    if wire is not None:
        return len(wire)
    return len(json_text.dumps(event))


class AudioSink(Protocol):
    """Track transports (WebRTC): where `PlayAudio` / `ClearAudioOutput` effects go."""

    def play(self, effect: PlayAudio) -> None: ...

    def clear(self, response_id: str) -> None: ...


@dataclass(slots=True)
class ConnectionInfo:
    """What a connection tells the session layer about itself, typed (these were optional
    attributes read with `getattr` across the session/web boundary)."""

    # Model audio goes out on this media track (WebRTC) instead of as delta events. How audio
    # leaves is a property of the connection: a session begun on WebRTC may resume on a
    # WebSocket and the other way round.
    audio_sink: AudioSink | None = None
    disconnect_code: int | None = None  # the client's close code once it is gone (1000: clean)
    # (cause, delete): the connection knows the session is over (a WebRTC call that never
    # connected), for the host to end it so instead of keeping it resumable.
    session_end: tuple[str, bool] | None = None
    # Writes an event at once when the connection can take it without waiting (True), else
    # does nothing (False): the link then queues it for its sender task. None: always queue.
    send_nowait: Callable[[dict[str, Any]], bool] | None = None
    # Hands each client text frame to the callback as the connection parses it (no task hop
    # per frame) and returns once the client is gone. None: the link awaits `receive()`.
    deliver: Callable[[Callable[[str], None]], Awaitable[None]] | None = None


class Transport(Protocol):
    """What a link needs from a connection (WebSocket, WebRTC data channel, test fake)."""

    info: ConnectionInfo

    async def send(self, event: dict[str, Any]) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...

    async def receive(self) -> str | None:
        """The next client text frame; None once the client is gone."""
        ...


class LinkEnd(enum.Enum):
    CLIENT_GONE = "client_gone"  # the client closed or the connection dropped
    SEND_FAILED = "send_failed"  # writing to the transport raised
    SLOW_CLIENT = "slow_client"  # the outbox overflowed: closed with 1008
    RECEIVE_ERROR = "receive_error"  # handling a client frame raised (a bug): closed with 1011
    REPLACED = "replaced"  # a newer connection resumed the session
    CLOSED = "closed"  # the server closed it (session ended, expired, detached by the host)


class TransportLink:
    def __init__(
        self,
        transport: Transport,
        on_text: Callable[[str], None],
        *,
        limit: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        held: bool = False,
        name: str = "link",
        send_nowait: Callable[[dict[str, Any]], bool] | None = None,
        deliver: Callable[[Callable[[str], None]], Awaitable[None]] | None = None,
    ) -> None:
        self.transport = transport
        self._send_nowait = send_nowait
        self._deliver = deliver
        self.limit = limit
        self.max_bytes = max_bytes
        self.name = name
        self.end: LinkEnd | None = None
        self.error: BaseException | None = None
        self._on_text = on_text
        self._queue: deque[dict[str, Any]] = deque()
        self._sizes: deque[int] = deque()  # bytes of each queued event, in step with _queue
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._released = asyncio.Event()
        self._preamble: Iterable[dict[str, Any]] = ()
        self._skip: Callable[[dict[str, Any]], bool] | None = None
        self._closing: tuple[int, str] | None = None  # close after the outbox drains
        self._ended = asyncio.Event()
        self._closer: asyncio.Task[None] | None = None
        self._idle = False  # the sender waits for events, everything before is written
        if not held:
            self._released.set()
        self._sender = asyncio.create_task(self._send_loop(), name=f"{name}:sender")
        self._receiver = asyncio.create_task(self._receive_loop(), name=f"{name}:receiver")

    # --- events out --------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.end is None and self._closing is None

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def push(self, event: dict[str, Any]) -> bool:
        """Queue one event (never blocks); False when the link is closing or just overflowed
        (more than ``limit`` events or ``max_bytes`` bytes waiting: closed with 1008)."""
        if not self.open:
            return False
        size = event_size(event)
        if self._idle and self._send_nowait is not None and not self._queue and size <= DIRECT_MAX_BYTES:
            try:
                if self._send_nowait(event):
                    return True
            except Exception:  # the transport is gone: nothing more can be said on it
                log.debug("%s: send failed", self.name, exc_info=True)
                self.finish(LinkEnd.SEND_FAILED)
                return False
        if len(self._queue) >= self.limit or (self._queue and self._queued_bytes + size > self.max_bytes):
            log.info(
                "%s: closed 1008: %d events, %d bytes not read",
                self.name,
                len(self._queue),
                self._queued_bytes,
            )
            self.finish(LinkEnd.SLOW_CLIENT, SLOW_CLIENT_CODE, SLOW_CLIENT_REASON)
            return False
        self._queue.append(event)
        self._sizes.append(size)
        self._queued_bytes += size
        self._wake.set()
        return True

    def _pop(self) -> dict[str, Any]:
        self._queued_bytes -= self._sizes.popleft()
        return self._queue.popleft()

    def _clear(self) -> None:
        self._queue.clear()
        self._sizes.clear()
        self._queued_bytes = 0

    def release(
        self,
        preamble: Iterable[dict[str, Any]],
        *,
        skip: Callable[[dict[str, Any]], bool] | None = None,
        drop_queued: bool = False,
    ) -> None:
        """Start sending a held link: `preamble` first (iterated as it is sent: a replay may
        make its events on the way, one at a time), then the queue minus its leading
        events for which `skip` is true (those the replay already had), or none of the queue
        with `drop_queued` (a snapshot taken now supersedes them)."""
        if drop_queued:
            self._clear()
        self._preamble = preamble
        self._skip = skip
        self._released.set()

    def close_after_drain(self, code: int, reason: str) -> None:
        """Send what is queued (e.g. `session_expired`), then close with `code`."""
        if self.open:
            self._closing = (code, reason)
            self._released.set()
            self._wake.set()

    def finish(self, end: LinkEnd, code: int | None = None, reason: str = "") -> None:
        """End the link now: drop the outbox, stop both tasks, close the transport with `code`."""
        if self.end is not None:
            return
        self.end = end
        self._clear()
        self._closer = asyncio.create_task(self._shut(code, reason), name=f"{self.name}:close")

    async def wait(self) -> LinkEnd:
        await self._ended.wait()
        assert self.end is not None
        return self.end

    async def aclose(self, code: int | None = None, reason: str = "", *, drain_s: float = 0.0) -> LinkEnd:
        """End the link (after up to `drain_s` of sending what is queued) and wait for it."""
        if self.end is None and drain_s > 0 and code is not None:
            self.close_after_drain(code, reason)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_s):
                    await self._ended.wait()
        self.finish(LinkEnd.CLOSED, code, reason)
        return await self.wait()

    # --- tasks -----------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        await self._released.wait()
        send = self.transport.send
        try:
            for event in self._preamble:
                await send(event)
            self._preamble = ()
            skip = self._skip
            while True:
                while self._queue:
                    event = self._pop()
                    if skip is not None:
                        if skip(event):
                            continue
                        skip = None
                    await send(event)
                if self._closing is not None:
                    code, reason = self._closing
                    self.finish(LinkEnd.CLOSED, code, reason)
                    return
                self._wake.clear()
                self._idle = skip is None  # no replay left to check events against
                try:
                    await self._wake.wait()
                finally:
                    self._idle = False
        except asyncio.CancelledError:
            raise
        except Exception:  # the transport is gone: nothing more can be said on it
            log.debug("%s: send failed", self.name, exc_info=True)
            self.finish(LinkEnd.SEND_FAILED)

    async def _receive_loop(self) -> None:
        try:
            if self._deliver is not None:
                await self._deliver(self._on_frame)
                self.finish(LinkEnd.CLIENT_GONE)
                return
            while self.open:
                raw = await self.transport.receive()
                if raw is None:
                    self.finish(LinkEnd.CLIENT_GONE)
                    return
                self._on_text(raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("%s: a client frame could not be handled", self.name)
            self.error = exc
            self.finish(LinkEnd.RECEIVE_ERROR, 1011, "internal error")

    def _on_frame(self, raw: str) -> None:
        """One client frame, handed over by the connection as it was parsed. Frames after the
        link stopped reading (ended, or closing after a drain) are not handled, as the loop
        above would not have read them."""
        if not self.open:
            return
        try:
            self._on_text(raw)
        except Exception as exc:
            log.exception("%s: a client frame could not be handled", self.name)
            self.error = exc
            self.finish(LinkEnd.RECEIVE_ERROR, 1011, "internal error")

    async def _shut(self, code: int | None, reason: str) -> None:
        current = asyncio.current_task()
        for task in (self._sender, self._receiver):
            if task is not current:
                task.cancel()
        for task in (self._sender, self._receiver):
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if code is not None:  # bounded: a peer that reads nothing must not hold the end up
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.transport.close(code, reason)
        self._ended.set()
