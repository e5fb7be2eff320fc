"""Drives one GPT-Live session: its core, its live request and the connection attached now.

The driver is the core's one caller. Client frames come from the connection's
:class:`~session.link.TransportLink` (bounded outbox, one sender task, close 1008 for a client
that stops reading), the model's progress from the :class:`~session.live.request.LivePipe`;
both go into :class:`~session.live.core.LiveSessionCore` and the effects that come back are
carried out here, in order (module docstring of the core). A session outlives its connections:
:meth:`attach` and :meth:`detach` swap the link; while none is attached the model runs on and
what it says is not kept (the live stream has no replay; docs/sessions.md).

Tasks, each owned and cancelled by :meth:`end`: the live request (opened at ``session.start``),
the start deadline (``start_timeout_s`` after the first attach), and ``responses`` delegations
(:mod:`session.live.delegation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from runtime.orchestrator import Orchestrator
from session.link import LinkEnd, Transport, TransportLink
from session.live.core import (
    Begin,
    Close,
    Condition,
    Effect,
    Emit,
    Feed,
    LiveSessionCore,
    Phase,
    RunDelegation,
)
from session.live.request import LivePipe

log = logging.getLogger(__name__)

OVERFLOW_REPORT_S = 1.0  # input_audio_overflow errors: at most one a second
CLOSE_DRAIN_S = 2.0  # session.closed and what is queued before it: at most this long


class LiveObserver(Protocol):
    """Metrics of live sessions (web/server/metrics.py)."""

    def live_frame(self, seconds: float) -> None:
        """Time from a client frame's arrival to its handling done (event loop work)."""
        ...

    def error(self, code: str) -> None: ...


class DelegationRunner(Protocol):
    """Runs ``responses`` delegations on the pipeline's text model (session/live/delegation.py)."""

    async def run(self, driver: LiveDriver, effect: RunDelegation) -> None: ...


@dataclass(frozen=True, slots=True)
class LiveEntryPoint:
    """Where the session's live request opens: the pipeline's live entry and its input rate."""

    entry: str
    input_rate: int


class LiveDriver:
    """One session's core, live request and attached connection (module docstring)."""

    def __init__(
        self,
        core: LiveSessionCore,
        orch: Orchestrator,
        live: LiveEntryPoint,
        *,
        outbox_limit: int = 4096,
        outbox_max_bytes: int = 8 * 1024 * 1024,
        delegations: DelegationRunner | None = None,
        observer: LiveObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.orch = orch
        self.live = live
        self.outbox_limit = outbox_limit
        self.outbox_max_bytes = outbox_max_bytes
        self.delegations = delegations
        self.observer = observer
        self.clock = clock
        self.link: TransportLink | None = None
        self.pipe: LivePipe | None = None
        self.last_activity = clock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pipe_task: asyncio.Task[None] | None = None
        self._start_deadline: asyncio.Task[None] | None = None
        self._links = 0
        self._overflow_at: float | None = None
        self.closed = asyncio.Event()  # the session is over (closed by the client, or refused)
        self.dropped_events = 0  # events made while no connection was attached

    # --- connections -------------------------------------------------------------------------

    def attach(self, transport: Transport, preamble: list[dict[str, Any]] | None = None) -> TransportLink:
        """``transport`` becomes the session's connection (``preamble`` first)."""
        self._links += 1
        link = TransportLink(
            transport,
            self._on_text,
            limit=self.outbox_limit,
            max_bytes=self.outbox_max_bytes,
            name=f"{self.core.session_id}:live{self._links}",
            send_nowait=transport.info.send_nowait,
            deliver=transport.info.deliver,
        )
        self.link = link
        for event in preamble or ():
            link.push(event)
        if self.core.phase is Phase.AWAITING_START and self._start_deadline is None:
            self._start_deadline = asyncio.create_task(
                self._await_start(), name=f"{self.core.session_id}:start-deadline"
            )
        return link

    def detach(self) -> None:
        """The connection is gone or replaced: events from now on are not sent anywhere."""
        link, self.link = self.link, None
        if link is not None:
            link.finish(LinkEnd.REPLACED)

    async def _await_start(self) -> None:
        await asyncio.sleep(self.core.limits.start_timeout_s)
        self.apply(self.core.start_timed_out())

    # --- frames in, effects out --------------------------------------------------------------

    def _on_text(self, text: str) -> None:
        began = self.clock()
        self.last_activity = began
        self.apply(self.core.receive(text))
        if self.observer is not None:
            self.observer.live_frame(self.clock() - began)

    def feed_audio(self, samples: np.ndarray) -> None:
        """Microphone audio of a WebRTC call's track (float32, 24 kHz)."""
        self.last_activity = self.clock()
        self.apply(self.core.push_audio(samples))

    def apply(self, effects: list[Effect]) -> None:
        """Carry out the core's effects, in order."""
        for effect in effects:
            if isinstance(effect, Emit):
                self._send(effect.event)
            elif isinstance(effect, Feed):
                if self.pipe is not None:
                    self.pipe.push(effect.samples)
            elif isinstance(effect, Condition):
                if self.pipe is not None:
                    self.pipe.condition(effect.values)
            elif isinstance(effect, Begin):
                self._begin()
            elif isinstance(effect, RunDelegation):
                self._delegate(effect)
            elif isinstance(effect, Close):
                self._close(effect)

    def _send(self, event: dict[str, Any]) -> None:
        link = self.link
        if link is None or not link.push(event):
            self.dropped_events += 1
        if event.get("type") == "error" and self.observer is not None:
            self.observer.error(str(event["error"].get("code")))

    def _begin(self) -> None:
        if self._start_deadline is not None:
            self._start_deadline.cancel()
        self.pipe = LivePipe(
            self.orch,
            entry=self.live.entry,
            input_rate=self.live.input_rate,
            session_id=self.core.session_id,
            sink=_Sink(self),
            conditioning=self.core.conditioning,
            max_queued_s=self.core.limits.max_queued_audio_s,
        )
        self.pipe.condition(self.core.conditioning())  # the startup instructions and history
        self._pipe_task = asyncio.create_task(self.pipe.run(), name=f"{self.core.session_id}:live-request")

    def _delegate(self, effect: RunDelegation) -> None:
        if self.delegations is None:
            message = "The pipeline has no text model stage to run this delegation."
            self.apply(self.core.live_error("delegation_unavailable", message))
            return
        task = asyncio.create_task(
            self.delegations.run(self, effect), name=f"{self.core.session_id}:delegation"
        )
        self._tasks.add(task)
        task.add_done_callback(self._delegation_done)

    def _delegation_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("live session %s: a delegation failed", self.core.session_id, exc_info=task.exception())
            self.apply(self.core.live_error("server_error", "The delegation could not be run."))

    def _close(self, effect: Close) -> None:
        self.closed.set()
        if self.link is not None:
            self.link.close_after_drain(effect.code, effect.reason)
        self._stop_model()

    def _stop_model(self) -> None:
        for task in (self._pipe_task, self._start_deadline, *self._tasks):
            if task is not None and not task.done():
                task.cancel()

    def overflowed(self) -> None:
        now = self.clock()
        if self._overflow_at is None or now - self._overflow_at >= OVERFLOW_REPORT_S:
            self._overflow_at = now
            limit = self.core.limits.max_queued_audio_s
            message = (
                f"Input audio is arriving faster than the model takes it: more than {limit:g} s "
                "is waiting; audio is dropped until it catches up. Send audio in real time."
            )
            self.apply(self.core.live_error("input_audio_overflow", message))

    # --- the end -----------------------------------------------------------------------------

    async def end(self, cause: str, code: int = 1000, reason: str = "session closed") -> None:
        """End the session: ``session.closed`` (and the final usage) to an attached client,
        its connection closed after them (bounded), the live request and tasks cancelled."""
        self.apply(self.core.close(cause, code=code, reason=reason))
        self.closed.set()
        link = self.link
        if link is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_DRAIN_S):
                    await link.wait()
            await link.aclose(code, reason)
        self._stop_model()
        tasks = [t for t in (self._pipe_task, self._start_deadline, *self._tasks) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        pipe = self.pipe
        return {
            **self.core.stats,
            "phase": self.core.phase.value,
            "muted": self.core.muted,
            "usage_s": round(self.core.usage_s, 3),
            "delegation": self.core.delegation,
            "requests_opened": pipe.opened if pipe else 0,
            "request_failures": pipe.failures if pipe else 0,
            "dropped_input_bytes": pipe.dropped_bytes if pipe else 0,
            "dropped_events": self.dropped_events,
        }


class _Sink:
    """The live request's progress into the core (a :class:`~session.live.request.ProgressSink`)."""

    def __init__(self, driver: LiveDriver) -> None:
        self._d = driver

    def _touch(self) -> None:
        self._d.last_activity = self._d.clock()

    def speech_started(self) -> None:
        self._d.apply(self._d.core.on_speech_started())

    def model_text(self, text: str) -> None:
        self._d.apply(self._d.core.on_model_text(text))

    def model_audio(self, samples: np.ndarray, rate: int) -> None:
        self._touch()
        self._d.apply(self._d.core.on_model_audio(samples, rate))

    def speech_stopped(self) -> None:
        self._d.apply(self._d.core.on_speech_stopped())

    def input_transcript(self, text: str) -> None:
        self._d.apply(self._d.core.on_input_transcript(text))

    def delegate(self, task: str) -> None:
        self._d.apply(self._d.core.on_delegate(task))

    def failed(self, code: str, message: str) -> None:
        self._d.apply(self._d.core.live_error(code, message))

    def overflow(self) -> None:
        self._d.overflowed()
