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

The mechanics every kind shares (the live table, slots, sweeper, binding, retention, end,
writer fatal errors) are the composed :class:`~session.lifecycle.SessionLifecycle`; this host is
its :class:`~session.lifecycle.KindHooks` for worlds.

Redis traffic per session: the record at open, a state write at each detach/attach and at
each new generation (its config), and the writer's TTL refresh (at most every idle TTL / 4)
while there is activity. Nothing per chunk or per frame: one sweeper task per host reads the
drivers' activity clocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from session.identity import secret_digest
from session.kind_host import KindHost
from session.lifecycle import CLEAN_CLOSE, EXPIRED_CLOSE, HostedSession, SharedParts
from session.store.errors import StoreError
from session.world.driver import OutletFactory, TransportClosed, VideoSessionDriver, VideoTransport
from session.world.events import ErrorCode, SessionResumable

log = logging.getLogger(__name__)

KIND = "world"

__all__ = ["KIND", "WorldHost", "WorldSession"]


@dataclass(eq=False, slots=True)
class WorldSession(HostedSession[VideoSessionDriver, VideoTransport]):
    """A world session live in this process (its driver, writer and retention timer)."""

    transport_kind: str = "websocket"  # of the connection attached last: "websocket" or "webrtc"
    recorded_request: str | None = None  # the generation whose config the record holds


class WorldHost(KindHost[WorldSession]):
    """The world sessions of one process (see the module docstring)."""

    def __init__(
        self,
        sessions: SharedParts,
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(sessions, KIND, self, expire_when_gone=True, wall=wall, clock=clock)

    # --- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Shutdown: every world ends (a world cannot outlive its process); slots go back."""
        await self.end_all((EXPIRED_CLOSE, "server shutting down"))

    # --- open --------------------------------------------------------------------------------

    async def create(
        self, session_id: str, tenant: str, driver: VideoSessionDriver, *, transport_kind: str
    ) -> tuple[WorldSession, str]:
        """After :meth:`admit`: the Redis record (kind ``world``) with its resume token (shown
        once), the binding to this replica when scaled out, the writer and retention timer.
        Raises ``StoreUnavailable`` or ``SessionElsewhere``; the caller forfeits the slot."""
        config = {"kind": KIND, "transport": transport_kind}
        async with self.new_record(tenant, config, session_id) as (record, token, epoch):
            writer = await self.life.new_writer(record, epoch)
        timer = self.life.new_timer(record)
        ws = WorldSession(session_id, tenant, driver, writer, timer, record, secret_digest(token))
        ws.transport_kind = transport_kind
        self.life.add(ws)
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

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> WorldSession:
        """Before the upgrade: the live world, or ``SessionNotFound`` (unknown, ended, another
        tenant's, a voice session, or a world whose process is gone), ``ResumeTokenInvalid``,
        ``SessionElsewhere`` (scale-out: live on another replica), ``StoreUnavailable``."""
        return await self.authorize_here(tenant, session_id, token)  # its rolling context is here

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
            grace = ws.driver.core.limits.close_grace_s
            if not await self.life.replace_connection(ws, transport, lambda _old: ws.driver.detach(), grace):
                return False
            try:
                resumed = ws.driver.core.resumed()
                await ws.driver.attach(transport, [resumed.to_json()], outlets)
            except TransportClosed:
                ws.connection = None
                self.detach(ws)
                return False
            if kind is not None:
                ws.transport_kind = kind
            self.life.reattached(ws)
        return True

    # --- connections end ---------------------------------------------------------------------

    async def connection_ended(self, ws: WorldSession, transport: VideoTransport, code: int | None) -> None:
        """The connection ``transport`` ended (``code``: its close code, None if we ended it):
        detach a generating world, end the session otherwise."""

        def cause() -> str | None:  # (never opened: the client left before the upgrade completed)
            if ws.driver.closed:
                return "closed"  # stalled client, or ended by the driver
            if code == CLEAN_CLOSE:
                return "client_closed"
            if not ws.driver.retain or not ws.driver.core.generating:
                return "client_gone"  # nothing running to keep
            return None

        await self.end_or_detach(ws, transport, cause)

    # --- retention (the hooks of SessionLifecycle) -------------------------------------------

    def last_activity(self, s: WorldSession) -> float:
        return s.driver.last_activity

    def closed_by_itself(self, s: WorldSession) -> str | None:
        return "closed" if s.driver.closed and not s.connected else None

    def checkpoint(self, s: WorldSession) -> None:
        self._record_generation(s)

    async def stop(self, s: WorldSession, close: tuple[int, str] | None, expiry: str | None) -> None:
        if close is None:
            await s.driver.close()
            return
        error = (ErrorCode.SESSION_EXPIRED, expiry) if expiry is not None else None
        await s.driver.end(close[0], close[1], error)

    def store_failed(self, s: WorldSession, error: StoreError) -> tuple[int, str]:
        return (1011, "session store error")

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

    async def describe(self, tenant: str, session_id: str) -> dict[str, Any]:
        """``GET /v1/sessions/{id}`` of a world live here (else ``SessionNotFound``)."""
        ws = self.life.live_or_gone(tenant, session_id)
        self._record_generation(ws)
        head, record = await self.life.state(ws, ws.transport_kind)
        world = ws.driver.core.resumed()
        return {
            **head,
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
