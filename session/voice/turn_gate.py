"""Admission at each turn: a per-replica bound on concurrently generating responses.

Sized to the pipeline's capacity, so a turn that would have been refused by the runtime at
once (`AdmissionError`) waits a little instead, in a short FIFO queue: up to `queue_limit`
turns for at most `wait_s` each. A turn that cannot start in time fails (the driver ends it
with `response.done` status `failed` and the reason). Pure asyncio, no Redis: it sits on the
per-turn path, never the per-frame one.
"""

from __future__ import annotations

import asyncio


class TurnRejected(Exception):
    """No generation slot in time (the reason is the message)."""


class TurnGate:
    def __init__(self, limit: int, *, queue_limit: int = 64, wait_s: float = 2.0) -> None:
        if limit < 1 or queue_limit < 0 or wait_s < 0:
            raise ValueError(f"bad turn gate: limit={limit} queue_limit={queue_limit} wait_s={wait_s}")
        self.limit = limit
        self.queue_limit = queue_limit
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(limit)
        self.generating = 0
        self.waiting = 0
        self.rejected = 0

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed; raises `TurnRejected`."""
        if not self._slots.locked():
            await self._slots.acquire()
            self.generating += 1
            return
        if self.waiting >= self.queue_limit:
            self.rejected += 1
            raise TurnRejected(f"server busy: {self.limit} responses generating and {self.waiting} waiting")
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait_s):
                await self._slots.acquire()
        except TimeoutError:
            self.rejected += 1
            raise TurnRejected(f"server busy: no generation slot within {self.wait_s:g} s") from None
        finally:
            self.waiting -= 1
        self.generating += 1

    async def try_acquire(self) -> bool:
        """Take a free slot at once, never queueing (a response started ahead of its turn)."""
        if self._slots.locked():
            return False
        await self._slots.acquire()  # free: does not wait
        self.generating += 1
        return True

    def release(self) -> None:
        self.generating -= 1
        self._slots.release()
