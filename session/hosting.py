"""The realtime sessions of one process: open, serve, detach, resume, restore, retention, end.

A :class:`HostedSession` is a session live in this process: its driver (core, responses,
timers), its :class:`~session.store.SessionWriter` (event log and durable state in Redis) and
its :class:`~session.retention.RetentionTimer`. Connections come and go:

* **open**: admission (web layer: `admission.try_admit` / `acquire`), then :meth:`create`
  (Redis record + resume token) and :meth:`serve_new`: `session.created`, then
  `omni.session.resumable {session_id, resume_token, expires_at}`, then live;
* **connection lost** (no close frame, or any close code but 1000): the session is *detached*
  and runs on (a response in flight keeps streaming into the log) for the disconnect grace;
  past it, an in-flight response is cancelled and the session is *parked*: it leaves the
  process and its admission slot, and stays resumable from Redis until its idle TTL. A client
  close with code 1000 parks at once;
* **resume** (:meth:`serve_resume`): the new connection is attached *held*, the writer is
  flushed, the events after `last_event_id` are read from the log and sent behind
  `omni.session.resumed {session_id, replay_count}`, then what was queued meanwhile minus what
  the replay already had, then live. If the id is no longer replayable (trimmed, unknown,
  gap) the client gets `omni.session.snapshot {session, items}` instead;
* **restore** (:meth:`restore`): a resume of a session this process does not hold (parked,
  or its process died) rebuilds the core from Redis (config + items with transcripts) under a
  new binding epoch, so ids the dead process issued but never made durable cannot collide;
* **end**: idle TTL or maximum lifetime (`session_expired`, close 1001), `DELETE`, a fenced
  writer: the session leaves the process and, when over for good, Redis.

Admission slots are released on every path (park, end, shutdown); a release that fails while
Redis is down is retried by the sweeper. One sweeper task per host checks every live session
(no task per session); nothing here touches the per-event path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from session.admission import AdmissionController, Rejected
from session.affinity import Binding, SessionBinding
from session.driver import RealtimeDriver, SessionLog
from session.identity import resume_token_matches, secret_digest
from session.link import LinkEnd, Transport, TransportLink
from session.realtime.config import SessionConfig
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.records import config_from_record, config_record
from session.resume import connection_event, event_seq, logged_event_id, replayed_through
from session.retention import RetentionPolicy, RetentionTimer, Verdict
from session.store import SessionRecord, SessionStore, SessionWriter
from session.store.aio import cancel_and_wait, wait_event
from session.store.errors import (
    ReplayUnavailable,
    ResumeTokenInvalid,
    SessionGone,
    SessionNotFound,
    StaleEpoch,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

CoreOptionsFactory = Callable[[SessionConfig, str], CoreOptions]
DriverFactory = Callable[[RealtimeSessionCore, SessionLog], RealtimeDriver]
Claim = Callable[[str], Awaitable[Binding]]

CLEAN_CLOSE = 1000
RESTART_CLOSE = (1012, "server restarting; resume the session")


class AdmissionRefused(Exception):
    """A resume that needs a slot here found none (HTTP 429 with Retry-After)."""

    def __init__(self, decision: Rejected) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class SessionElsewhere(Exception):
    """The session is live on another replica (scale-out: route the resume there)."""

    def __init__(self, binding: Binding) -> None:
        super().__init__(f"session is bound to replica {binding.replica_id}")
        self.binding = binding


@dataclass(frozen=True, slots=True)
class HostSettings:
    policy: RetentionPolicy = field(default_factory=RetentionPolicy)
    queue_deadline_s: float = 10.0  # how long an open may wait for a slot
    drain_timeout_s: float = 5.0  # shutdown: how long in-flight responses may finish
    sweep_interval_s: float | None = None  # None: a tenth of the shortest retention period

    @property
    def sweep_s(self) -> float:
        if self.sweep_interval_s is not None:
            return self.sweep_interval_s
        p = self.policy
        shortest = min(p.idle_ttl_s, p.max_lifetime_s, p.disconnect_grace_s or p.idle_ttl_s)
        return min(1.0, max(0.05, shortest / 10))


@dataclass(eq=False, slots=True)
class HostedSession:
    session_id: str
    tenant: str
    driver: RealtimeDriver
    writer: SessionWriter
    timer: RetentionTimer
    record: SessionRecord
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ending: bool = False
    parked_for: str | None = None
    token_digest: str | None = None  # of the resume token, once known here (create, authorize)
    orphans: tuple[bool, str | None] = (False, None)  # restored: (end them?, lost replica)
    migrated_from: str | None = None  # scale-out failover: the lost owner, told at the next resume

    @property
    def connected(self) -> bool:
        return self.driver.link is not None

    @property
    def state(self) -> str:
        return "active" if self.connected else "detached"


class SessionHost:
    def __init__(
        self,
        store: SessionStore,
        admission: AdmissionController,
        *,
        binding: SessionBinding,
        core_options: CoreOptionsFactory,
        new_driver: DriverFactory,
        settings: HostSettings | None = None,
        registry: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.admission = admission
        self.binding = binding
        self.settings = settings or HostSettings()
        self.policy = store.policy
        self._core_options = core_options
        self._new_driver = new_driver
        self._clock = clock
        self._wall = wall
        self.sessions: dict[str, HostedSession] = {}
        self._drivers = registry if registry is not None else {}  # id → driver, for metrics
        self._restoring: dict[str, asyncio.Task[HostedSession]] = {}
        self._ending: dict[str, asyncio.Event] = {}
        self._unreleased: set[str] = set()  # admission releases to retry (Redis was down)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        # Scale-out: claim(session_id) binds a restored session to this replica or names its
        # live owner (web/replica.py); standalone, a restore always takes the binding over.
        self.claim: Claim | None = None
        self.counts: Counter[str] = Counter()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def replica_id(self) -> str:
        return self.admission.replica_id

    def join_replica(self, replica_id: str, claim: Claim) -> None:
        """Scale-out (before serving): admit under the deployment's replica id and bind
        restored sessions through `claim` (registry-aware) instead of taking them over."""
        if self.sessions:
            raise RuntimeError("join_replica() must come before the first session")
        self.admission.replica_id = replica_id
        self.claim = claim

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        with contextlib.suppress(StoreUnavailable):  # Redis down at start: load them lazily
            await self.store.load_scripts()
            await self.admission.load_scripts()
        await self.admission.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="session-host:sweeper")

    async def close(self) -> None:
        """Shutdown: admit nobody, let in-flight responses finish (bounded), then park every
        session (close 1012: resume after the restart) and give every slot back."""
        self.admission.draining = True
        live = list(self.sessions.values())
        if live:
            timeout = self.settings.drain_timeout_s
            await asyncio.gather(*(hs.driver.wait_responses(timeout) for hs in live))
            await asyncio.gather(
                *(self._end(hs, "shutdown", delete=False, close=RESTART_CLOSE) for hs in live),
                return_exceptions=True,
            )
        await cancel_and_wait(self._sweeper)
        self._sweeper = None
        for task in list(self._tasks):
            await cancel_and_wait(task)
        await self._retry_releases()
        await self.admission.close()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- open --------------------------------------------------------------------------------

    async def create(self, session_id: str, tenant: str, config: SessionConfig) -> tuple[HostedSession, str]:
        """A new session (admission already granted): its Redis record, writer and driver.
        Returns it with its resume token (shown once). Raises `StoreUnavailable`."""
        core = RealtimeSessionCore(self._options(config, session_id))
        stored = config_record(
            config, session_id=session_id, expires_at=0, conversation_id=core.conversation_id
        )
        record, token = await self.store.create_session(tenant, stored, session_id=session_id)
        epoch = 0
        if self.claim is not None:  # scale-out: bind it here (epoch 1), so a takeover fences us
            bound = await self.claim(session_id)
            if bound.replica_id != self.replica_id:
                raise SessionElsewhere(bound)
            epoch = bound.epoch
        hs = await self._host(record, core, epoch=epoch)
        hs.token_digest = secret_digest(token)
        self.counts["opened"] += 1
        return hs, token

    async def forfeit(self, session_id: str) -> None:
        """Give back a slot (or queue place) taken for a session that did not open."""
        await self._release(session_id)

    async def serve_new(self, hs: HostedSession, transport: Transport, resume_token: str) -> LinkEnd:
        """Serve a just-created session on its first connection until that connection ends."""
        async with hs.lock:
            link = hs.driver.attach(transport)
            hs.driver.start(epoch=hs.record.created_at)
            link.push(
                connection_event(
                    "omni.session.resumable",
                    hs.driver.last_event_id,
                    session_id=hs.session_id,
                    resume_token=resume_token,
                    expires_at=int(hs.record.expires_at),
                )
            )
        return await self._watch(hs, link)

    # --- resume ------------------------------------------------------------------------------

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> None:
        """Before the upgrade: `SessionNotFound` (unknown, expired, another tenant's) or
        `ResumeTokenInvalid`; nothing else is revealed. A session held here checks the token
        against the digest it keeps (constant time, no round trip)."""
        hs = self.live(tenant, session_id)
        if hs is not None and hs.token_digest is not None:
            if not resume_token_matches(token, hs.token_digest):
                raise ResumeTokenInvalid(session_id)
            return
        await self.store.authorize_resume(tenant, session_id, token)
        if hs is not None and token:
            hs.token_digest = secret_digest(token)

    def live(self, tenant: str, session_id: str) -> HostedSession | None:
        hs = self.sessions.get(session_id)
        return hs if hs is not None and hs.tenant == tenant and not hs.ending else None

    async def restore(self, tenant: str, session_id: str, token: str | None = None) -> HostedSession:
        """The live session, or one rebuilt from Redis (taking an admission slot: raises
        `AdmissionRefused`; `SessionNotFound`, `SessionElsewhere`, `StoreUnavailable`).
        Concurrent restores of one session share one rebuild, which completes even if the
        caller goes away (the session then waits detached for a connection)."""
        hs = self.live(tenant, session_id)
        if hs is not None:
            return hs
        flight = self._restoring.get(session_id)
        if flight is None:
            flight = asyncio.create_task(self._restore_once(tenant, session_id), name=f"restore:{session_id}")
            self._restoring[session_id] = flight
            flight.add_done_callback(lambda t: self._restore_done(session_id, t))
        hs = await asyncio.shield(flight)
        if hs.tenant != tenant:  # authorize() checked the tenant; this is belt and braces
            raise SessionNotFound(session_id)
        if token and hs.token_digest is None:  # `token` was authorized: later resumes check here
            hs.token_digest = secret_digest(token)
        return hs

    def _restore_done(self, session_id: str, task: asyncio.Task[HostedSession]) -> None:
        self._restoring.pop(session_id, None)
        if not task.cancelled():
            task.exception()  # retrieved here: a caller that went away cannot

    async def _restore_once(self, tenant: str, session_id: str) -> HostedSession:
        ending = self._ending.get(session_id)
        if ending is not None:  # parked or ending right now: let its writer finish first
            await ending.wait()
        hs = self.live(tenant, session_id)
        if hs is not None:
            return hs
        decision = await self.admission.try_admit(session_id, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)
        try:
            return await self._rebuild(tenant, session_id)
        except BaseException:
            await self._release(session_id)
            raise

    async def _rebuild(self, tenant: str, session_id: str) -> HostedSession:
        snapshot = await self.store.load_snapshot(tenant, session_id)
        bound = await self._take_binding(session_id)
        record = snapshot.record
        config = config_from_record(record.config, default_model=self._default_model(session_id))
        now = self._clock()
        core = RealtimeSessionCore.restore(
            self._options(config, session_id),
            snapshot.items,
            conversation_id=record.config.get("conversation_id"),
            now=now,
            epoch=self._wall(),
            expires_at=record.expires_at,
        )
        hs = await self._host(record, core, epoch=bound.epoch)
        hs.migrated_from = bound.previous_replica  # set when it moved here from a lost replica
        hs.driver.start()
        # The dead process's in-flight response is ended once a connection is attached, after
        # its replay or snapshot, so the client sees it end live (see serve_resume).
        hs.orphans = (True, bound.previous_replica)
        hs.timer.on_disconnect(self._wall())  # detached until a connection attaches
        hs.writer.set_state("detached")
        self.counts["restored"] += 1
        return hs

    async def _take_binding(self, session_id: str) -> Binding:
        """The binding (epoch) this process writes the session with from now on (always a new
        one, except a session parked by this very replica); `previous_replica` when it moved."""
        if self.claim is not None:
            bound = await self.claim(session_id)
            if bound.replica_id != self.replica_id:
                raise SessionElsewhere(bound)
            return bound
        current = await self.binding.get(session_id)
        moved = await self.binding.takeover(session_id, self.replica_id, current.epoch if current else 0)
        if not moved.won:
            raise SessionElsewhere(moved)
        return replace(moved, previous_replica=None)

    async def serve_resume(
        self, hs: HostedSession, transport: Transport, last_event_id: str | None
    ) -> LinkEnd:
        """Attach a resuming connection: replay what it missed, then serve it live."""
        async with hs.lock:
            if hs.ending:
                with contextlib.suppress(Exception):
                    await transport.close(1013, "the session is moving; resume again")
                return LinkEnd.CLOSED
            link = hs.driver.attach(transport, held=True)
            hs.timer.on_reconnect(self._wall())
            try:
                await self._replay(hs, link, last_event_id)
                hs.writer.set_state("active")  # after the replay: not a round trip on its path
                pending, lost = hs.orphans
                if pending:
                    hs.orphans = (False, None)
                    core = hs.driver.core
                    hs.driver.apply(core.close_orphaned_responses(self._clock(), lost_replica=lost))
            except StoreError as exc:
                log.warning("session %s: resume failed: %s", hs.session_id, exc)
                link.finish(LinkEnd.CLOSED, 1013, "session store unavailable; resume again")
            self.counts["resumed"] += 1
        return await self._watch(hs, link)

    async def _replay(self, hs: HostedSession, link: TransportLink, last_event_id: str | None) -> None:
        after = logged_event_id(last_event_id)
        await hs.writer.flush()  # what this process holds unflushed becomes replayable
        try:
            events = await self.store.events_after(hs.session_id, after)
        except ReplayUnavailable as exc:
            core = hs.driver.core
            resumed = connection_event(
                "omni.session.resumed",
                last_event_id,
                session_id=hs.session_id,
                replay_count=0,
                replay_unavailable=exc.reason,
            )
            snapshot = connection_event(
                "omni.session.snapshot",
                hs.driver.last_event_id,
                session=core.session_object(),
                items=[item.to_wire() for item in core.conversation.items],
            )
            notice = self._migration_notice(hs, hs.driver.last_event_id)
            link.release([resumed, snapshot, *notice], drop_queued=True)  # the snapshot supersedes them
            self.counts["resynced"] += 1
            return
        through = event_seq(events[-1]["event_id"]) if events else event_seq(after)
        resumed = connection_event(
            "omni.session.resumed", last_event_id, session_id=hs.session_id, replay_count=len(events)
        )
        last = events[-1]["event_id"] if events else last_event_id
        link.release([resumed, *events, *self._migration_notice(hs, last)], skip=replayed_through(through))

    def _migration_notice(self, hs: HostedSession, after: str | None) -> list[dict[str, Any]]:
        """Scale-out failover: `omni.session.migrated` once, after the first resume's replay."""
        lost, hs.migrated_from = hs.migrated_from, None
        if lost is None:
            return []
        event = connection_event(
            "omni.session.migrated",
            after,
            session_id=hs.session_id,
            from_replica=lost,
            to_replica=self.replica_id,
        )
        return [event]

    # --- connections end ---------------------------------------------------------------------

    async def _watch(self, hs: HostedSession, link: TransportLink) -> LinkEnd:
        """Wait for the connection to end, then detach, park or end the session."""
        end = await link.wait()
        async with hs.lock:
            superseded = hs.driver.link is not None and hs.driver.link is not link
            hs.driver.detach(link)
            if hs.ending or superseded or end is LinkEnd.REPLACED:
                return end
            if hs.driver.closed.is_set():
                action: tuple[str, bool] | None = ("expired", True)
            elif getattr(link.transport, "disconnect_code", None) == CLEAN_CLOSE:
                hs.driver.apply(hs.driver.core.cancel_response(self._clock()))
                action = ("client_closed", False)
            else:
                action = None
                hs.timer.on_disconnect(self._wall())
                hs.writer.set_state("detached")
                self.counts["detached"] += 1
                self._wake.set()
        if action is not None:
            await self._end(hs, action[0], delete=action[1])
        return end

    # --- retention ---------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await wait_event(self._wake, self.settings.sweep_s)
            self._wake.clear()
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("session sweep failed")

    async def sweep(self) -> None:
        """One pass of retention over the live sessions (and retries of failed releases)."""
        wall, mono = self._wall(), self._clock()
        actions: list[Awaitable[None]] = []
        for hs in list(self.sessions.values()):
            if hs.ending:
                continue
            if hs.driver.closed.is_set():
                actions.append(self._end(hs, "expired", delete=True))
                continue
            hs.timer.on_activity(wall - (mono - hs.driver.last_activity))
            verdict = hs.timer.check(wall)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                actions.append(self._expire(hs, verdict))
            elif verdict is Verdict.GRACE_EXPIRED:
                actions.append(self._grace_over(hs))
        if actions:
            await asyncio.gather(*actions, return_exceptions=True)
        await self._retry_releases()

    async def _expire(self, hs: HostedSession, verdict: Verdict) -> None:
        async with hs.lock:
            if hs.ending:
                return
            if verdict is Verdict.LIFETIME_EXPIRED:
                minutes = round(self.policy.max_lifetime_s / 60)
                message = f"Your session hit the maximum duration of {minutes} minutes."
            else:
                message = f"Your session was idle for {round(self.policy.idle_ttl_s)} seconds."
            hs.driver.apply(hs.driver.core.expire(self._clock(), message))
        await self._end(hs, verdict.value, delete=True)

    async def _grace_over(self, hs: HostedSession) -> None:
        async with hs.lock:
            if hs.ending or hs.connected or hs.timer.check(self._wall()) is not Verdict.GRACE_EXPIRED:
                return
            hs.driver.apply(hs.driver.core.cancel_response(self._clock()))
        await self._end(hs, "grace_expired", delete=False)

    # --- end ---------------------------------------------------------------------------------

    async def delete(self, tenant: str, session_id: str) -> None:
        """`DELETE /v1/sessions/{id}`: end the session everywhere (`SessionNotFound`)."""
        hs = self.live(tenant, session_id)
        if hs is not None:
            await self._end(hs, "deleted", delete=True, close=(CLEAN_CLOSE, "session deleted"))
            return
        await self.store.get_session(tenant, session_id)
        await self.store.delete_session(session_id)
        self.counts["deleted"] += 1

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        """`GET /v1/sessions/{id}`: the session's state (`SessionNotFound` for others')."""
        hs = self.live(tenant, session_id)
        if hs is not None:
            with contextlib.suppress(StoreError):
                await hs.writer.flush()
        record = await self.store.get_session(tenant, session_id)
        body: dict[str, Any] = {
            "object": "realtime.session.state",
            "id": session_id,
            "state": hs.state if hs is not None else record.state,
            "created_at": int(record.created_at),
            "last_active_at": int(record.last_active),
            "expires_at": int(record.expires_at),
            "idle_expires_at": int(min(record.last_active + self.policy.idle_ttl_s, record.expires_at)),
            "event_count": record.event_seq,
            "live_here": hs is not None,
            "connected": hs is not None and hs.connected,
            "active_response_id": hs.driver.core.active_response_id if hs is not None else None,
        }
        if hs is not None:  # this process's event log writer (Redis round trips, buffering)
            w = hs.writer
            body["log"] = {
                "round_trips": w.round_trips,
                "flushes": w.flushes,
                "pending": w.pending,
                "dropped_events": w.dropped_events,
            }
        return body

    async def _end(
        self, hs: HostedSession, cause: str, *, delete: bool, close: tuple[int, str] | None = None
    ) -> None:
        """Take the session out of this process (and out of Redis when `delete`)."""
        if hs.ending:
            return
        hs.ending = True
        hs.parked_for = cause
        sid = hs.session_id
        done = self._ending[sid] = asyncio.Event()
        self.sessions.pop(sid, None)
        self._drivers.pop(sid, None)
        try:
            if close is not None and not hs.driver.closed.is_set():
                hs.driver.request_close(*close)
            await hs.driver.shutdown()
            if delete:
                await hs.writer.close(flush=False)
                try:
                    await self.store.delete_session(sid)
                except StoreError:  # its keys expire by their TTL
                    log.warning("session %s: could not delete it from Redis", sid)
            else:
                hs.writer.set_state("parked")
                await hs.writer.close()
            await self._release(sid)
        finally:
            self._ending.pop(sid, None)
            done.set()
        self.counts[cause] += 1

    def _on_writer_fatal(self, session_id: str, error: StoreError) -> None:
        hs = self.sessions.get(session_id)
        if hs is None:
            return
        if isinstance(error, StaleEpoch):
            close = (1012, "session moved to another replica")
        elif isinstance(error, SessionGone):
            close = (1001, "session ended")
        else:
            close = (1011, "session store error")
        self._spawn(self._end(hs, "fenced", delete=False, close=close), f"fenced:{session_id}")

    async def recheck_bindings(self) -> int:
        """Scale-out: this replica's lease lapsed (it was stopped or cut off from Redis) and
        came back. Sessions may have moved meanwhile; flush every live one now, so a moved one
        hits its stale epoch at once instead of at its next write, and ends here (1012).
        Returns how many ended."""
        fenced = 0
        for hs in list(self.sessions.values()):
            if hs.ending:
                continue
            hs.writer.mark_activity()  # a flush even with nothing queued (a fenced TTL refresh)
            try:
                await hs.writer.flush()
            except (StaleEpoch, SessionGone) as exc:
                self._on_writer_fatal(hs.session_id, exc)
                fenced += 1
            except StoreError:
                pass  # Redis still unreachable: the writer's own retries get there
        return fenced

    async def _release(self, session_id: str) -> None:
        try:
            await self.admission.release(session_id)
            self._unreleased.discard(session_id)
        except StoreError:
            self._unreleased.add(session_id)

    async def _retry_releases(self) -> None:
        for sid in list(self._unreleased):
            if sid not in self.sessions:
                await self._release(sid)

    # --- construction ------------------------------------------------------------------------

    def _options(self, config: SessionConfig, session_id: str) -> CoreOptions:
        # The core's own expiry is the store's maximum lifetime, so both end it together.
        options = self._core_options(config, session_id)
        return replace(
            options, config=config, session_id=session_id, max_duration_s=self.policy.max_lifetime_s
        )

    def _default_model(self, session_id: str) -> str:
        return self._core_options(SessionConfig(), session_id).config.model

    async def _host(self, record: SessionRecord, core: RealtimeSessionCore, *, epoch: int) -> HostedSession:
        sid = record.session_id
        writer = SessionWriter(
            self.store, record, epoch=epoch, on_fatal=lambda exc: self._on_writer_fatal(sid, exc)
        )
        await writer.start()
        driver = self._new_driver(core, writer)
        driver.on_close = self._wake.set
        timer = RetentionTimer(
            self.policy, created_at=record.created_at, now=self._wall(), expires_at=record.expires_at
        )
        hs = HostedSession(sid, record.tenant, driver, writer, timer, record)
        self.sessions[sid] = hs
        self._drivers[sid] = driver
        return hs

    # --- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Live counters (all back to zero once every session is gone)."""
        return {
            "live": len(self.sessions),
            "connected": sum(1 for hs in self.sessions.values() if hs.connected),
            "drivers": len(self._drivers),
            "restoring": len(self._restoring),
            "ending": len(self._ending),
            "unreleased": len(self._unreleased),
            "tasks": len(self._tasks),
        }
