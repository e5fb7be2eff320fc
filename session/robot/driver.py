"""The async driver of one robot session: the core's effects on a runtime and a connection.

One live runtime request per session (the policy's per-session context lives in its engine
state), fed by one task, the *infer loop*, which keeps exactly one observation in flight:

    control (reset, prompt) first, in order → newest observation → append_input → its
    ActionChunk from the request's stream → the answer frame → the next one

Frames are read as fast as the robot sends them; an observation that arrives while another
waits for the loop replaces it (the older is dropped and counted: a flooding robot gets its
newest observation answered, and the server holds at most one waiting and one in flight,
each at most the 64 MiB frame cap). Controls wait in a short bounded list.

Hosted sessions outlive a connection: :meth:`RobotDriver.detach` leaves the request and its
context as they are (nothing runs: a detached robot sends nothing), and :meth:`attach` serves
the next connection, starting with the metadata frame openpi clients expect on connect. An
answer whose connection went away meanwhile is lost (the robot sends a fresh observation).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from runtime.payloads import ActionChunk, Conditioning
from runtime.progress import AdmissionError, RequestHandle, RequestStatus
from session.frame_link import FrameTransport, RequestRuntime, TransportClosed
from session.robot.core import (
    CloseConnection,
    Dialect,
    Infer,
    Output,
    ResetPolicy,
    RobotSessionCore,
    SendFrame,
    UpdatePrompt,
)
from session.robot.wire import WireError

log = logging.getLogger(__name__)

OFF_LOOP_DECODE_BYTES = 1 << 20  # frames larger than this are decoded on a worker thread
MAX_CONTROLS = 16  # resets/prompt updates waiting for the loop; more is an error


RobotTransport = FrameTransport  # raises TransportClosed when the peer is gone
PolicyRuntime = RequestRuntime


RuntimeProvider = Callable[[str], Awaitable[PolicyRuntime]]


class RobotObserver(Protocol):
    """Metrics of robot sessions (``web.server.metrics.ServerMetrics`` implements it)."""

    def robot_observation_dropped(self) -> None: ...

    def robot_inferred(self, seconds: float, batch: int) -> None: ...

    def robot_error(self, code: str) -> None: ...


class _NoObserver:
    def robot_observation_dropped(self) -> None:
        return None

    def robot_inferred(self, seconds: float, batch: int) -> None:
        return None

    def robot_error(self, code: str) -> None:
        return None


_request_numbers = itertools.count(1)


class RobotDriver:
    """Drives one robot session (see the module docstring)."""

    def __init__(
        self,
        core: RobotSessionCore,
        runtimes: RuntimeProvider,
        pipeline: str,
        *,
        observer: RobotObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        stall_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.pipeline = pipeline
        self._runtimes = runtimes
        self._observer: RobotObserver = observer or _NoObserver()
        self._clock = clock
        self._stall_timeout_s = stall_timeout_s
        self._runtime: PolicyRuntime | None = None
        self._handle: RequestHandle | None = None
        self._pending: Infer | None = None  # the newest observation not yet in the runtime
        self._controls: deque[ResetPolicy | UpdatePrompt] = deque()
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._transport: RobotTransport | None = None
        self._send_lock = asyncio.Lock()
        self.connection_closed = asyncio.Event()  # the server closed the current connection
        self.dropped = 0  # observations replaced by a newer one before the policy saw them
        self.last_activity = clock()
        self.ended = False

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the infer loop. The runtime request starts (from the core's context) with the
        first observation: the policy pipeline loads on first use, and a robot's upgrade (a
        gateway's too, under its connect timeout) must not wait for that."""
        self._loop_task = asyncio.create_task(self._infer_loop(), name=f"robot-infer-{self.core.session_id}")

    async def _request(self) -> str | None:
        """The live request's id, started from the context when there is none; None, the robot
        told why in its dialect, when the policy cannot take it now (the next observation
        tries again)."""
        if self._handle is None:
            try:
                if self._runtime is None:
                    self._runtime = await self._runtimes(self.pipeline)
                request_id = f"robot_{self.core.session_id}_{next(_request_numbers)}"
                self._handle = await self._runtime.submit(
                    self.core.context.submit_params(), session_key=self.core.session_id, request_id=request_id
                )
            except asyncio.CancelledError:
                raise
            except AdmissionError as exc:
                self._observer.robot_error("policy_at_capacity")
                await self.perform(
                    self.core.error("policy_at_capacity", f"the policy pipeline is full: {exc}")
                )
                return None
            except Exception as exc:
                log.exception("robot session %s: could not start %s", self.core.session_id, self.pipeline)
                self._observer.robot_error("policy_unavailable")
                message = f"the policy could not start: {type(exc).__name__}: {exc}"
                await self.perform(self.core.error("policy_unavailable", message))
                return None
        return self._handle.request_id

    async def end(self) -> None:
        """Stop for good: the infer loop, then the runtime request."""
        self.ended = True
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._cancel_request()

    async def _cancel_request(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None and self._runtime is not None:
            await self._runtime.cancel(handle.request_id)

    # --- connections -------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._transport is not None

    async def attach(self, transport: RobotTransport, opening: bytes) -> bool:
        """Serve ``transport`` from now on, ``opening`` (the metadata frame) first. False if it
        cannot take it (gone already)."""
        self._transport = transport
        self.connection_closed = asyncio.Event()
        self.last_activity = self._clock()
        return await self._send(opening)

    def detach(self, transport: RobotTransport | None = None) -> None:
        """The connection ``transport`` (None: whichever) is gone; pending work is dropped."""
        if transport is None or self._transport is transport:
            self._transport = None
            self._pending = None

    # --- frames in ---------------------------------------------------------------------------

    async def handle_frame(self, data: bytes | str) -> None:
        now = self.last_activity = self._clock()
        if isinstance(data, bytes) and len(data) > OFF_LOOP_DECODE_BYTES:
            try:
                message = await asyncio.to_thread(self.core.decode, data)
            except WireError as exc:
                await self.perform(self.core.error(exc.code, exc.message))
                return
            await self.perform(self.core.handle_message(message, now))
        else:
            await self.perform(self.core.handle_frame(data, now))

    async def perform(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, SendFrame):
                await self._send(out.data)
            elif isinstance(out, CloseConnection):
                await self._close(out.code, out.reason)
            elif isinstance(out, Infer):
                if self._pending is not None:
                    self.dropped += 1
                    self._observer.robot_observation_dropped()
                    if out.prompt is None:  # keep a prompt change the dropped one carried
                        out.prompt = self._pending.prompt
                self._pending = out
                self._work.set()
            elif len(self._controls) >= MAX_CONTROLS:
                await self.perform(self.core.error("too_many_controls", "too many resets/updates waiting"))
            else:
                self._controls.append(out)
                self._work.set()

    # --- frames out --------------------------------------------------------------------------

    async def _send(self, data: bytes | str) -> bool:
        transport = self._transport
        if transport is None:
            return False
        try:
            async with self._send_lock, asyncio.timeout(self._stall_timeout_s):
                if isinstance(data, bytes):
                    await transport.send_bytes(data)
                else:
                    await transport.send_text(data)
        except TransportClosed:
            self.detach(transport)
            return False
        except TimeoutError:
            log.warning("robot session %s: client stopped reading", self.core.session_id)
            await self._close(1008, "client stopped reading")
            return False
        return True

    async def _close(self, code: int, reason: str) -> None:
        transport = self._transport
        self.detach(transport)
        self.connection_closed.set()
        if transport is not None:
            with contextlib.suppress(TransportClosed, TimeoutError):
                async with asyncio.timeout(2.0):
                    await transport.close(code, reason)

    # --- the infer loop ----------------------------------------------------------------------

    async def _infer_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._controls or self._pending is not None:
                if self._controls:
                    await self._control(self._controls.popleft())
                    continue
                infer, self._pending = self._pending, None
                assert infer is not None
                await self._infer(infer)

    async def _control(self, control: ResetPolicy | UpdatePrompt) -> None:
        """A reset or prompt update, in order with the observations. Without a live request the
        context alone changes (a request starts from it)."""
        handle, runtime = self._handle, self._runtime
        if isinstance(control, ResetPolicy):
            if handle is not None and runtime is not None:
                await runtime.update(handle.request_id, Conditioning({"reset": True}))
            self.core.context.previous = None
        elif handle is not None and runtime is not None:
            await runtime.update(handle.request_id, Conditioning({"prompt": control.prompt}))

    async def _infer(self, infer: Infer) -> None:
        started = self._clock()
        request_id = await self._request()
        if request_id is None:
            return
        assert self._runtime is not None
        if infer.prompt is not None:
            await self._runtime.update(request_id, Conditioning({"prompt": infer.prompt}))
        if await self._runtime.append_input(request_id, infer.observation):
            chunk = await self._next_chunk(infer.observation.seq)
        else:
            chunk = RequestStatus(status="failed", error="the policy request is gone")
        if isinstance(chunk, RequestStatus):
            log.warning("robot session %s: policy request ended: %s", self.core.session_id, chunk.error)
            self._observer.robot_error("policy_failed")
            self._handle = None  # the next observation starts a new request from the context
            await self.perform(
                self.core.error("policy_failed", f"the policy failed: {chunk.error or chunk.status}")
            )
            return
        seconds = self._clock() - started
        self._observer.robot_inferred(seconds, chunk.batch)
        frame = self.core.on_actions(chunk.actions, seconds * 1000.0, dropped=self.dropped)
        if await self._send(frame):
            self.core.on_answered((self._clock() - infer.received_at) * 1000.0)
            self.last_activity = self._clock()

    async def _next_chunk(self, seq: int) -> ActionChunk | RequestStatus:
        """The chunk that answers observation ``seq`` (or how the request ended)."""
        assert self._handle is not None
        async for out in self._handle:
            if isinstance(out, RequestStatus):
                return out
            if isinstance(out, ActionChunk) and out.seq == seq:
                return out
        return RequestStatus(status="failed", error="the runtime ended the stream")

    @property
    def dialect(self) -> Dialect:
        return self.core.dialect


__all__ = [
    "PolicyRuntime",
    "RobotDriver",
    "RobotObserver",
    "RobotTransport",
    "RuntimeProvider",
    "TransportClosed",
]
