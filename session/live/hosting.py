"""GPT-Live sessions on the session layer: the identity, admission slots, Redis record, resume
token, retention and replica binding of every other kind, for duplex-native sessions.

A :class:`LiveHost` sits beside the voice :class:`~session.voice.hosting.SessionHost` and
borrows its store, admission controller (one set of slots for every kind), retention policy and
binding. A live session's state is its live request on the model (the model's KV: its rolling
context), which lives in this process only, so, like a world:

* a dropped connection (no close frame, or any close code but 1000) *detaches* the session for
  the disconnect grace: the model runs on (it stops stepping once it hears nothing for a few
  seconds) and what it says meanwhile is not kept; a resume (``?session_id=…`` and the resume
  token) reattaches and gets ``session.started`` again, marked ``omni.resumed``;
* ``session.close``, a clean close 1000, a refused start, ``DELETE``, the idle TTL, the
  maximum lifetime or a shutdown *end* it: ``session.closed`` to an attached client, live
  request cancelled, slot released, record deleted. It is never parked (there is nothing in
  Redis to rebuild the model's context from); a session whose process is gone is not found.

The record holds the session's config (kind ``live``, the model, voice, delegation and the
text the model was told), written at start and when text is appended (rate-limited by the
sweep), never per audio frame. The shared mechanics are :class:`~session.lifecycle.SessionLifecycle`;
this host is its :class:`~session.lifecycle.KindHooks` for live sessions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from session.identity import secret_digest
from session.kind_host import KindHost
from session.lifecycle import CLEAN_CLOSE, EXPIRED_CLOSE, HostedSession, SharedParts
from session.link import Transport
from session.live.core import Phase
from session.live.driver import LiveDriver
from session.store.errors import StoreError

log = logging.getLogger(__name__)

KIND = "live"

# (session id, expires_at, resume data for session.started or None) → a driver
DriverFactory = Callable[[str, int, dict[str, Any] | None], LiveDriver]

__all__ = ["KIND", "LiveHost", "LiveSession"]


@dataclass(eq=False, slots=True)
class LiveSession(HostedSession[LiveDriver, Transport]):
    """A GPT-Live session live in this process."""

    transport_kind: str = "websocket"
    recorded: int = -1  # how much of the core's context the record holds (its length)


class LiveHost(KindHost[LiveSession]):
    """The GPT-Live sessions of one process (module docstring)."""

    def __init__(
        self,
        sessions: SharedParts,
        new_driver: DriverFactory,
        *,
        pipeline: str,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(sessions, KIND, self, expire_when_gone=True, wall=wall, clock=clock)
        self.pipeline = pipeline
        self._new_driver = new_driver

    # --- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Shutdown: every session ends (its model context cannot outlive the process)."""
        await self.end_all((1012, "server shutting down"))

    # --- open --------------------------------------------------------------------------------

    async def create(
        self, session_id: str, tenant: str, *, transport_kind: str, announce: bool
    ) -> tuple[LiveSession, str]:
        """After :meth:`admit`: the record (kind ``live``) and its resume token (shown once),
        the binding, the writer, the driver (its session starts with the client's
        ``session.start``; ``announce``: ``session.started`` carries the resume data). Raises
        ``StoreUnavailable`` or ``SessionElsewhere``; the caller forfeits the slot."""
        config = {"kind": KIND, "transport": transport_kind, "pipeline": self.pipeline}
        async with self.new_record(tenant, config, session_id) as (record, token, epoch):
            writer = await self.life.new_writer(record, epoch)
        resume = {"resume_token": token} if announce else None
        driver = self._new_driver(session_id, int(record.expires_at), resume)
        s = LiveSession(
            session_id, tenant, driver, writer, self.life.new_timer(record), record, secret_digest(token)
        )
        s.transport_kind = transport_kind
        self.life.add(s)
        self.counts["opened"] += 1
        return s, token

    async def open(self, s: LiveSession, transport: Transport) -> bool:
        """Attach the first connection. False if the session is ending."""
        async with s.lock:
            if s.ending:
                return False
            s.connection = transport
            s.opened = True
            s.driver.attach(transport)
            return True

    # --- resume ------------------------------------------------------------------------------

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> LiveSession:
        """Before the upgrade: the live session, or ``SessionNotFound`` (unknown, ended, another
        tenant's, another kind's, or one whose process is gone), ``ResumeTokenInvalid``,
        ``SessionElsewhere`` (scale-out: live on another replica), ``StoreUnavailable``."""
        return await self.authorize_here(tenant, session_id, token)  # its model context is here

    async def resume(self, s: LiveSession, transport: Transport, *, kind: str | None = None) -> bool:
        """Attach a resuming connection (one still attached is closed, 4000): it gets
        ``session.started`` again, then the live stream. False if the session ended meanwhile."""
        async with s.lock:
            if not await self.life.replace_connection(s, transport, lambda _old: s.driver.detach(), 2.0):
                return False
            s.driver.attach(transport, s.driver.core.resumed())
            if kind is not None:
                s.transport_kind = kind
            self.life.reattached(s)
        return True

    # --- connections end ---------------------------------------------------------------------

    async def connection_ended(self, s: LiveSession, transport: Transport | None, code: int | None) -> None:
        """``transport`` ended (``code``: the client's close code, None: we closed it): a
        session that was closed (``session.close``, a refused start) or cleanly left (1000),
        or never started, ends; any other loss detaches it for the grace."""

        def cause() -> str | None:
            driver = s.driver
            if driver.closed.is_set():
                return "client_closed" if driver.core.phase is Phase.CLOSED else "closed"
            if code == CLEAN_CLOSE:
                return "client_closed"
            return "never_started" if driver.core.phase is Phase.AWAITING_START else None

        await self.end_or_detach(s, transport, cause)

    # --- retention (the hooks of SessionLifecycle) -------------------------------------------

    def last_activity(self, s: LiveSession) -> float:
        return s.driver.last_activity

    def closed_by_itself(self, s: LiveSession) -> str | None:
        return "closed" if s.driver.closed.is_set() and not s.connected else None

    def checkpoint(self, s: LiveSession) -> None:
        """What the model was told into the record, when it changed (once per sweep at most)."""
        core = s.driver.core
        if core.config is None or len(core.context) == s.recorded:
            return
        s.recorded = len(core.context)
        s.writer.set_config(
            {
                "kind": KIND,
                "transport": s.transport_kind,
                "pipeline": self.pipeline,
                "voice": core.config.voice,
                "delegation": core.delegation,
                "context": core.conditioning(),
            }
        )

    async def stop(self, s: LiveSession, close: tuple[int, str] | None, expiry: str | None) -> None:
        if expiry is not None:
            cause = "lifetime_expired" if "duration" in expiry else "idle_expired"
        elif close is not None and close[1] in ("session deleted", "session hangup"):
            cause = "deleted"
        else:
            cause = "connection_lost"
        code, reason = close if close is not None else (CLEAN_CLOSE, "session closed")
        await s.driver.end(cause, code, reason)

    def store_failed(self, s: LiveSession, error: StoreError) -> tuple[int, str]:
        return (EXPIRED_CLOSE, "session ended")

    # --- end ---------------------------------------------------------------------------------

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        """``GET /v1/sessions/{id}`` of a live session here (else ``SessionNotFound``)."""
        s = self.life.live_or_gone(tenant, session_id)
        self.checkpoint(s)
        head, _record = await self.life.state(s, s.transport_kind)
        return {**head, "live_here": True, "connected": s.connected, "live": s.driver.stats()}
