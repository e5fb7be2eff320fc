"""The lifecycle every kind of hosted session shares, as one component each host composes.

The voice host (:mod:`session.voice.hosting`), the world host (:mod:`session.world.hosting`)
and the robot host (:mod:`session.robot.hosting`) hold different sessions (a realtime core
with its event log; a runtime request with a rolling context; a policy request with a small,
movable context) but the same mechanics around them: the table of sessions live in this
process, counters, admission slots (released, and retried by the sweeper when Redis was down),
the one sweeper task, the binding of a new or rebuilt session to this replica, retention
(driver activity -> timer, verdict -> end with the expiry message, or end or park past the
disconnect grace), detach/reattach bookkeeping, ending (driver stopped, writer closed, slot
released, record deleted) and parking (the same, but the record kept, state ``parked``, for a
later rebuild), and what a fatal writer error does. :class:`SessionLifecycle` owns all of that
once. What differs per kind comes in through two small pieces, neither a base class: its
:class:`KindSpec` (constants: does a session past its grace park or end, do sweeps refresh
its record's TTLs) and :class:`KindHooks`, a typed protocol the host implements: when the
driver was last active, what to checkpoint into the record, whether the driver closed by
itself, how to stop it (with an expiry message or a close frame), and how a session whose
writer failed for good is closed.

The store, admission controller, retention policy and replica binding are the process's one
set, held by the voice host and reached through :class:`SharedParts`, a protocol: this module
imports nothing of :mod:`session.voice` (which depends on it).

The per-kind session record is a :class:`HostedSession` (its driver, writer, retention timer,
attached connection and lock) that a kind extends with the few fields of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from session.admission import AdmissionController, Rejected
from session.affinity import Binding, SessionBinding
from session.host_common import SlotReleases, cancel_tasks, expiry_message, spawn, sweep_forever
from session.identity import new_session_id, resume_token_matches
from session.retention import EXPIRY_SLACK_S, RetentionPolicy, RetentionTimer, Verdict
from session.store import SessionRecord, SessionStore, SessionWriter
from session.store.errors import (
    ResumeTokenInvalid,
    SessionGone,
    SessionNotFound,
    StaleEpoch,
    StoreError,
)

log = logging.getLogger(__name__)

CLEAN_CLOSE = 1000
EXPIRED_CLOSE = 1001
MOVED_CLOSE = (1012, "session moved to another replica")
REPLACED = (4000, "replaced by a newer connection of the same session")
RESTART_CLOSE = (1012, "server restarting; resume the session")

DriverT = TypeVar("DriverT")
TransportT = TypeVar("TransportT")

__all__ = [
    "CLEAN_CLOSE",
    "EXPIRED_CLOSE",
    "REPLACED",
    "RESTART_CLOSE",
    "AdmissionRefused",
    "Claim",
    "HostedSession",
    "KindHooks",
    "KindSpec",
    "SessionElsewhere",
    "SessionLifecycle",
    "SharedParts",
]

Claim = Callable[[str], Awaitable[Binding]]  # scale-out: bind a session here, or name its owner


class AdmissionRefused(Exception):
    """A session that needs a slot here found none (HTTP 429 with Retry-After)."""

    def __init__(self, decision: Rejected) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class SessionElsewhere(Exception):
    """The session is live on another replica (scale-out: route the resume there)."""

    def __init__(self, binding: Binding) -> None:
        super().__init__(f"session is bound to replica {binding.replica_id}")
        self.binding = binding


class Sweeps(Protocol):
    """The sweep period of the process's host settings."""

    @property
    def sweep_s(self) -> float:
        """Seconds between two sweeps (a woken sweeper runs sooner)."""
        ...


class SharedParts(Protocol):
    """What every kind's lifecycle shares with the others, held by the process's voice
    :class:`~session.voice.hosting.SessionHost`: one store, one admission controller (one set
    of slots for all kinds), one retention policy and sweep period, one replica binding (and
    ``claim`` when scaled out) with the one place that binds new and rebuilt sessions."""

    store: SessionStore
    admission: AdmissionController
    binding: SessionBinding
    policy: RetentionPolicy

    @property
    def claim(self) -> Claim | None: ...

    @property
    def replica_id(self) -> str: ...

    @property
    def settings(self) -> Sweeps: ...

    async def bind_new(self, session_id: str) -> int:
        """The binding epoch of a new session (scaled out: bound here, epoch 1; else 0)."""
        ...

    async def take_binding(self, session_id: str) -> Binding:
        """A new binding epoch for a rebuilt session (claim when scaled out, else take over)."""
        ...


@dataclass(eq=False, slots=True)
class HostedSession(Generic[DriverT, TransportT]):
    """A session live in this process: its driver, writer, retention timer and connection."""

    session_id: str
    tenant: str
    driver: DriverT
    writer: SessionWriter
    timer: RetentionTimer
    record: SessionRecord
    token_digest: str | None  # of the resume token (voice: once known here)
    connection: TransportT | None = None  # the attached connection; None: detached
    opened: bool = False  # its first connection was attached (see the host's open)
    ending: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def state(self) -> str:
        return "active" if self.connected else "detached"


S = TypeVar("S", bound=HostedSession[Any, Any])
S_contra = TypeVar("S_contra", bound=HostedSession[Any, Any], contravariant=True)


@dataclass(frozen=True, slots=True)
class KindSpec:
    """The constants of a kind: its name (the record's ``config.kind``, task names, logs);
    ``expire_when_gone``: a session whose keys vanished (``SessionGone``) past its lifetime or
    idle TTL ends as expired; ``parks``: a session past its disconnect grace, or fenced by a
    store error, is parked (record kept for a rebuild) rather than ended and deleted;
    ``touch_on_activity``: driver activity a sweep sees refreshes the record's TTLs (drivers
    that write nothing per input; a voice driver marks its event log itself)."""

    name: str
    expire_when_gone: bool
    parks: bool = False
    touch_on_activity: bool = True


class KindHooks(Protocol[S_contra]):
    """What a kind tells :class:`SessionLifecycle` about its sessions."""

    def last_activity(self, s: S_contra) -> float:
        """The monotonic time the session's driver was last active."""
        ...

    def checkpoint(self, s: S_contra) -> None:
        """At each sweep: what changed of the session into its record (rate-limited by the kind)."""
        ...

    def closed_by_itself(self, s: S_contra) -> str | None:
        """The cause a sweep ends the session with because its driver closed by itself (None:
        it did not, or the kind waits until nothing is attached)."""
        ...

    async def stop(self, s: S_contra, close: tuple[int, str] | None, expiry: str | None) -> None:
        """Stop the driver: tell the client ``expiry`` (if any), close its connection with
        ``close`` (None: the driver closes as it will), cancel the runtime request."""
        ...

    def store_failed(self, s: S_contra, error: StoreError) -> tuple[int, str]:
        """The close of a session whose writer failed for good with ``error`` (neither fenced
        by a newer binding epoch nor gone past its TTL); the kind may tell the client first."""
        ...


class SessionLifecycle(Generic[S]):
    """The sessions of one kind live in this process and their lifecycle (module docstring)."""

    def __init__(
        self,
        shared: SharedParts,
        spec: KindSpec,
        hooks: KindHooks[S],
        *,
        wall: Callable[[], float],
        clock: Callable[[], float],
        drivers: dict[str, Any] | None = None,
    ) -> None:
        self.shared = shared  # store, admission, binding, claim, policy: one set for all kinds
        self.store = shared.store
        self.admission = shared.admission
        self.policy = shared.policy
        self.spec = spec
        self.hooks = hooks
        self.wall = wall
        self.clock = clock
        self.sessions: dict[str, S] = {}
        self.counts: Counter[str] = Counter()
        self.drivers = drivers  # id -> driver of each live session, kept in step (for metrics)
        self.leaving: dict[str, asyncio.Event] = {}  # ends and parks in flight, set once done
        self.releases = SlotReleases(shared.admission)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    # --- the host's lifetime -----------------------------------------------------------------

    def start(self) -> None:
        sweeper = sweep_forever(
            self.wake, lambda: self.shared.settings.sweep_s, self.sweep, log, f"{self.spec.name} session"
        )
        self._sweeper = asyncio.create_task(sweeper, name=f"{self.spec.name}-host:sweeper")

    async def stop(self) -> None:
        """After the sessions ended or parked: the sweeper and tasks stop, slots go back."""
        await cancel_tasks(self._sweeper, *self.tasks)
        self._sweeper = None
        await self.releases.retry(self.sessions)

    # --- admission and binding ---------------------------------------------------------------

    async def admit(self, tenant: str) -> str:
        """A new session id holding a slot (no queue: a full replica or tenant refuses at once).
        Raises :class:`AdmissionRefused` (429) or ``StoreUnavailable`` (503)."""
        session_id = new_session_id()
        decision = await self.admission.try_admit(session_id, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)
        return session_id

    async def readmit(self, session_id: str, tenant: str) -> None:
        """A slot for a session rebuilt here; :class:`AdmissionRefused` when full."""
        decision = await self.admission.try_admit(session_id, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)

    async def release(self, session_id: str) -> None:
        """Give back the slot (a failed release is retried by the sweeper)."""
        await self.releases.release(session_id)

    async def bind_new(self, session_id: str) -> int:
        """The binding epoch of a new session (see :meth:`SharedParts.bind_new`)."""
        return await self.shared.bind_new(session_id)

    async def take_binding(self, session_id: str) -> Binding:
        """A new binding epoch for a rebuilt session (claim when scaled out, else take over)."""
        return await self.shared.take_binding(session_id)

    async def new_writer(self, record: SessionRecord, epoch: int) -> SessionWriter:
        """The record's writer, started; a fatal error of it ends (or fences) the session."""
        sid = record.session_id
        writer = SessionWriter(
            self.store, record, epoch=epoch, on_fatal=lambda exc: self.writer_failed(sid, exc)
        )
        await writer.start()
        return writer

    def new_timer(self, record: SessionRecord) -> RetentionTimer:
        return RetentionTimer(
            self.policy, created_at=record.created_at, now=self.wall(), expires_at=record.expires_at
        )

    async def delete_record(self, session_id: str) -> None:
        """The session out of Redis; if Redis is down its keys expire by their TTL."""
        try:
            await self.store.delete_session(session_id)
        except StoreError:
            log.warning("%s session %s: could not delete it from Redis", self.spec.name, session_id)

    # --- the table ---------------------------------------------------------------------------

    def add(self, s: S) -> None:
        self.sessions[s.session_id] = s
        if self.drivers is not None:
            self.drivers[s.session_id] = s.driver

    def live(self, tenant: str, session_id: str) -> S | None:
        s = self.sessions.get(session_id)
        return s if s is not None and s.tenant == tenant and not s.ending else None

    def live_or_gone(self, tenant: str, session_id: str) -> S:
        """The session live here, else ``SessionNotFound`` (``/v1/sessions/{id}``: 404)."""
        s = self.live(tenant, session_id)
        if s is None:
            raise SessionNotFound(session_id)
        return s

    def live_authorized(self, tenant: str, session_id: str, token: str | None) -> S | None:
        """The session live here if ``token`` is its resume token (else ``ResumeTokenInvalid``);
        None when it is not live here."""
        s = self.live(tenant, session_id)
        if s is not None and not resume_token_matches(token, s.token_digest):
            raise ResumeTokenInvalid(session_id)
        return s

    async def delete(self, tenant: str, session_id: str, cause: str) -> None:
        """``DELETE /v1/sessions/{id}`` (or a hangup) of a session live here, attached or not."""
        s = self.live_or_gone(tenant, session_id)
        await self.end(s, cause, close=(CLEAN_CLOSE, f"session {cause}"))

    async def state(self, s: S, transport: str) -> tuple[dict[str, Any], SessionRecord]:
        """The common head of ``GET /v1/sessions/{id}`` (after the kind's checkpoint), with the
        record it was read from: what was buffered is flushed first (best effort)."""
        with contextlib.suppress(StoreError):
            await s.writer.flush()
        record = await self.store.get_session(s.tenant, s.session_id)
        head = {
            "object": "realtime.session.state",
            "id": s.session_id,
            "kind": self.spec.name,
            "transport": transport,
            "state": s.state,
            "created_at": int(record.created_at),
            "last_active_at": int(record.last_active),
            "expires_at": int(record.expires_at),
            "idle_expires_at": int(min(record.last_active + self.policy.idle_ttl_s, record.expires_at)),
        }
        return head, record

    # --- attach / detach ---------------------------------------------------------------------

    def detached(self, s: S) -> None:
        """The bookkeeping of a session that lost its connection (the kind detached its driver)."""
        s.timer.on_disconnect(self.wall())
        s.writer.set_state("detached")
        self.counts["detached"] += 1
        self.wake.set()

    async def replace_connection(
        self, s: S, transport: Any, detach: Callable[[Any], None], close_grace_s: float
    ) -> bool:
        """Under ``s.lock``: ``transport`` becomes the session's connection; one still attached
        is detached from the driver (``detach``) and closed (4000). False, with ``transport``
        closed, if the session is ending."""
        if s.ending:
            with contextlib.suppress(Exception):
                await transport.close(EXPIRED_CLOSE, "session ended")
            return False
        old, s.connection = s.connection, transport
        if old is not None:
            detach(old)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(close_grace_s):
                    await old.close(*REPLACED)
        return True

    def reattached(self, s: S) -> None:
        """The bookkeeping of a session a resuming connection attached to."""
        s.timer.on_reconnect(self.wall())
        s.writer.set_state("active")
        self.counts["resumed"] += 1

    # --- retention ---------------------------------------------------------------------------

    async def sweep(self) -> None:
        """One pass of retention over the live sessions (and retries of failed releases)."""
        wall, mono = self.wall(), self.clock()
        hooks = self.hooks
        actions: list[Awaitable[None]] = []
        for s in list(self.sessions.values()):
            if s.ending:
                continue
            closed = hooks.closed_by_itself(s)
            if closed is not None:
                actions.append(self.end(s, closed))
                continue
            active_at = wall - (mono - hooks.last_activity(s))
            if active_at > s.timer.last_active:
                s.timer.on_activity(active_at)
                if self.spec.touch_on_activity:
                    s.writer.mark_activity()  # the writer refreshes the TTLs (rate-limited)
            hooks.checkpoint(s)
            verdict = s.timer.check(wall)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                actions.append(self.expire(s, verdict))
            elif verdict is Verdict.GRACE_EXPIRED and not s.connected:
                actions.append(self.grace_over(s))
        if actions:
            await asyncio.gather(*actions, return_exceptions=True)
        await self.releases.retry(self.sessions)

    async def expire(self, s: S, verdict: Verdict) -> None:
        """End a session past its maximum lifetime or idle TTL, telling its client why."""
        message = expiry_message(self.policy, verdict)
        await self.end(s, verdict.value, close=(EXPIRED_CLOSE, "session expired"), expiry=message)

    async def grace_over(self, s: S) -> None:
        """Past its disconnect grace with nothing attached, the session ends (or parks, as its
        kind says), unless a connection attached meanwhile (checked under ``s.lock``)."""
        async with s.lock:
            if s.ending or s.connected or s.timer.check(self.wall()) is not Verdict.GRACE_EXPIRED:
                return
        await self.end(s, "grace_expired", park=self.spec.parks)

    # --- end and park ------------------------------------------------------------------------

    async def end(
        self,
        s: S,
        cause: str,
        *,
        close: tuple[int, str] | None = None,
        expiry: str | None = None,
        park: bool = False,
    ) -> None:
        """Out of this process (driver stopped: see :meth:`KindHooks.stop`; writer closed; slot
        released) and out of Redis, or, ``park``, the record kept (state ``parked``) for a
        later rebuild. ``leaving`` holds the session's event until all that is done."""
        if s.ending:
            return
        s.ending = True
        sid = s.session_id
        done = self.leaving[sid] = asyncio.Event()
        self.sessions.pop(sid, None)
        if self.drivers is not None:
            self.drivers.pop(sid, None)
        try:
            try:
                await self.hooks.stop(s, close, expiry)
                if park:
                    s.writer.set_state("parked")
                await s.writer.close(flush=park)
            finally:
                await self.release(sid)  # before the record goes: once it is gone, so is the slot
            if not park:
                await self.delete_record(sid)
        finally:
            del self.leaving[sid]
            done.set()
        self.counts[cause] += 1

    async def park(self, s: S, before: Callable[[S], None]) -> None:
        """Shutdown: ``before`` stores what the session needs to be rebuilt, then the session
        parks (close 1012: resume it after the restart)."""
        if not s.ending:
            before(s)
            await self.end(s, "parked", close=RESTART_CLOSE, park=True)

    def writer_failed(self, session_id: str, error: StoreError) -> None:
        """A session's writer failed for good: the session ends (or parks) as ``fenced``, or
        expires when its keys ran out with its lifetime or idle TTL."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        name = self.spec.name
        if isinstance(error, StaleEpoch):
            close = MOVED_CLOSE
        elif isinstance(error, SessionGone) and self.spec.expire_when_gone:
            # Its keys' TTL ends with its lifetime (or idle TTL): a TTL refresh just after that,
            # before the sweep saw it, finds them gone. End it as the sweep would, with the reason.
            wall = self.wall()
            s.timer.on_activity(wall - (self.clock() - self.hooks.last_activity(s)))
            verdict = s.timer.check(wall + EXPIRY_SLACK_S)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                spawn(self.tasks, self.expire(s, verdict), f"{name}-expired:{session_id}")
                return
            close = (EXPIRED_CLOSE, "session ended")
        else:
            close = self.hooks.store_failed(s, error)
        ending = self.end(s, "fenced", close=close, park=self.spec.parks)
        spawn(self.tasks, ending, f"{name}-fenced:{session_id}")

    def stats(self) -> dict[str, int]:
        """Live counters (back to zero once every session is gone)."""
        return {
            "live": len(self.sessions),
            "connected": sum(1 for s in self.sessions.values() if s.connected),
            "unreleased": len(self.releases),
            "tasks": len(self.tasks),
        }
