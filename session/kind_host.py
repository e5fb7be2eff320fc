"""What the world, robot and GPT-Live hosts answer alike: each holds a
:class:`~session.lifecycle.SessionLifecycle` (its sessions, slots, retention) and is that
lifecycle's :class:`~session.lifecycle.KindHooks`; the calls below only hand over to it. A host
adds what its kind does differently (create, open, authorize, resume, its hooks, describe)."""

from __future__ import annotations

import asyncio
from typing import Generic

from session.lifecycle import S, SessionLifecycle


class KindHost(Generic[S]):
    """The sessions of one kind in this process, through their lifecycle (module docstring)."""

    def __init__(self, life: SessionLifecycle[S]) -> None:
        self.life = life
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
