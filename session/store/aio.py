"""Small asyncio helpers for the store's owned background tasks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` up to ``timeout_s``; True if it is set.

    ``asyncio.timeout`` rather than ``wait_for``: on 3.11 ``wait_for`` can swallow a
    cancellation that races with the inner wait finishing.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel an owned task and wait for it to end.

    Cancels again while it runs: redis-py's asyncio client can swallow a cancellation that
    lands while a reply is being read (redis/redis-py#2028, #2551), and a single ``cancel()``
    would then leave the owner's close hanging on a task that went on looping.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled():
        task.exception()  # retrieved: the owner is closing, a late error has nowhere to go
