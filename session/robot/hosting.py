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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from session.admission import Rejected
from session.affinity import Binding
from session.host_common import SlotReleases, cancel_tasks, expiry_message, spawn, sweep_forever
from session.identity import new_session_id, resume_token_matches, secret_digest
from session.retention import RetentionTimer, Verdict
from session.robot.core import Dialect, PolicyContext
from session.robot.driver import RobotDriver, RobotTransport
from session.store import SessionRecord, SessionWriter
from session.store.errors import ResumeTokenInvalid, SessionNotFound, StaleEpoch, StoreError
from session.voice.hosting import AdmissionRefused, SessionElsewhere

if TYPE_CHECKING:
    from session.voice.hosting import SessionHost

log = logging.getLogger(__name__)

KIND = "robot"
CLEAN_CLOSE = 1000
EXPIRED_CLOSE = 1001
REPLACED = (4000, "replaced by a newer connection of the same session")

# (session id, tenant, context, dialect) → a driver for a new or rebuilt session
DriverFactory = Callable[[str, PolicyContext, Dialect], RobotDriver]

__all__ = ["KIND", "AdmissionRefused", "RobotHost", "RobotSession", "SessionElsewhere"]


@dataclass(eq=False, slots=True)
class RobotSession:
    session_id: str
    tenant: str
    driver: RobotDriver
    writer: SessionWriter
    timer: RetentionTimer
    record: SessionRecord
    token_digest: str
    connection: RobotTransport | None = None
    opened: bool = False  # its first connection was attached (see RobotHost.open)
    ending: bool = False
    persisted: tuple[int, str, bool] = (-1, "", False)  # (step, prompt, reset) last stored
    persisted_at: float = 0.0
    migrated_from: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def state(self) -> str:
        return "active" if self.connected else "detached"


class RobotHost:
    """The robot sessions of one process (see the module docstring)."""

    def __init__(
        self,
        sessions: SessionHost,
        new_driver: DriverFactory,
        *,
        pipeline: str,
        persist_s: float = 1.0,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.voice = sessions
        self.store = sessions.store
        self.admission = sessions.admission
        self.policy = sessions.policy
        self.pipeline = pipeline
        self.persist_s = persist_s
        self._new_driver = new_driver
        self._wall = wall
        self._clock = clock
        self.sessions: dict[str, RobotSession] = {}
        self.counts: Counter[str] = Counter()
        self._releases = SlotReleases(sessions.admission)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._rebuilding: dict[str, asyncio.Task[RobotSession]] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        sweep = sweep_forever(
            self._wake, lambda: self.voice.settings.sweep_s, self.sweep, log, "robot session"
        )
        self._sweeper = asyncio.create_task(sweep, name="robot-host:sweeper")

    async def close(self) -> None:
        """Shutdown: every session is parked (context stored, slot released, record kept)."""
        live = list(self.sessions.values())
        await asyncio.gather(*(self._park(rs) for rs in live), return_exceptions=True)
        await cancel_tasks(self._sweeper, *self._tasks)
        self._sweeper = None
        await self._releases.retry(self.sessions)

    # --- open --------------------------------------------------------------------------------

    async def admit(self, tenant: str) -> str:
        """A new session id holding a slot; :class:`AdmissionRefused` (429) when full."""
        session_id = new_session_id()
        decision = await self.admission.try_admit(session_id, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)
        return session_id

    async def forfeit(self, session_id: str) -> None:
        await self._releases.release(session_id)

    async def create(self, session_id: str, tenant: str, dialect: Dialect) -> tuple[RobotSession, str]:
        """After :meth:`admit`: the record (kind ``robot``) and its resume token (shown once),
        the binding, the writer, and the session's runtime request. The caller forfeits the
        slot on any error (``StoreUnavailable``, ``SessionElsewhere``)."""
        context = PolicyContext()
        record, token = await self.store.create_session(tenant, self._config(context), session_id=session_id)
        try:
            epoch = 0
            if self.voice.claim is not None:  # scale-out: bound here (epoch 1)
                bound = await self.voice.claim(session_id)
                if bound.replica_id != self.voice.replica_id:
                    raise SessionElsewhere(bound)
                epoch = bound.epoch
            rs = await self._host(record, tenant, context, dialect, epoch, secret_digest(token))
        except BaseException:
            with contextlib.suppress(StoreError):
                await self.store.delete_session(session_id)
            raise
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
        writer = SessionWriter(
            self.store, record, epoch=epoch, on_fatal=lambda exc: self._on_writer_fatal(sid, exc)
        )
        await writer.start()
        await driver.start()  # the infer loop; the policy request starts with the first observation
        timer = RetentionTimer(
            self.policy, created_at=record.created_at, now=self._wall(), expires_at=record.expires_at
        )
        rs = RobotSession(sid, tenant, driver, writer, timer, record, digest)
        rs.persisted = (context.step, context.prompt, context.previous is None)
        self.sessions[sid] = rs
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

    def live(self, tenant: str, session_id: str) -> RobotSession | None:
        rs = self.sessions.get(session_id)
        return rs if rs is not None and rs.tenant == tenant and not rs.ending else None

    async def authorize(
        self, tenant: str, session_id: str, token: str | None, dialect: Dialect
    ) -> RobotSession:
        """Before the upgrade: the session live here, or rebuilt here from its stored context
        (its process is gone, or it was parked). Raises ``SessionNotFound`` (unknown, ended,
        another tenant's, not a robot session), ``ResumeTokenInvalid``, ``SessionElsewhere``
        (live on another replica), ``AdmissionRefused``, ``StoreUnavailable``."""
        rs = self.live(tenant, session_id)
        if rs is not None:
            if not resume_token_matches(token, rs.token_digest):
                raise ResumeTokenInvalid(session_id)
            return rs
        record = await self.store.authorize_resume(tenant, session_id, token)
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
        bound = await self._take_binding(sid)
        decision = await self.admission.try_admit(sid, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)
        try:
            context = PolicyContext.from_record(record.config.get("context"))
            rs = await self._host(record, tenant, context, dialect, bound.epoch, digest)
        except BaseException:
            await self._releases.release(sid)
            raise
        rs.migrated_from = bound.previous_replica
        rs.opened = True  # opened in its past life: a failed resume leaves it detached, not ended
        rs.timer.on_disconnect(self._wall())  # detached until its connection attaches
        rs.writer.set_state("detached")
        self.counts["restored"] += 1
        return rs

    async def _take_binding(self, session_id: str) -> Binding:
        """A new binding epoch for a rebuilt session (claim when scaled out, else take over)."""
        voice = self.voice
        if voice.claim is not None:
            bound = await voice.claim(session_id)
            if bound.replica_id != voice.replica_id:
                raise SessionElsewhere(bound)
            return bound
        current = await voice.binding.get(session_id)
        moved = await voice.binding.takeover(session_id, voice.replica_id, current.epoch if current else 0)
        if not moved.won:
            raise SessionElsewhere(moved)
        return replace(moved, previous_replica=None)

    async def resume(self, rs: RobotSession, transport: RobotTransport, opening: bytes) -> bool:
        """Attach a resuming connection (an attached one is replaced, close 4000): the metadata
        frame, then observations are answered with the session's context. False if the
        session ended meanwhile or the connection is gone."""
        async with rs.lock:
            if rs.ending:
                with contextlib.suppress(Exception):
                    await transport.close(EXPIRED_CLOSE, "session ended")
                return False
            old, rs.connection = rs.connection, transport
            if old is not None:
                rs.driver.detach(old)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await old.close(*REPLACED)
            if not await rs.driver.attach(transport, opening):
                rs.connection = None
                self._detached(rs)
                return False
            rs.timer.on_reconnect(self._wall())
            rs.writer.set_state("active")
            self.counts["resumed"] += 1
        return True

    # --- connections end ---------------------------------------------------------------------

    async def connection_ended(self, rs: RobotSession, transport: RobotTransport, code: int | None) -> None:
        """``transport`` ended (``code``: the client's close code; None: we closed it): a clean
        close ends the session, anything else detaches it for the grace."""
        async with rs.lock:
            if rs.ending or (rs.opened and rs.connection is not transport):
                return  # already ending, or replaced by a resume
            rs.connection = None
            if not rs.opened:
                cause = "never_opened"  # the client left before its upgrade completed
            elif code == CLEAN_CLOSE:
                cause = "client_closed"
            else:
                self._detached(rs)
                return
        await self._end(rs, cause)

    def _detached(self, rs: RobotSession) -> None:
        rs.driver.detach()
        rs.timer.on_disconnect(self._wall())
        rs.writer.set_state("detached")
        self._persist(rs, force=True)
        self.counts["detached"] += 1
        self._wake.set()

    # --- retention ---------------------------------------------------------------------------

    def _persist(self, rs: RobotSession, *, force: bool = False) -> None:
        """The context into the record when it changed (at most every ``persist_s`` unless
        ``force``): one small write, never one per observation."""
        ctx = rs.driver.core.context
        mark = (ctx.step, ctx.prompt, ctx.previous is None)
        now = self._clock()
        if mark == rs.persisted or (not force and now - rs.persisted_at < self.persist_s):
            return
        rs.persisted, rs.persisted_at = mark, now
        rs.writer.set_config(self._config(ctx))

    async def sweep(self) -> None:
        wall, mono = self._wall(), self._clock()
        actions: list[Awaitable[None]] = []
        for rs in list(self.sessions.values()):
            if rs.ending:
                continue
            active_at = wall - (mono - rs.driver.last_activity)
            if active_at > rs.timer.last_active:
                rs.timer.on_activity(active_at)
                rs.writer.mark_activity()
            self._persist(rs)
            verdict = rs.timer.check(wall)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                message = expiry_message(self.policy, verdict)
                actions.append(
                    self._end(rs, verdict.value, close=(EXPIRED_CLOSE, "session expired"), error=message)
                )
            elif verdict is Verdict.GRACE_EXPIRED and not rs.connected:
                actions.append(self._end(rs, "grace_expired"))
        if actions:
            await asyncio.gather(*actions, return_exceptions=True)
        await self._releases.retry(self.sessions)

    # --- end ---------------------------------------------------------------------------------

    async def delete(self, tenant: str, session_id: str, *, cause: str = "deleted") -> None:
        rs = self.live(tenant, session_id)
        if rs is None:
            raise SessionNotFound(session_id)
        await self._end(rs, cause, close=(CLEAN_CLOSE, f"session {cause}"))

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        rs = self.live(tenant, session_id)
        if rs is None:
            raise SessionNotFound(session_id)
        self._persist(rs, force=True)
        with contextlib.suppress(StoreError):
            await rs.writer.flush()
        record = await self.store.get_session(tenant, session_id)
        core = rs.driver.core
        return {
            "object": "realtime.session.state",
            "id": session_id,
            "kind": KIND,
            "transport": "websocket",
            "state": rs.state,
            "created_at": int(record.created_at),
            "last_active_at": int(record.last_active),
            "expires_at": int(record.expires_at),
            "idle_expires_at": int(min(record.last_active + self.policy.idle_ttl_s, record.expires_at)),
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

    async def _end(
        self, rs: RobotSession, cause: str, *, close: tuple[int, str] | None = None, error: str | None = None
    ) -> None:
        """Out of this process and out of Redis: cancel the request, release the slot."""
        if rs.ending:
            return
        rs.ending = True
        sid = rs.session_id
        self.sessions.pop(sid, None)
        try:
            if close is not None:
                if error is not None:
                    await rs.driver.perform(rs.driver.core.error("session_expired", error)[:1])
                transport = rs.connection
                if transport is not None:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(2.0):
                            await transport.close(*close)
            rs.driver.connection_closed.set()
            await rs.driver.end()
            await rs.writer.close(flush=False)
        finally:
            await self._releases.release(sid)
        try:
            await self.store.delete_session(sid)
        except StoreError:
            log.warning("robot session %s: could not delete it from Redis", sid)
        self.counts[cause] += 1

    async def _park(self, rs: RobotSession) -> None:
        """Shutdown: context stored, request cancelled, slot released, record kept."""
        if rs.ending:
            return
        rs.ending = True
        self.sessions.pop(rs.session_id, None)
        try:
            self._persist(rs, force=True)
            rs.writer.set_state("parked")
            transport = rs.connection
            if transport is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await transport.close(1012, "server restarting; resume the session")
            rs.driver.connection_closed.set()
            await rs.driver.end()
            with contextlib.suppress(StoreError):
                await rs.writer.close(flush=True)
        finally:
            await self._releases.release(rs.session_id)
        self.counts["parked"] += 1

    def _on_writer_fatal(self, session_id: str, error: StoreError) -> None:
        rs = self.sessions.get(session_id)
        if rs is None:
            return
        if isinstance(error, StaleEpoch):
            close = (1012, "session moved to another replica")
        else:
            close = (EXPIRED_CLOSE, "session ended")
        spawn(self._tasks, self._end(rs, "fenced", close=close), f"robot-fenced:{session_id}")

    def stats(self) -> dict[str, int]:
        return {
            "live": len(self.sessions),
            "connected": sum(1 for rs in self.sessions.values() if rs.connected),
            "unreleased": len(self._releases),
            "tasks": len(self._tasks),
            "dropped": sum(rs.driver.dropped for rs in self.sessions.values()),
        }
