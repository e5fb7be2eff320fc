"""The async driver of one video connection: performs the core's effects on a runtime and a transport.

Transport-agnostic: the web layer hands it client text frames and a :class:`VideoTransport`
(a WebSocket adapter); it owns one task per generation (the *media loop*) and nothing else.

The media loop keeps at most one chunk demanded and not yet sent, so nothing queues up between
the model and the socket: demand → generate → upscale → encode (worker thread) → wait for the
chunk's due time → ``video.chunk_metadata`` + binary frame → demand the next one just in time.
A client that stops reading blocks the send; no further chunk is demanded, so generation
pauses and memory stays flat; a send blocked for ``stall_timeout_s`` ends the session with an
``error`` (``client_stalled``) and close code 1008 where the socket still takes them.
Metadata and its binary frame go out under one lock, so a control reply (pong, queued) can
slip in between chunks but never between a chunk's two frames.

Hosted sessions (``retain=True``, see :mod:`session.world.hosting`) outlive a connection: a
send that finds the peer gone *detaches* the driver instead of ending it (the frames of that
send are lost), and so does :meth:`VideoSessionDriver.detach`. While detached every send
waits for :meth:`VideoSessionDriver.attach`: the media loop holds the one chunk it has and
demands no other, so the runtime request and its rolling context stay as they are and nothing
grows. The stall timeout does not run while detached (there is no socket to stall). A WebRTC
call's track that ends under a chunk's frames detaches the same way. A connection attached
later may bring its own outlet factory (a call's track, a WebSocket's encoder): the running
generation's outlet follows it from the next chunk (:class:`~session.world.outlets.ConnectionOutlet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from media.video import EncodedChunk
from runtime.payloads import Action, Conditioning, Frames
from runtime.progress import AdmissionError, RequestHandle, RequestStatus
from session.frame_link import FrameTransport, RequestRuntime, TransportClosed
from session.internal_errors import report_internal
from session.world.core import (
    CancelGeneration,
    CloseConnection,
    Output,
    StartGeneration,
    VideoSessionCore,
)
from session.world.events import ErrorCode, ServerEvent
from session.world.outlets import ConnectionOutlet, OutletFactory, encoded_outlet
from session.world.pacing import ChunkPacer

log = logging.getLogger(__name__)

DEMAND = "demand"  # engines.world.controls.DEMAND: one more chunk, please


VideoTransport = FrameTransport  # raises TransportClosed when the peer is gone
WorldRuntime = RequestRuntime


RuntimeProvider = Callable[[str], Awaitable[WorldRuntime]]  # pipeline name → started runtime

__all__ = ["OutletFactory", "RuntimeProvider", "TransportClosed", "VideoSessionDriver", "VideoTransport"]


class _Stalled(Exception):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"send blocked for {waited_s:.1f} s")
        self.waited_s = waited_s


@dataclass(slots=True)
class DriverStats:
    chunks_received: int = 0  # chunks out of the runtime
    chunks_sent: int = 0
    bytes_sent: int = 0
    demands: int = 0
    send_blocked_s: float = 0.0  # longest single wait for the socket
    sending_since: float | None = None  # a send in progress started then (driver clock)


class VideoSessionDriver:
    def __init__(
        self,
        core: VideoSessionCore,
        transport: VideoTransport,
        runtimes: RuntimeProvider,
        *,
        outlets: OutletFactory = encoded_outlet,
        clock: Callable[[], float] = time.monotonic,
        retain: bool = False,
    ) -> None:
        self.core = core
        self._outlets = outlets
        self.stats = DriverStats()
        self._transport = transport
        self._runtimes = runtimes
        self._clock = clock
        self._limits = core.limits
        self._send_lock = asyncio.Lock()
        self._runtime: WorldRuntime | None = None
        self._media: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._dead = False  # the socket is unusable (stalled or gone): drop further sends
        self.retain = retain  # a lost connection detaches instead of ending (hosted sessions)
        self._attached = asyncio.Event()
        self._attached.set()
        self._restart_outlet = False  # a new connection took over: the next chunk stands alone
        self._connection = 0  # +1 per attach: a chunk encoded for one connection is not sent to the next
        self.last_activity = clock()  # client input or a chunk sent (driver clock; for idle TTL)

    # -- fed by the transport -----------------------------------------------------------------

    async def handle_text(self, text: str) -> None:
        self.last_activity = self._clock()
        await self._perform(self.core.handle_text(text, self._clock()))

    async def handle_binary(self, data: bytes) -> None:
        await self._perform(self.core.handle_binary(len(data)))

    async def wait_closed(self) -> None:
        await self._closed.wait()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def attached(self) -> bool:
        return self._attached.is_set()

    def detach(self) -> None:
        """Hosted: the connection is gone; sends wait for :meth:`attach` (generation pauses)."""
        if self.retain:
            self._attached.clear()

    async def attach(
        self, transport: VideoTransport, first: Sequence[str] = (), outlets: OutletFactory | None = None
    ) -> None:
        """Hosted resume: serve ``transport`` from now on, ``first`` (e.g. the resumed event)
        ahead of anything else, its chunks through ``outlets`` (None: as before). Raises
        :class:`TransportClosed` if it cannot take them; the driver then stays detached."""
        self._attached.clear()
        self._transport = transport
        for text in first:
            try:
                async with asyncio.timeout(self._limits.stall_timeout_s):
                    await transport.send_text(text)
            except TimeoutError as exc:
                raise TransportClosed("the resumed connection does not take events") from exc
        if outlets is not None:
            self._outlets = outlets
        self._restart_outlet = True
        self._connection += 1
        self.last_activity = self._clock()
        self._attached.set()

    async def end(self, code: int, reason: str, error: tuple[str, str] | None = None) -> None:
        """Hosted: end the session from outside (expired, deleted, shutdown): cancel the
        runtime request, then tell an attached client why (``error``) and close with ``code``."""
        outputs = self.core.on_ended(code, reason, error)
        attached = self._attached.is_set() and not self._dead
        self._dead = True
        await self._stop_generating(outputs)
        if attached:
            await self._send_last(outputs, self._send_lock)
        self._closed.set()

    async def close(self) -> None:
        """The transport is gone (or the server shuts down): stop generating, end the media loop."""
        self._dead = True
        await self._stop_generating(self.core.on_closed())
        self._closed.set()

    async def _stop_generating(self, outputs: list[Output]) -> None:
        """Cancel the runtime requests that ``outputs`` name, then stop the media loop: what
        both ways a session ends (:meth:`end`, :meth:`close`) do alike."""
        await self._cancel_requests(outputs)
        media, self._media = self._media, None
        if media is not None:
            media.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await media

    # -- effects ------------------------------------------------------------------------------

    async def _perform(self, outputs: list[Output]) -> None:
        if self._dead:
            outputs = [o for o in outputs if isinstance(o, CancelGeneration)]
        try:
            for out in outputs:
                if isinstance(out, ServerEvent):
                    await self._send(out.to_json())
                elif isinstance(out, StartGeneration):
                    self._start_media(out)
                elif isinstance(out, CancelGeneration):
                    await self._cancel(out.request_id)
                elif isinstance(out, CloseConnection):
                    await self._close_transport(out)
        except _Stalled as stall:
            await self._on_stall(stall.waited_s)
        except TransportClosed:
            await self._on_transport_closed()

    def _start_media(self, start: StartGeneration) -> None:
        self._media = asyncio.create_task(
            self._media_loop(start, self._media), name=f"video-media-{start.request_id}"
        )

    async def _cancel_requests(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, CancelGeneration):
                await self._cancel(out.request_id)

    async def _send_last(
        self, outputs: list[Output], lock: contextlib.AbstractAsyncContextManager[Any]
    ) -> None:
        """The last events and the close frame of ``outputs``, best effort: the socket may never
        drain, so they get the close grace and then give up. ``lock``: held while sending
        (:meth:`end` takes the send lock; a stall does not wait for it)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._limits.close_grace_s), lock:
                for out in outputs:
                    if isinstance(out, ServerEvent):
                        await self._transport.send_text(out.to_json())
                    elif isinstance(out, CloseConnection):
                        await self._transport.close(out.code, out.reason)

    async def _cancel(self, request_id: str) -> None:
        if self._runtime is not None:
            await self._runtime.cancel(request_id)

    async def _send(self, *frames: str | bytes) -> None:
        """Send frames back to back; :class:`_Stalled` if the socket blocks too long. Hosted
        and detached: wait for a connection first."""
        if self._dead:
            return
        async with self._send_lock:
            await self._wait_attached()
            if not self._dead:
                await self._write(frames)

    async def _send_chunk(self, make: Callable[[], list[str | bytes]], connection: int) -> bool:
        """Send a chunk's frames, built by ``make`` (which hands the chunk out to the core)
        under the send lock. False, with nothing handed out, when detached or when another
        connection took over since it was encoded for ``connection``: the caller encodes it
        again for the new connection (an m4s one needs a new init segment)."""
        if self._dead:
            return True
        async with self._send_lock:
            if not self._attached.is_set() or self._connection != connection:
                return False
            if not self._dead:
                await self._write(make())
            return True

    async def _write(self, frames: Sequence[str | bytes]) -> None:
        transport = self._transport
        for frame in frames:
            started = self.stats.sending_since = self._clock()
            try:
                async with asyncio.timeout(self._limits.stall_timeout_s):
                    if isinstance(frame, bytes):
                        await transport.send_bytes(frame)
                    else:
                        await transport.send_text(frame)
            except TransportClosed:
                if not self.retain:
                    raise
                if self._transport is transport:  # not a connection already replaced
                    self._attached.clear()
                return  # these frames are lost; the resumed client starts after them
            except TimeoutError:
                if self.retain and self._transport is not transport:
                    return  # a connection already replaced by a resume: not a stall
                waited = self._clock() - started
                self.stats.send_blocked_s = max(self.stats.send_blocked_s, waited)
                raise _Stalled(waited) from None
            finally:
                self.stats.sending_since = None
            waited = self._clock() - started
            self.stats.send_blocked_s = max(self.stats.send_blocked_s, waited)
            self.stats.bytes_sent += len(frame)

    async def _wait_attached(self) -> None:
        """Hosted and detached: wait for a connection (no stall timeout meanwhile)."""
        if not self._attached.is_set():
            await self._attached.wait()

    async def _on_stall(self, waited_s: float) -> None:
        if self._dead:
            return
        self._dead = True
        log.warning(
            "video session %s: %s", self.core.session_id, f"client stopped reading for {waited_s:.1f} s"
        )
        outputs = self.core.on_stalled(waited_s)
        await self._cancel_requests(outputs)
        await self._send_last(outputs, contextlib.nullcontext())
        self._closed.set()
        media = self._media
        if media is not None and media is not asyncio.current_task():
            media.cancel()

    async def _on_transport_closed(self) -> None:
        """A send found the peer gone: stop generating; the receive side ends the connection."""
        self._dead = True
        for out in self.core.on_closed():
            if isinstance(out, CancelGeneration):
                await self._cancel(out.request_id)
        self._closed.set()

    async def _close_transport(self, out: CloseConnection) -> None:
        self._dead = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._limits.close_grace_s):
                await self._transport.close(out.code, out.reason)
        self._closed.set()

    # -- the media loop -----------------------------------------------------------------------

    async def _media_loop(self, start: StartGeneration, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:  # the last generation ended (the core says so); let it tidy up
            await asyncio.wait([previous])
        try:
            runtime = await self._runtimes(start.pipeline)
            handle = await runtime.submit(
                start.params, session_key=self.core.session_id, request_id=start.request_id
            )
        except asyncio.CancelledError:
            raise
        except AdmissionError as exc:
            await self._perform(self.core.on_start_failed(ErrorCode.CAPACITY, str(exc)))
            return
        except Exception as exc:
            context = f"video session {self.core.session_id}: could not start {start.pipeline}"
            message = report_internal(log, context, exc, exc_info=True)
            await self._perform(self.core.on_start_failed(ErrorCode.GENERATION_FAILED, message))
            return
        self._runtime = runtime
        outlet: ConnectionOutlet | None = None
        try:
            outlet = await ConnectionOutlet.open(start, lambda: self._outlets)
            await self._perform(self.core.on_started())
            await self._pump(runtime, handle, outlet, start)
        except asyncio.CancelledError:
            await runtime.cancel(start.request_id)
            raise
        except _Stalled as stall:
            await self._on_stall(stall.waited_s)
        except TransportClosed:
            await self._on_transport_closed()
        except Exception as exc:
            context = f"video session {self.core.session_id}: media loop failed"
            message = report_internal(log, context, exc, exc_info=True)
            await runtime.cancel(start.request_id)
            await self._perform(self.core.on_generation_end("failed", message))
        finally:
            if outlet is not None:
                outlet.close()

    async def _pump(
        self, runtime: WorldRuntime, handle: RequestHandle, outlet: ConnectionOutlet, start: StartGeneration
    ) -> None:
        pacer = ChunkPacer()
        demanded_at = await self._demand(runtime)
        async for out in handle:
            if isinstance(out, RequestStatus):
                await self._perform(self.core.on_generation_end(out.status, out.error))
                return
            if not isinstance(out, Frames):
                continue
            self.stats.chunks_received += 1
            fps = out.fps or start.fps
            while True:  # once, unless the connection drops between encoding and sending
                await self._wait_attached()  # detached: hold this chunk, demand nothing more
                if self._restart_outlet:
                    self._restart_outlet = False
                    await outlet.restart()
                connection = self._connection
                encoded = await outlet.prepare(out.frames)
                now = self._clock()
                if demanded_at is not None:
                    pacer.observe_latency(now - demanded_at)
                    demanded_at = None
                await self._sleep_until(pacer.send_at(now))
                sent_at = self._clock()

                make = functools.partial(self._chunk_frames, outlet, out.chunk_index, encoded, fps, sent_at)
                if await self._send_chunk(make, connection):
                    break
            if outlet.kind != "media":
                await self._play(outlet, out.frames, fps, connection)
            self.stats.chunks_sent += 1
            self.last_activity = sent_at
            pacer.sent(sent_at, encoded.frame_count / fps)
            await self._sleep_until(pacer.demand_at(self._clock()))
            demanded_at = await self._demand(runtime)
        # the stream ended without a status: the runtime went away
        await self._perform(self.core.on_generation_end("failed", "the runtime ended the stream"))

    def _chunk_frames(
        self, outlet: ConnectionOutlet, chunk_index: int, encoded: EncodedChunk, fps: float, sent_at: float
    ) -> list[str | bytes]:
        """Hand the chunk out (the core numbers it): its events, then its bytes (media outlets)."""
        events = self.core.on_chunk(
            chunk_index,
            encoded,
            outlet.mime_type,
            fps,
            sent_at,
            kind=outlet.kind,
            queue_depth=outlet.queue_depth,
        )
        wire: list[str | bytes] = [event.to_json() for event in events]
        return [*wire, encoded.data] if outlet.kind == "media" else wire

    async def _play(self, outlet: ConnectionOutlet, frames: Any, fps: float, connection: int) -> None:
        """Frames onto a track outlet, which waits while about a chunk is queued: a peer that
        stops taking frames blocks here, and as long as a blocked socket send counts as a stall.
        Hosted: a track that ended (its call is gone) detaches, like a failed send; the frames
        are lost and a resumed connection gets the next chunk."""
        started = self._clock()
        try:
            async with asyncio.timeout(self._limits.stall_timeout_s):
                await outlet.play(frames, fps)
        except TransportClosed:
            if not self.retain:
                raise
            if self._connection == connection:  # not a connection already replaced
                self._attached.clear()
        except TimeoutError:
            if self.retain and self._connection != connection:
                return  # a connection already replaced by a resume: not a stall
            waited = self._clock() - started
            self.stats.send_blocked_s = max(self.stats.send_blocked_s, waited)
            raise _Stalled(waited) from None

    async def _demand(self, runtime: WorldRuntime) -> float | None:
        """Send pending interactions, then demand one chunk; when it was demanded (None: not)."""
        demand = self.core.take_demand()
        if demand is None:
            return None
        request_id = demand.request_id
        if demand.prompt is not None:
            await runtime.update(request_id, Conditioning({"prompt": demand.prompt}))
        for kind, key in demand.keys.before:
            await runtime.append_input(request_id, Action(kind, key))
        await runtime.append_input(request_id, Action(DEMAND, 1))
        for kind, key in demand.keys.after:
            await runtime.append_input(request_id, Action(kind, key))
        self.stats.demands += 1
        return self._clock()

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - self._clock()
        if delay > 0:
            await asyncio.sleep(delay)
