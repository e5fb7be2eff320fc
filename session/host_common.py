"""The small mechanics under :class:`~session.lifecycle.SessionLifecycle`: slot releases, the
sweeper loop, expiry text, tracked tasks.

Every kind of session (voice, world, robot) holds the same admission slots under the same
retention policy, so these live here once: releasing a slot (retried by the sweeper when
Redis was down), the one sweeper task per host woken early by its ``wake`` event, the message
an expired session's client is told, and tasks tracked until they finish. The hosts use them
through the lifecycle each composes, which owns the rest of their shared lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any

from session.admission import AdmissionController
from session.retention import RetentionPolicy, Verdict
from session.store.aio import cancel_and_wait, wait_event
from session.store.errors import StoreError


class SlotReleases:
    """Gives admission slots back; a release that failed (Redis down) is kept and retried."""

    def __init__(self, admission: AdmissionController) -> None:
        self.admission = admission
        self.pending: set[str] = set()  # admission releases to retry (Redis was down)

    async def release(self, session_id: str) -> None:
        try:
            await self.admission.release(session_id)
            self.pending.discard(session_id)
        except StoreError:
            self.pending.add(session_id)

    async def retry(self, live: Collection[str]) -> None:
        """Retry the failed releases of sessions no longer ``live`` (a live one holds its slot)."""
        for sid in list(self.pending):
            if sid not in live:
                await self.release(sid)

    def __len__(self) -> int:
        return len(self.pending)


async def sweep_forever(
    wake: asyncio.Event,
    period_s: Callable[[], float],
    sweep: Callable[[], Awaitable[None]],
    log: logging.Logger,
    what: str,
) -> None:
    """Run ``sweep`` every ``period_s()`` seconds, or sooner when ``wake`` is set; a failed
    pass is logged and the next one runs anyway (the sweeper must outlive Redis outages)."""
    while True:
        await wait_event(wake, period_s())
        wake.clear()
        try:
            await sweep()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s sweep failed", what)


def expiry_message(policy: RetentionPolicy, verdict: Verdict) -> str:
    """What the client of a session that hit its maximum lifetime or idle TTL is told."""
    if verdict is Verdict.LIFETIME_EXPIRED:
        minutes = round(policy.max_lifetime_s / 60)
        return f"Your session hit the maximum duration of {minutes} minutes."
    return f"Your session was idle for {round(policy.idle_ttl_s)} seconds."


def spawn(tasks: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """A task kept in ``tasks`` until it finishes (so shutdown can cancel and await it)."""
    task = asyncio.create_task(coro, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def cancel_tasks(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks one after the other, each awaited before the next (shutdown order)."""
    for task in tasks:
        await cancel_and_wait(task)
