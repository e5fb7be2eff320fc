"""Robot sessions on the session layer: the identity, admission slots, Redis record, resume
token, retention and replica binding of voice and world sessions, for OpenPI robot links.

A :class:`RobotHost` sits beside the voice :class:`~session.voice.hosting.SessionHost` and borrows
its store, admission controller (robots, voice and world sessions share the replica's and the
tenant's slots), retention policy and binding. What it keeps of its own is the policy context
of each session (prompt, previous action chunk, inference count: :class:`PolicyContext`),
which is small (a few KB), so unlike a world a robot session can move:

* a dropped link (anything but a clean close 1000) *detaches* the session for the disconnect
  grace; the runtime request stays with its context, and a reconnect with ``session_id`` and
  the resume token continues it;
* the context goes to the session's Redis record (``config.context``) when the link drops, at
  shutdown, and at most once per ``persist_s`` while observations flow (never per observation):
  a session whose process is gone (restart, or a lost replica in scale-out) is rebuilt from
  it on its resume, on whichever replica the binding then names (KV affinity: the session is
  bound to its replica while that one lives, fenced by the binding epoch);
* past the grace, at the idle TTL or the maximum lifetime, on ``DELETE`` or after a clean
  close the session *ends*: runtime request cancelled, slot released, record deleted. At
  shutdown it is *parked*: context stored, slot released, record kept for a later resume.

The mechanics every kind shares (the live table, slots, sweeper, binding, retention, end and
park, writer fatal errors) are the composed :class:`~session.lifecycle.SessionLifecycle`; this
host is its :class:`~session.lifecycle.KindHooks` for robots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from session.identity import secret_digest
from session.kind_host import KindHost
from session.lifecycle import CLEAN_CLOSE, EXPIRED_CLOSE, HostedSession, SharedParts
from session.robot.core import Dialect, PolicyContext
from session.robot.driver import RobotDriver, RobotTransport
from session.store import SessionRecord
from session.store.errors import SessionNotFound, StoreError

log = logging.getLogger(__name__)

KIND = "robot"

# (session id, tenant, context, dialect) → a driver for a new or rebuilt session
DriverFactory = Callable[[str, PolicyContext, Dialect], RobotDriver]

__all__ = ["KIND", "RobotHost", "RobotSession"]


@dataclass(eq=False, slots=True)
class RobotSession(HostedSession[RobotDriver, RobotTransport]):
    """A robot session live in this process (its driver, writer and retention timer)."""

    persisted: tuple[int, str, bool] = (-1, "", False)  # (step, prompt, reset) last stored
    persisted_at: float = 0.0
    migrated_from: str | None = None


class RobotHost(KindHost[RobotSession]):
    """The robot sessions of one process (see the module docstring)."""

    def __init__(
        self,
        sessions: SharedParts,
        new_driver: DriverFactory,
        *,
        pipeline: str,
        persist_s: float = 1.0,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(sessions, KIND, self, expire_when_gone=False, wall=wall, clock=clock)
        self.pipeline = pipeline
        self.persist_s = persist_s
        self._new_driver = new_driver
        self._rebuilding: dict[str, asyncio.Task[RobotSession]] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Shutdown: every session is parked (context stored, slot released, record kept)."""
        live = list(self.sessions.values())
        await asyncio.gather(*(self.life.park(rs, self._persist_now) for rs in live), return_exceptions=True)
        await self.life.stop()

    # --- open --------------------------------------------------------------------------------

    async def create(self, session_id: str, tenant: str, dialect: Dialect) -> tuple[RobotSession, str]:
        """After :meth:`admit`: the record (kind ``robot``) and its resume token (shown once),
        the binding, the writer, and the session's runtime request. The caller forfeits the
        slot on any error (``StoreUnavailable``, ``SessionElsewhere``)."""
        context = PolicyContext()
        config = self._config(context)
        async with self.new_record(tenant, config, session_id) as (record, token, epoch):
            rs = await self._host(record, tenant, context, dialect, epoch, secret_digest(token))
        self.counts["opened"] += 1
        return rs, token

    async def _host(
        self,
        record: SessionRecord,
        tenant: str,
        context: PolicyContext,
        dialect: Dialect,
        epoch: int,
        digest: str,
    ) -> RobotSession:
        sid = record.session_id
        driver = self._new_driver(sid, context, dialect)
        writer = await self.life.new_writer(record, epoch)
        await driver.start()  # the infer loop; the policy request starts with the first observation
        rs = RobotSession(sid, tenant, driver, writer, self.life.new_timer(record), record, digest)
        rs.persisted = (context.step, context.prompt, context.previous is None)
        self.life.add(rs)
        return rs

    def _config(self, context: PolicyContext) -> dict[str, Any]:
        return {
            "kind": KIND,
            "transport": "websocket",
            "pipeline": self.pipeline,
            "context": context.to_record(),
        }

    async def open(self, rs: RobotSession, transport: RobotTransport, opening: bytes) -> bool:
        """Attach the first connection (the metadata frame first). False if it is gone."""
        async with rs.lock:
            rs.connection = transport
            rs.opened = True
            return await rs.driver.attach(transport, opening)

    # --- resume ------------------------------------------------------------------------------

    async def authorize(
        self, tenant: str, session_id: str, token: str | None, dialect: Dialect
    ) -> RobotSession:
        """Before the upgrade: the session live here, or rebuilt here from its stored context
        (its process is gone, or it was parked). Raises ``SessionNotFound`` (unknown, ended,
        another tenant's, not a robot session), ``ResumeTokenInvalid``, ``SessionElsewhere``
        (live on another replica), ``AdmissionRefused``, ``StoreUnavailable``."""
        rs = self.life.live_authorized(tenant, session_id, token)
        if rs is not None:
            return rs
        record = await self.life.store.authorize_resume(tenant, session_id, token)
        if record.config.get("kind") != KIND:
            raise SessionNotFound(session_id)
        task = self._rebuilding.get(session_id)
        if task is None:
            rebuild = self._rebuild(record, tenant, secret_digest(token or ""), dialect)
            task = asyncio.create_task(rebuild, name=f"robot-rebuild:{session_id}")
            self._rebuilding[session_id] = task
            task.add_done_callback(lambda _t: self._rebuilding.pop(session_id, None))
        return await asyncio.shield(task)

    async def _rebuild(
        self, record: SessionRecord, tenant: str, digest: str, dialect: Dialect
    ) -> RobotSession:
        sid = record.session_id
        bound = await self.life.take_binding(sid)
        await self.life.readmit(sid, tenant)
        try:
            context = PolicyContext.from_record(record.config.get("context"))
            rs = await self._host(record, tenant, context, dialect, bound.epoch, digest)
        except BaseException:
            await self.life.release(sid)
            raise
        rs.migrated_from = bound.previous_replica
        rs.opened = True  # opened in its past life: a failed resume leaves it detached, not ended
        rs.timer.on_disconnect(self.life.wall())  # detached until its connection attaches
        rs.writer.set_state("detached")
        self.counts["restored"] += 1
        return rs

    async def resume(self, rs: RobotSession, transport: RobotTransport, opening: bytes) -> bool:
        """Attach a resuming connection (an attached one is replaced, close 4000): the metadata
        frame, then observations are answered with the session's context. False if the
        session ended meanwhile or the connection is gone."""
        async with rs.lock:
            if not await self.life.replace_connection(rs, transport, rs.driver.detach, 2.0):
                return False
            if not await rs.driver.attach(transport, opening):
                rs.connection = None
                self.detach(rs)
                return False
            self.life.reattached(rs)
        return True

    # --- connections end ---------------------------------------------------------------------

    async def connection_ended(self, rs: RobotSession, transport: RobotTransport, code: int | None) -> None:
        """``transport`` ended (``code``: the client's close code; None: we closed it): a clean
        close ends the session, anything else detaches it for the grace."""

        def cause() -> str | None:
            if not rs.opened:
                return "never_opened"  # the client left before its upgrade completed
            return "client_closed" if code == CLEAN_CLOSE else None

        await self.end_or_detach(rs, transport, cause)

    def detach(self, rs: RobotSession) -> None:
        """As every kind detaches, with the context persisted at once."""
        rs.driver.detach()
        self._persist(rs, force=True)
        self.life.detached(rs)

    # --- retention ---------------------------------------------------------------------------

    def _persist(self, rs: RobotSession, *, force: bool = False) -> None:
        """The context into the record when it changed (at most every ``persist_s`` unless
        ``force``): one small write, never one per observation."""
        ctx = rs.driver.core.context
        mark = (ctx.step, ctx.prompt, ctx.previous is None)
        now = self.life.clock()
        if mark == rs.persisted or (not force and now - rs.persisted_at < self.persist_s):
            return
        rs.persisted, rs.persisted_at = mark, now
        rs.writer.set_config(self._config(ctx))

    def _persist_now(self, rs: RobotSession) -> None:
        self._persist(rs, force=True)

    def last_activity(self, s: RobotSession) -> float:
        return s.driver.last_activity

    def closed_by_itself(self, s: RobotSession) -> str | None:
        return None  # a robot session outlives its driver's link: it ends by retention

    def checkpoint(self, s: RobotSession) -> None:
        self._persist(s)

    async def stop(self, s: RobotSession, close: tuple[int, str] | None, expiry: str | None) -> None:
        if close is not None:
            if expiry is not None:
                await s.driver.perform(s.driver.core.error("session_expired", expiry)[:1])
            transport = s.connection
            if transport is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await transport.close(*close)
        s.driver.connection_closed.set()
        await s.driver.end()

    def store_failed(self, s: RobotSession, error: StoreError) -> tuple[int, str]:
        return (EXPIRED_CLOSE, "session ended")

    # --- end ---------------------------------------------------------------------------------

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        rs = self.life.live_or_gone(tenant, session_id)
        self._persist(rs, force=True)
        head, _record = await self.life.state(rs, "websocket")
        core = rs.driver.core
        return {
            **head,
            "live_here": True,
            "connected": rs.connected,
            "robot": {
                "pipeline": self.pipeline,
                "dialect": core.dialect.value,
                "prompt": core.context.prompt,
                "inferences": core.context.step,
                "observations": core.stats.observations,
                "answered": core.stats.answered,
                "dropped": rs.driver.dropped,
                "errors": core.stats.errors,
            },
        }

    def stats(self) -> dict[str, int]:
        """Live counters (back to zero once every session is gone)."""
        dropped = sum(rs.driver.dropped for rs in self.sessions.values())
        return {**self.life.stats(), "dropped": dropped}
