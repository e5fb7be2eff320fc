"""The realtime sessions of one process: open, serve, detach, resume, restore, retention, end.

A :class:`HostedSession` is a session live in this process: its driver (core, responses,
timers), its :class:`~session.store.SessionWriter` (event log and durable state in Redis) and
its :class:`~session.retention.RetentionTimer`. Connections come and go:

* **open**: admission (web layer: `admission.try_admit` / `acquire`), then :meth:`create`
  (Redis record + resume token) and :meth:`serve_new`: `session.created`, then (a client
  that asked for `omni.*` events) `omni.session.resumable {session_id, resume_token,
  expires_at}`, then live;
* **connection lost** (no close frame, or any close code but 1000; a WebRTC peer whose
  connection failed or closed without a hangup): the session is *detached*
  and runs on (a response in flight keeps streaming into the log) for the disconnect grace;
  past it, an in-flight response is cancelled and the session is *parked*: it leaves the
  process and its admission slot, and stays resumable from Redis until its idle TTL. A client
  close with code 1000 (a WebRTC client closing its events channel) parks at once; a
  transport whose ``info.session_end`` is ``(cause, delete)`` ends it so (a WebRTC call
  whose ICE never connected: deleted, nobody ever held its resume token);
* **resume** (:meth:`serve_resume`; the composed ``host.resume``, session/voice/hosting_resume.py):
  the new connection is attached *held*, the writer is flushed, the events after
  `last_event_id` are read from the log and sent behind `omni.session.resumed {session_id,
  replay_count}`, then what was queued meanwhile minus what the replay already had, then
  live. If the id is no longer replayable (trimmed, unknown, gap) the client gets
  `omni.session.snapshot {session, items}` instead;
* **restore** (:meth:`restore`): a resume of a session this process does not hold (parked,
  or its process died) rebuilds the core from Redis (config + items with transcripts) under a
  new binding epoch, so ids the dead process issued but never made durable cannot collide;
* **end**: idle TTL or maximum lifetime (`session_expired`, close 1001), `DELETE`, a fenced
  writer: the session leaves the process and, when over for good, Redis.

The mechanics every kind shares (the live table, counters, slots released on every path and
retried by the sweeper while Redis is down, the one sweeper task, retention, end and park,
writer fatal errors) are the composed :class:`~session.lifecycle.SessionLifecycle`
(``host.life``); this host is its :class:`~session.lifecycle.KindHooks` for voice: its sessions
park rather than end past the grace or when fenced, and stopping one tells its core first
(``session_expired``, or the response in flight cancelled). It also holds the parts every kind
shares (:class:`~session.lifecycle.SharedParts`: store, admission, policy, binding). Nothing
here touches the per-event path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from session.admission import AdmissionController
from session.affinity import Binding, SessionBinding
from session.identity import secret_digest
from session.lifecycle import (
    CLEAN_CLOSE,
    RESTART_CLOSE,
    AdmissionRefused,
    Claim,
    KindSpec,
    SessionElsewhere,
    SessionLifecycle,
)
from session.link import LinkEnd, Transport, TransportLink
from session.realtime.config import SessionConfig
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.records import config_record
from session.resume import connection_event
from session.retention import RetentionPolicy
from session.store import SessionRecord, SessionStore, WriterHub
from session.store.errors import (
    SessionGone,
    StaleEpoch,
    StoreError,
    StoreUnavailable,
    WriteRejected,
)
from session.voice.driver import RealtimeDriver
from session.voice.driver_hooks import SessionLog
from session.voice.hosted import HostedSession
from session.voice.hosting_resume import VoiceResume

log = logging.getLogger(__name__)

__all__ = [
    "AdmissionRefused",
    "HostSettings",
    "HostedSession",
    "SessionElsewhere",
    "SessionHost",
]

CoreOptionsFactory = Callable[[SessionConfig, str], CoreOptions]
DriverFactory = Callable[[RealtimeSessionCore, SessionLog], RealtimeDriver]

# Voice sessions park (record kept, rebuilt by a resume) past the grace and when fenced; a
# voice driver marks its event log on client input itself.
SPEC = KindSpec("voice", expire_when_gone=True, parks=True, touch_on_activity=False)


def stored_failure_event(last_event_id: str | None, error: WriteRejected) -> dict[str, Any]:
    """The `error` a client gets when its session's own data could not be stored (the
    cause stays in the server log, under the session id the message names)."""
    message = f"The session's state could not be stored; it ended (ref {error.session_id})."
    body = {
        "type": "server_error",
        "code": "session_failed",
        "message": message,
        "param": None,
        "event_id": None,
    }
    return connection_event("error", last_event_id, error=body)


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


class SessionHost:
    """The voice sessions of one process (see the module docstring), and the parts every
    kind of session shares (:class:`~session.lifecycle.SharedParts`)."""

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
        # Scale-out: claim(session_id) binds a restored session to this replica or names its
        # live owner (web/deploy/replica.py); standalone, a restore always takes the binding over.
        self.claim: Claim | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        drivers = registry if registry is not None else {}  # id -> driver, for metrics
        self.life: SessionLifecycle[HostedSession] = SessionLifecycle(
            self, SPEC, self, wall=wall, clock=clock, drivers=drivers
        )
        self.sessions = self.life.sessions
        self.counts = self.life.counts
        self.resume = VoiceResume(self)  # authorize, restore from Redis, replay

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

    def live(self, tenant: str, session_id: str) -> HostedSession | None:
        return self.life.live(tenant, session_id)

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> None:
        """Before a resume's upgrade (:meth:`VoiceResume.authorize`)."""
        await self.resume.authorize(tenant, session_id, token)

    async def restore(self, tenant: str, session_id: str, token: str | None = None) -> HostedSession:
        """The live session, or one rebuilt from Redis (:meth:`VoiceResume.restore`)."""
        return await self.resume.restore(tenant, session_id, token)

    async def serve_resume(
        self, hs: HostedSession, transport: Transport, last_event_id: str | None
    ) -> LinkEnd:
        """Attach a resuming connection: replay, then live (:meth:`VoiceResume.serve_resume`)."""
        return await self.resume.serve_resume(hs, transport, last_event_id)

    async def take_binding(self, session_id: str) -> Binding:
        """The binding (epoch) this process writes a rebuilt session (of any kind) with from now
        on (always a new one, except a session parked by this very replica); `previous_replica`
        when it moved. Claims it when scaled out, else takes it over."""
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

    async def bind_new(self, session_id: str) -> int:
        """The binding epoch of a new session (of any kind): scaled out, it is bound here
        (epoch 1) so a takeover fences us; else 0. :class:`SessionElsewhere` when another
        replica holds it."""
        if self.claim is None:
            return 0
        bound = await self.claim(session_id)
        if bound.replica_id != self.replica_id:
            raise SessionElsewhere(bound)
        return bound.epoch

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        with contextlib.suppress(StoreUnavailable):  # Redis down at start: load them lazily
            await self.store.load_scripts()
            await self.admission.load_scripts()
        await self.admission.start()
        self.life.start()

    async def close(self) -> None:
        """Shutdown: admit nobody, let in-flight responses finish (bounded), then park every
        session (close 1012: resume after the restart) and give every slot back."""
        self.admission.draining = True
        live = list(self.sessions.values())
        if live:
            timeout = self.settings.drain_timeout_s
            await asyncio.gather(*(hs.driver.wait_responses(timeout) for hs in live))
            await asyncio.gather(
                *(self.life.end(hs, "shutdown", close=RESTART_CLOSE, park=True) for hs in live),
                return_exceptions=True,
            )
        await self.life.stop()
        await self.admission.close()
        # The last host to close (worlds end before it): a writer whose end failed would keep
        # the store's hub retrying.
        await WriterHub.close_for(self.store)

    # --- open --------------------------------------------------------------------------------

    async def create(
        self, session_id: str, tenant: str, config: SessionConfig, *, resume_token: str | None = None
    ) -> tuple[HostedSession, str]:
        """A new session (admission already granted): its Redis record, writer and driver.
        Returns it with its resume token (shown once; `resume_token` when the caller drew it
        already). Raises `StoreUnavailable`."""
        core = RealtimeSessionCore(self.restored_options(config, session_id))
        stored = config_record(
            config, session_id=session_id, expires_at=0, conversation_id=core.conversation_id
        )
        record, token = await self.store.create_session(
            tenant, stored, session_id=session_id, resume_token=resume_token
        )
        hs = await self.host_session(record, core, epoch=await self.bind_new(session_id))
        hs.token_digest = secret_digest(token)
        self.counts["opened"] += 1
        return hs, token

    async def forfeit(self, session_id: str) -> None:
        """Give back a slot (or queue place) taken for a session that did not open."""
        await self.life.release(session_id)

    async def serve_new(
        self, hs: HostedSession, transport: Transport, resume_token: str, *, announce: bool = True
    ) -> LinkEnd:
        """Serve a just-created session on its first connection until that connection ends.
        `announce`: the client asked for `omni.*` events, so it gets `omni.session.resumable`
        (otherwise the edge gave it the token some other way, e.g. headers on the 101)."""
        async with hs.lock:
            link = hs.driver.attach(transport)
            hs.driver.start(epoch=hs.record.created_at)
            if announce:
                link.push(
                    connection_event(
                        "omni.session.resumable",
                        hs.driver.last_event_id,
                        session_id=hs.session_id,
                        resume_token=resume_token,
                        expires_at=int(hs.record.expires_at),
                    )
                )
        return await self.watch(hs, link)

    # --- connections end ---------------------------------------------------------------------

    async def watch(self, hs: HostedSession, link: TransportLink) -> LinkEnd:
        """Wait for the connection to end, then detach, park or end the session."""
        end = await link.wait()
        async with hs.lock:
            superseded = hs.driver.link is not None and hs.driver.link is not link
            hs.driver.detach(link)
            if hs.ending or superseded or end is LinkEnd.REPLACED:
                return end
            info = link.transport.info
            if hs.driver.closed.is_set():
                cause, delete = "expired", True
            elif info.session_end is not None:  # the transport knows it is over (see SessionEnd)
                cause, delete = info.session_end
            elif info.disconnect_code == CLEAN_CLOSE:
                cause, delete = "client_closed", False
            else:
                self.life.detached(hs)
                return end
        # Stopping it cancels the response in flight first (see stop).
        await self.life.end(hs, cause, park=not delete)
        return end

    # --- the hooks of SessionLifecycle -------------------------------------------------------

    def last_activity(self, s: HostedSession) -> float:
        return s.driver.last_activity

    def checkpoint(self, s: HostedSession) -> None:
        pass  # its driver logs every change as it happens

    def closed_by_itself(self, s: HostedSession) -> str | None:
        return "expired" if s.driver.closed.is_set() else None

    async def stop(self, s: HostedSession, close: tuple[int, str] | None, expiry: str | None) -> None:
        """The core first, under the lock (a resume may be attaching): `session_expired` with
        ``expiry``; with neither ``expiry`` nor ``close`` (the client left, or the grace is
        over) the response in flight cancelled, so the log and a later resume see it end,
        unless the session closed itself. Whatever the driver raises is logged: the slot goes
        back anyway."""
        driver = s.driver
        try:
            if expiry is not None:
                async with s.lock:
                    driver.apply(driver.core.expire(self.life.clock(), expiry))
            elif close is None and not driver.closed.is_set():
                async with s.lock:
                    driver.apply(driver.core.cancel_response(self.life.clock()))
            if close is not None and not driver.closed.is_set():
                driver.request_close(*close)
            await driver.shutdown()
        except Exception:
            log.exception("session %s: stopping it failed; releasing its slot", s.session_id)

    def store_failed(self, s: HostedSession, error: StoreError) -> tuple[int, str]:
        if isinstance(error, WriteRejected):  # its own data cannot be stored: it ends
            if s.driver.link is not None:  # not logged: its log is what failed
                s.driver.link.push(stored_failure_event(s.driver.last_event_id, error))
            return (1011, "session state could not be stored")
        return (1011, "session store error")

    async def sweep(self) -> None:
        """One pass of retention over the live sessions (and retries of failed releases)."""
        await self.life.sweep()

    # --- end ---------------------------------------------------------------------------------

    async def delete(self, tenant: str, session_id: str, *, cause: str = "deleted") -> None:
        """`DELETE /v1/sessions/{id}` (or a WebRTC hangup, `cause` "hangup"): end the session
        everywhere, live or parked (`SessionNotFound`)."""
        hs = self.live(tenant, session_id)
        if hs is not None:
            await self.life.end(hs, cause, close=(CLEAN_CLOSE, f"session {cause}"))
            return
        await self.store.get_session(tenant, session_id)
        await self.store.delete_session(session_id)
        self.counts[cause] += 1

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
                "held_bytes": w.held_bytes,  # audio deltas kept here for a resume
                "held_dropped": w.held_dropped,
            }
        return body

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
                self.life.writer_failed(hs.session_id, exc)
                fenced += 1
            except StoreError:
                pass  # Redis still unreachable: the writer's own retries get there
        return fenced

    # --- construction ------------------------------------------------------------------------

    def restored_options(self, config: SessionConfig, session_id: str) -> CoreOptions:
        """A session's core options with its own config and the store's lifetime."""
        # The core's own expiry is the store's maximum lifetime, so both end it together.
        options = self._core_options(config, session_id)
        return replace(
            options, config=config, session_id=session_id, max_duration_s=self.policy.max_lifetime_s
        )

    def default_model(self, session_id: str) -> str:
        return self._core_options(SessionConfig(), session_id).config.model

    async def host_session(
        self, record: SessionRecord, core: RealtimeSessionCore, *, epoch: int
    ) -> HostedSession:
        """Host `core` under `record`: its writer, driver and timer, added to the live sessions."""
        writer = await self.life.new_writer(record, epoch)
        driver = self._new_driver(core, writer)
        driver.on_close = self.life.wake.set
        timer = self.life.new_timer(record)
        hs = HostedSession(record.session_id, record.tenant, driver, writer, timer, record, None)
        self.life.add(hs)
        return hs

    # --- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Live counters (all back to zero once every session is gone)."""
        life = self.life
        voice = {"drivers": len(life.drivers or ()), "restoring": len(self.resume.restoring)}
        return {**life.stats(), **voice, "ending": len(life.leaving)}
