"""Resume for :class:`~session.voice.hosting.SessionHost`: authorize, restore from Redis, replay.

A component the host composes (``SessionHost.resume``; the host's ``authorize``, ``restore``
and ``serve_resume`` hand over to it), holding the one piece of state of its own: the
rebuilds in flight. A resuming connection is attached *held*, the writer is flushed, the
events after `last_event_id` are read from the log and sent behind `omni.session.resumed`,
then what was queued meanwhile minus what the replay already had, then live
(`omni.session.snapshot` when the id is no longer replayable). A session this process does
not hold is rebuilt from Redis under a new binding epoch, once an end or park of it still in
flight here is done (``host.life.leaving``). WebSocket and WebRTC connections resume the
same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from typing import Any, Protocol

from session.affinity import Binding
from session.identity import resume_token_matches, secret_digest
from session.lifecycle import SessionLifecycle
from session.link import LinkEnd, Transport, TransportLink
from session.realtime.config import SessionConfig
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.records import config_from_record
from session.resume import connection_event, event_position, logged_event_id, replayed_through
from session.store import SessionRecord, SessionStore
from session.store.errors import ReplayUnavailable, ResumeTokenInvalid, SessionNotFound, StoreError
from session.voice.hosted import HostedSession
from session.voice.retrieved import rebuilt

log = logging.getLogger("session.voice.hosting")


class ResumeHost(Protocol):
    """What the resume part needs of its host (:class:`~session.voice.hosting.SessionHost`)."""

    store: SessionStore
    life: SessionLifecycle[HostedSession]
    counts: Counter[str]

    @property
    def replica_id(self) -> str: ...

    def live(self, tenant: str, session_id: str) -> HostedSession | None: ...

    async def take_binding(self, session_id: str) -> Binding: ...

    def restored_options(self, config: SessionConfig, session_id: str) -> CoreOptions: ...

    def default_model(self, session_id: str) -> str: ...

    async def host_session(
        self, record: SessionRecord, core: RealtimeSessionCore, *, epoch: int
    ) -> HostedSession: ...

    async def watch(self, hs: HostedSession, link: TransportLink) -> LinkEnd: ...


class VoiceResume:
    """The resume half of a voice :class:`~session.voice.hosting.SessionHost`, composed by it."""

    def __init__(self, host: ResumeHost) -> None:
        self.host = host
        self.restoring: dict[str, asyncio.Task[HostedSession]] = {}  # rebuilds in flight

    # --- resume ------------------------------------------------------------------------------

    async def authorize(self, tenant: str, session_id: str, token: str | None) -> None:
        """Before the upgrade: `SessionNotFound` (unknown, expired, another tenant's) or
        `ResumeTokenInvalid`; nothing else is revealed. A session held here checks the token
        against the digest it keeps (constant time, no round trip)."""
        hs = self.host.live(tenant, session_id)
        if hs is not None and hs.token_digest is not None:
            if not resume_token_matches(token, hs.token_digest):
                raise ResumeTokenInvalid(session_id)
            return
        await self.host.store.authorize_resume(tenant, session_id, token)
        if hs is not None and token:
            hs.token_digest = secret_digest(token)

    async def restore(self, tenant: str, session_id: str, token: str | None = None) -> HostedSession:
        """The live session, or one rebuilt from Redis (taking an admission slot: raises
        `AdmissionRefused`; `SessionNotFound`, `SessionElsewhere`, `StoreUnavailable`).
        Concurrent restores of one session share one rebuild, which completes even if the
        caller goes away (the session then waits detached for a connection)."""
        hs = self.host.live(tenant, session_id)
        if hs is not None:
            return hs
        flight = self.restoring.get(session_id)
        if flight is None:
            flight = asyncio.create_task(self._restore_once(tenant, session_id), name=f"restore:{session_id}")
            self.restoring[session_id] = flight
            flight.add_done_callback(lambda t: self._restore_done(session_id, t))
        hs = await asyncio.shield(flight)
        if hs.tenant != tenant:  # authorize() checked the tenant; this is belt and braces
            raise SessionNotFound(session_id)
        if token and hs.token_digest is None:  # `token` was authorized: later resumes check here
            hs.token_digest = secret_digest(token)
        return hs

    def _restore_done(self, session_id: str, task: asyncio.Task[HostedSession]) -> None:
        self.restoring.pop(session_id, None)
        if not task.cancelled():
            task.exception()  # retrieved here: a caller that went away cannot

    async def _restore_once(self, tenant: str, session_id: str) -> HostedSession:
        ending = self.host.life.leaving.get(session_id)
        if ending is not None:  # parked or ending right now: let its writer finish first
            await ending.wait()
        hs = self.host.live(tenant, session_id)
        if hs is not None:
            return hs
        await self.host.life.readmit(session_id, tenant)  # AdmissionRefused when full
        try:
            return await self._rebuild(tenant, session_id)
        except BaseException:
            await self.host.life.release(session_id)
            raise

    async def _rebuild(self, tenant: str, session_id: str) -> HostedSession:
        snapshot = await self.host.store.load_snapshot(tenant, session_id)
        bound = await self.host.take_binding(session_id)
        record = snapshot.record
        config = config_from_record(record.config, default_model=self.host.default_model(session_id))
        now = self.host.life.clock()
        core = RealtimeSessionCore.restore(
            self.host.restored_options(config, session_id),
            snapshot.items,
            conversation_id=record.config.get("conversation_id"),
            now=now,
            epoch=self.host.life.wall(),
            expires_at=record.expires_at,
            open_response=record.open_response,
        )
        hs = await self.host.host_session(record, core, epoch=bound.epoch)
        hs.migrated_from = bound.previous_replica  # set when it moved here from a lost replica
        hs.driver.start()
        # The dead process's in-flight response is ended once a connection is attached, after
        # its replay or snapshot, so the client sees it end live (see serve_resume).
        hs.orphans = (True, bound.previous_replica)
        hs.timer.on_disconnect(self.host.life.wall())  # detached until a connection attaches
        hs.writer.set_state("detached")
        self.host.counts["restored"] += 1
        return hs

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
            hs.timer.on_reconnect(self.host.life.wall())
            try:
                await self._replay(hs, link, last_event_id)
                hs.writer.set_state("active")  # after the replay: not a round trip on its path
                pending, lost = hs.orphans
                if pending:
                    hs.orphans = (False, None)
                    core = hs.driver.core
                    hs.driver.apply(core.close_orphaned_responses(self.host.life.clock(), lost_replica=lost))
            except StoreError as exc:
                log.warning("session %s: resume failed: %s", hs.session_id, exc)
                link.finish(LinkEnd.CLOSED, 1013, "session store unavailable; resume again")
            self.host.counts["resumed"] += 1
        return await self.host.watch(hs, link)

    async def _replay(self, hs: HostedSession, link: TransportLink, last_event_id: str | None) -> None:
        after = logged_event_id(last_event_id)
        try:
            # flushes first: what this process holds unflushed becomes replayable
            replay = await hs.writer.replay(after)
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
            self.host.counts["resynced"] += 1
            return
        events = replay.events
        through = event_position(events[-1]["event_id"]) if events else event_position(after)
        resumed = connection_event(
            "omni.session.resumed",
            last_event_id,
            session_id=hs.session_id,
            replay_count=len(events),
            audio_replay=replay.held,
        )
        last = events[-1]["event_id"] if events else last_event_id
        # Retrieves were logged as references: rebuilt from the conversation as they are sent.
        replayed = rebuilt(events, hs.driver.core)
        preamble = itertools.chain([resumed], replayed, self._migration_notice(hs, last))
        link.release(preamble, skip=replayed_through(through))

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
            to_replica=self.host.replica_id,
        )
        return [event]
