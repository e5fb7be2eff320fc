"""What the world, robot and GPT-Live hosts answer alike: each holds a
:class:`~session.lifecycle.SessionLifecycle` (its sessions, slots, retention) and is that
lifecycle's :class:`~session.lifecycle.KindHooks`; the calls below only hand over to it. A host
adds what its kind does differently (create, open, authorize, resume, its hooks, describe)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic

from session.lifecycle import KindHooks, KindSpec, S, SessionElsewhere, SessionLifecycle, SharedParts
from session.store import SessionRecord
from session.store.errors import SessionNotFound, StoreError


class KindHost(Generic[S]):
    """The sessions of one kind in this process, through their lifecycle (module docstring)."""

    def __init__(
        self,
        shared: SharedParts,
        kind: str,
        hooks: KindHooks[S],
        *,
        expire_when_gone: bool,
        wall: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        spec = KindSpec(kind, expire_when_gone=expire_when_gone)
        self.life = life = SessionLifecycle(shared, spec, hooks, wall=wall, clock=clock)
        self.sessions = life.sessions
        self.counts = life.counts

    async def start(self) -> None:
        self.life.start()

    async def end_all(self, close: tuple[int, str]) -> None:
        """Shutdown for a kind whose sessions cannot outlive the process: every one ends (closed
        with ``close``), slots go back, the sweeper stops."""
        live = list(self.sessions.values())
        await asyncio.gather(
            *(self.life.end(s, "shutdown", close=close) for s in live), return_exceptions=True
        )
        await self.life.stop()

    async def admit(self, tenant: str) -> str:
        """A new session id holding a slot (no queue: a full replica or tenant refuses at once).
        Raises ``AdmissionRefused`` (429) or ``StoreUnavailable`` (503)."""
        return await self.life.admit(tenant)

    async def forfeit(self, session_id: str) -> None:
        """Give back the slot of a session that did not open."""
        await self.life.release(session_id)

    @contextlib.asynccontextmanager
    async def new_record(
        self, tenant: str, config: dict[str, Any], session_id: str
    ) -> AsyncIterator[tuple[SessionRecord, str, int]]:
        """The record of a new session (``config``), its resume token (shown once) and its
        binding epoch; the record is deleted again when the binding, or what the block does with
        them (writer, driver), fails. Raises ``StoreUnavailable`` or ``SessionElsewhere``."""
        record, token = await self.life.store.create_session(tenant, config, session_id=session_id)
        try:
            yield record, token, await self.life.bind_new(session_id)
        except BaseException:
            with contextlib.suppress(StoreError):
                await self.life.store.delete_session(session_id)
            raise

    async def authorize_here(self, tenant: str, session_id: str, token: str | None) -> S:
        """For a kind whose sessions die with their process: the session live here, else
        ``SessionNotFound`` (unknown, ended, another tenant's or kind's, or its process gone),
        ``ResumeTokenInvalid``, :class:`SessionElsewhere` (scale-out: live on another replica),
        ``StoreUnavailable``."""
        s = self.life.live_authorized(tenant, session_id, token)
        if s is not None:
            return s
        record = await self.life.store.authorize_resume(tenant, session_id, token)
        if record.config.get("kind") != self.life.spec.name:
            raise SessionNotFound(session_id)
        shared = self.life.shared
        bound = await shared.binding.get(session_id)
        if bound is not None and bound.replica_id != shared.replica_id:
            if shared.claim is None:
                raise SessionElsewhere(bound)
            # Scale-out: `claim` binds it here only when its owner's lease has lapsed; what the
            # session held (a world's rolling context, a model's) died with that process: give
            # back its slot and record, and answer 404 as the gateway does.
            claimed = await shared.claim(session_id)
            if claimed.replica_id != shared.replica_id:
                raise SessionElsewhere(claimed)
            await self.life.release(session_id)
            await self.life.delete_record(session_id)
        raise SessionNotFound(session_id)

    async def end_or_detach(self, s: S, transport: object, cause: Callable[[], str | None]) -> None:
        """``transport``, a connection of ``s``, ended: unless the session is ending already or
        a resume replaced that connection, the session ends with ``cause()``, or (None) stays,
        detached (:meth:`detach`), for its grace."""
        async with s.lock:
            if s.ending or (s.opened and s.connection is not transport):
                return  # already ending, or replaced by a resume (one never opened ends here)
            s.connection = None
            why = cause()
            if why is None:
                self.detach(s)
                return
        await self.life.end(s, why)

    def detach(self, s: S) -> None:
        """``s`` lost its connection: the driver goes on without one, the grace starts."""
        s.driver.detach()
        self.life.detached(s)

    def live(self, tenant: str, session_id: str) -> S | None:
        return self.life.live(tenant, session_id)

    async def sweep(self) -> None:
        """One pass of retention over the live sessions (and retries of failed releases)."""
        await self.life.sweep()

    async def delete(self, tenant: str, session_id: str, *, cause: str = "deleted") -> None:
        """``DELETE /v1/sessions/{id}`` (or a WebRTC call's hangup, ``cause`` "hangup") of a
        session live here (else ``SessionNotFound``), attached or detached."""
        await self.life.delete(tenant, session_id, cause)

    def stats(self) -> dict[str, int]:
        """Live counters (back to zero once every session is gone)."""
        return self.life.stats()
