"""World-model sessions on the session layer: the same identity, admission slots, Redis
record, resume token, retention and replica binding as voice sessions.

A :class:`WorldHost` sits beside the process's :class:`~session.voice.hosting.SessionHost` and
borrows its parts rather than copying them: the :class:`~session.store.SessionStore` (one
record per session, ``config.kind == "world"``), the
:class:`~session.admission.AdmissionController` (voice and world sessions share the replica's
and the tenant's slots), the retention policy and the replica binding (``claim`` when scaled
out). What it does not borrow is the voice session's event log and restore: a world's state is
its runtime request and rolling context, which live in this process only, so

* a dropped WebSocket (no close frame, or any close code but 1000) or a vanished WebRTC call
  (ICE/DTLS failure, peer connection closed without a hangup) while a world is generating
  *detaches* the session for the disconnect grace: the driver holds its one chunk and demands
  no other (generation pauses, nothing grows), and a resume (a WebSocket or a new call, either
  way round) reattaches to the running world, its chunks now going where the new connection
  takes them (``outlets``);
* past the grace, at the idle TTL or the maximum lifetime, on ``DELETE`` or at shutdown the
  session *ends*: runtime request cancelled, slot released, record deleted. A world is never
  parked (there is nothing in Redis to rebuild it from);
* a connection that ends with no world generating (``session.stop`` sent, or the world
  completed) or with a clean close 1000 ends the session at once.

Redis traffic per session: the record at open, a state write at each detach/attach and at
each new generation (its config), and the writer's TTL refresh (at most every idle TTL / 4)
while there is activity. Nothing per chunk or per frame: one sweeper task per host reads the
drivers' activity clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from session.admission import Rejected
from session.host_common import SlotReleases, cancel_tasks, expiry_message, spawn, sweep_forever
from session.identity import new_session_id, resume_token_matches, secret_digest
from session.retention import EXPIRY_SLACK_S, RetentionTimer, Verdict
from session.store import SessionRecord, SessionWriter
from session.store.errors import (
    ResumeTokenInvalid,
    SessionGone,
    SessionNotFound,
    StaleEpoch,
    StoreError,
)
from session.voice.hosting import AdmissionRefused, SessionElsewhere
from session.world.driver import OutletFactory, TransportClosed, VideoSessionDriver, VideoTransport
from session.world.events import ErrorCode, SessionResumable

if TYPE_CHECKING:
    from session.voice.hosting import SessionHost

log = logging.getLogger(__name__)

KIND = "world"
CLEAN_CLOSE = 1000
EXPIRED_CLOSE = 1001
REPLACED = (4000, "replaced by a newer connection of the same session")

__all__ = ["KIND", "AdmissionRefused", "SessionElsewhere", "WorldHost", "WorldSession"]


@dataclass(eq=False, slots=True)
class WorldSession:
    """A world session live in this process (its driver, writer and retention timer)."""

    session_id: str
    tenant: str
    driver: VideoSessionDriver
    writer: SessionWriter
    timer: RetentionTimer
    record: SessionRecord
    transport_kind: str  # of the connection attached last: "websocket" or "webrtc"
    token_digest: str
    connection: VideoTransport | None = None  # the attached connection; None: detached
    opened: bool = False  # its first connection was attached (see WorldHost.open)
    ending: bool = False
    recorded_request: str | None = None  # the generation whose config the record holds
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def state(self) -> str:
        return "active" if self.connected else "detached"


class WorldHost:
    """The world sessions of one process (see the module docstring)."""

    def __init__(
        self,
        sessions: SessionHost,
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.voice = sessions  # store, admission, binding, claim, policy: shared with voice
        self.store = sessions.store
        self.admission = sessions.admission
        self.policy = sessions.policy
        self._wall = wall
        self._clock = clock
        self.sessions: dict[str, WorldSession] = {}
        self.counts: Counter[str] = Counter()
        self._releases = SlotReleases(sessions.admission)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        sweeper = sweep_forever(
            self._wake, lambda: self.voice.settings.sweep_s, self.sweep, log, "world session"
        )
        self._sweeper = asyncio.create_task(sweeper, name="world-host:sweeper")

    async def close(self) -> None:
        """Shutdown: every world ends (a world cannot outlive its process); slots go back."""
        live = list(self.sessions.values())
        await asyncio.gather(
            *(self._end(ws, "shutdown", close=(EXPIRED_CLOSE, "server shutting down")) for ws in live),
            return_exceptions=True,
        )
        await cancel_tasks(self._sweeper, *self._tasks)
        self._sweeper = None
        await self._releases.retry(self.sessions)

    # --- open --------------------------------------------------------------------------------

    async def admit(self, tenant: str) -> str:
        """A new session id holding a slot (no queue: a full replica or tenant refuses at once).
        Raises :class:`AdmissionRefused` (429) or ``StoreUnavailable`` (503)."""
        session_id = new_session_id()
        decision = await self.admission.try_admit(session_id, tenant, may_queue=False)
        if isinstance(decision, Rejected):
            raise AdmissionRefused(decision)
        return session_id

    async def forfeit(self, session_id: str) -> None:
        """Give back the slot of a session that did not open."""
        await self._release(session_id)

    async def create(
        self, session_id: str, tenant: str, driver: VideoSessionDriver, *, transport_kind: str
    ) -> tuple[WorldSession, str]:
        """After :meth:`admit`: the Redis record (kind ``world``) with its resume token (shown
        once), the binding to this replica when scaled out, the writer and retention timer.
        Raises ``StoreUnavailable`` or :class:`SessionElsewhere`; the caller forfeits the slot."""
        config = {"kind": KIND, "transport": transport_kind}
        record, token = await self.store.create_session(tenant, config, session_id=session_id)
        try:
            epoch = 0
            claim = self.voice.claim
            if claim is not None:  # scale-out: bound here (epoch 1), so a takeover fences us
                bound = await claim(session_id)
                if bound.replica_id != self.voice.replica_id:
                    raise SessionElsewhere(bound)
                epoch = bound.epoch
            writer = SessionWriter(
                self.store, record, epoch=epoch, on_fatal=lambda exc: self._on_writer_fatal(session_id, exc)
            )
            await writer.start()
        except BaseException:
            with contextlib.suppress(StoreError):
                await self.store.delete_session(session_id)
            raise
        timer = RetentionTimer(
            self.policy, created_at=record.created_at, now=self._wall(), expires_at=record.expires_at
        )
        ws = WorldSession(
            session_id, tenant, driver, writer, timer, record, transport_kind, secret_digest(token)
        )
        self.sessions[session_id] = ws
        self.counts["opened"] += 1
        return ws, token

    async def open(self, ws: WorldSession, transport: VideoTransport, token: str | None) -> bool:
        """Attach the first connection; given the ``token`` it first gets
        ``omni.session.resumable``. False if it is gone already (the session then ends)."""
        async with ws.lock:
            ws.connection = transport
            ws.opened = True
            if token is None:
                return True
            return await self._send_resumable(ws, transport, token)

    async def announce(self, ws: WorldSession, transport: VideoTransport, token: str) -> bool:
        """``omni.session.resumable`` on a first connection opened without it: a WebRTC call is
        attached at its SDP answer but carries events only once its channel is open. False if
        the connection is gone, or no longer the session's."""
        async with ws.lock:
            if ws.ending or ws.connection is not transport:
                return False
            return await self._send_resumable(ws, transport, token)

    async def _send_resumable(self, ws: WorldSession, transport: VideoTransport, token: str) -> bool:
        event = SessionResumable(ws.session_id, token, int(ws.record.expires_at))
        try:
            async with asyncio.timeout(ws.driver.core.limits.stall_timeout_s):
                await transport.send_text(event.to_json())
        except (TransportClosed, TimeoutError):
            return False
        return True

    # --- resume ------------------------------------------------------------------------------

    def live(self, tenant: str, session_id: str) -> WorldSession | None:
        ws = self.sessions.get(session_id)
        return ws if ws is not None and ws.tenant == tenant and not ws.ending else None

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> WorldSession:
        """Before the upgrade: the live world, or ``SessionNotFound`` (unknown, ended, another
        tenant's, a voice session, or a world whose process is gone), ``ResumeTokenInvalid``,
        :class:`SessionElsewhere` (scale-out: live on another replica), ``StoreUnavailable``."""
        ws = self.live(tenant, session_id)
        if ws is not None:
            if not resume_token_matches(token, ws.token_digest):
                raise ResumeTokenInvalid(session_id)
            return ws
        record = await self.store.authorize_resume(tenant, session_id, token)
        if record.config.get("kind") != KIND:
            raise SessionNotFound(session_id)
        bound = await self.voice.binding.get(session_id)
        if bound is not None and bound.replica_id != self.voice.replica_id:
            if self.voice.claim is None:
                raise SessionElsewhere(bound)
            # Scale-out: `claim` binds it here only when its owner's lease has lapsed. A world
            # dies with its process (its rolling context was there), so a dead owner's world is
            # gone: give back its slot and record, and answer 404 as the gateway does.
            claimed = await self.voice.claim(session_id)
            if claimed.replica_id != self.voice.replica_id:
                raise SessionElsewhere(claimed)
            await self._release(session_id)
            try:
                await self.store.delete_session(session_id)
            except StoreError:  # its keys expire by their TTL
                log.warning("world session %s: could not delete it from Redis", session_id)
        raise SessionNotFound(session_id)  # its world ran in a process that is gone

    async def resume(
        self,
        ws: WorldSession,
        transport: VideoTransport,
        *,
        kind: str | None = None,
        outlets: OutletFactory | None = None,
    ) -> bool:
        """Attach a resuming connection: a connection still attached is closed (4000), the
        new one gets ``omni.session.resumed`` (where the world is), then chunks continue,
        through ``outlets`` (the new connection's: a call's track, a WebSocket's encoder;
        None keeps the running one) and ``kind`` (``websocket`` | ``webrtc``) is recorded.
        False if the session ended meanwhile or the connection is already gone."""
        async with ws.lock:
            if ws.ending:
                with contextlib.suppress(Exception):
                    await transport.close(EXPIRED_CLOSE, "session ended")
                return False
            old, ws.connection = ws.connection, transport
            if old is not None:
                ws.driver.detach()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(ws.driver.core.limits.close_grace_s):
                        await old.close(*REPLACED)
            try:
                resumed = ws.driver.core.resumed()
                await ws.driver.attach(transport, [resumed.to_json()], outlets)
            except TransportClosed:
                ws.connection = None
                self._detached(ws)
                return False
            if kind is not None:
                ws.transport_kind = kind
            ws.timer.on_reconnect(self._wall())
            ws.writer.set_state("active")
            self.counts["resumed"] += 1
        return True

    # --- connections end ---------------------------------------------------------------------

    async def connection_ended(self, ws: WorldSession, transport: VideoTransport, code: int | None) -> None:
        """The connection ``transport`` ended (``code``: its close code, None if we ended it):
        detach a generating world, end the session otherwise."""
        async with ws.lock:
            if ws.ending or (ws.opened and ws.connection is not transport):
                return  # already ending, or replaced by a resume
            ws.connection = None  # (never opened: the client left before the upgrade completed)
            if ws.driver.closed:
                cause = "closed"  # stalled client, or ended by the driver
            elif code == CLEAN_CLOSE:
                cause = "client_closed"
            elif not ws.driver.retain or not ws.driver.core.generating:
                cause = "client_gone"  # nothing running to keep
            else:
                self._detached(ws)
                return
        await self._end(ws, cause)

    def _detached(self, ws: WorldSession) -> None:
        ws.driver.detach()
        ws.timer.on_disconnect(self._wall())
        ws.writer.set_state("detached")
        self.counts["detached"] += 1
        self._wake.set()

    # --- retention ---------------------------------------------------------------------------

    async def sweep(self) -> None:
        """One pass of retention over the live worlds (and retries of failed releases)."""
        wall, mono = self._wall(), self._clock()
        actions: list[Awaitable[None]] = []
        for ws in list(self.sessions.values()):
            if ws.ending:
                continue
            if ws.driver.closed and not ws.connected:
                actions.append(self._end(ws, "closed"))
                continue
            active_at = wall - (mono - ws.driver.last_activity)
            if active_at > ws.timer.last_active:
                ws.timer.on_activity(active_at)
                ws.writer.mark_activity()  # the writer refreshes the TTLs (rate-limited)
            self._record_generation(ws)
            verdict = ws.timer.check(wall)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                close = (EXPIRED_CLOSE, "session expired")
                error = (ErrorCode.SESSION_EXPIRED, expiry_message(self.policy, verdict))
                actions.append(self._end(ws, verdict.value, close=close, error=error))
            elif verdict is Verdict.GRACE_EXPIRED and not ws.connected:
                actions.append(self._end(ws, "grace_expired"))
        if actions:
            await asyncio.gather(*actions, return_exceptions=True)
        await self._releases.retry(self.sessions)

    def _record_generation(self, ws: WorldSession) -> None:
        """A new generation started: its config (model, format, size, fps, prompt) into the
        record, once per generation."""
        state = ws.driver.core.resumed()
        if state.request_id is None or state.config is None or state.request_id == ws.recorded_request:
            return
        ws.recorded_request = state.request_id
        config = {
            "kind": KIND,
            "transport": ws.transport_kind,
            "request_id": state.request_id,
            "format": state.format,
            **state.config,
        }
        ws.writer.set_config(config)

    # --- end ---------------------------------------------------------------------------------

    async def delete(self, tenant: str, session_id: str, *, cause: str = "deleted") -> None:
        """``DELETE /v1/sessions/{id}`` (or a WebRTC call's hangup, ``cause`` "hangup") of a
        world live here (else ``SessionNotFound``), attached or detached."""
        ws = self.live(tenant, session_id)
        if ws is None:
            raise SessionNotFound(session_id)
        await self._end(ws, cause, close=(CLEAN_CLOSE, f"session {cause}"))

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        """``GET /v1/sessions/{id}`` of a world live here (else ``SessionNotFound``)."""
        ws = self.live(tenant, session_id)
        if ws is None:
            raise SessionNotFound(session_id)
        self._record_generation(ws)
        with contextlib.suppress(StoreError):
            await ws.writer.flush()
        record = await self.store.get_session(tenant, session_id)
        world = ws.driver.core.resumed()
        return {
            "object": "realtime.session.state",
            "id": session_id,
            "kind": KIND,
            "transport": ws.transport_kind,
            "state": ws.state,
            "created_at": int(record.created_at),
            "last_active_at": int(record.last_active),
            "expires_at": int(record.expires_at),
            "idle_expires_at": int(min(record.last_active + self.policy.idle_ttl_s, record.expires_at)),
            "event_count": record.event_seq,
            "live_here": True,
            "connected": ws.connected,
            "active_response_id": None,
            "world": {
                "phase": world.phase,
                "request_id": world.request_id,
                "chunk_index": world.chunk_index,
                "chunks_sent": world.chunks_sent,
                "format": world.format,
                "config": world.config,
            },
        }

    async def _end(
        self,
        ws: WorldSession,
        cause: str,
        *,
        close: tuple[int, str] | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        """Out of this process and out of Redis: cancel the world, release the slot."""
        if ws.ending:
            return
        ws.ending = True
        sid = ws.session_id
        self.sessions.pop(sid, None)
        try:
            if close is not None:
                await ws.driver.end(close[0], close[1], error)
            else:
                await ws.driver.close()
            await ws.writer.close(flush=False)
        finally:
            await self._release(sid)  # before the record goes: once it is gone, so is the slot
        try:
            await self.store.delete_session(sid)
        except StoreError:  # its keys expire by their TTL
            log.warning("world session %s: could not delete it from Redis", sid)
        self.counts[cause] += 1

    def _on_writer_fatal(self, session_id: str, error: StoreError) -> None:
        ws = self.sessions.get(session_id)
        if ws is None:
            return
        if isinstance(error, StaleEpoch):
            close = (1012, "session moved to another replica")
        elif isinstance(error, SessionGone):
            # Its keys' TTL ends with its lifetime (or idle TTL): a TTL refresh just after that,
            # before the sweep saw it, finds them gone. End it as the sweep would, with the reason.
            verdict = ws.timer.check(self._wall() + EXPIRY_SLACK_S)
            if verdict is Verdict.LIFETIME_EXPIRED or verdict is Verdict.IDLE_EXPIRED:
                expired = (ErrorCode.SESSION_EXPIRED, expiry_message(self.policy, verdict))
                end = self._end(ws, verdict.value, close=(EXPIRED_CLOSE, "session expired"), error=expired)
                spawn(self._tasks, end, f"world-expired:{session_id}")
                return
            close = (EXPIRED_CLOSE, "session ended")
        else:
            close = (1011, "session store error")
        spawn(self._tasks, self._end(ws, "fenced", close=close), f"world-fenced:{session_id}")

    async def _release(self, session_id: str) -> None:
        await self._releases.release(session_id)

    def stats(self) -> dict[str, int]:
        """Live counters (back to zero once every world is gone)."""
        return {
            "live": len(self.sessions),
            "connected": sum(1 for ws in self.sessions.values() if ws.connected),
            "unreleased": len(self._releases),
            "tasks": len(self._tasks),
        }
