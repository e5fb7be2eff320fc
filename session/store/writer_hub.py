"""The writer hub: one task per store per process that flushes every started session writer
(:class:`~session.store.event_log.SessionWriter`) in one pipelined round trip per tick.

The hub sees a writer only through :class:`HubWriter` (when it is due, its ops, how its flush
ended), so it imports no writer; see :mod:`session.store.event_log` for when writers are due.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from session.store.aio import cancel_and_wait, wait_event
from session.store.errors import SessionGone, StaleEpoch, StoreError, StoreUnavailable, WriteRejected
from session.store.redis_store import MAX_OPS_PER_CALL, BatchOp, SessionBatch, SessionStore

log = logging.getLogger("session.store.event_log")

MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class HubWriter(Protocol):
    """A session writer as its hub flushes it (the flush protocol it shares with ``flush()``)."""

    session_id: str
    epoch: int
    expires_at: float
    interval: float  # its flush interval
    retry_at: float  # backing off after an error reply until then
    flushing: bool  # a flush of it is in flight

    @property
    def pending(self) -> int: ...

    def flush_due(self) -> float | None: ...

    def take(self, limit: int | None = None) -> list[BatchOp] | None: ...

    def settle_ok(self, durable_seq: int, *, round_trips: int) -> None: ...

    def settle_failed(self, *, retry_later: bool) -> None: ...

    def settle_fatal(self, exc: StoreError) -> None: ...

    def report_fatal(self, exc: StoreError) -> None: ...


class WriterHub:
    """Flushes every started writer of one store in one process, one pipeline per tick.

    Its task runs while at least one writer is registered: :meth:`register` starts it, the
    last :meth:`unregister` stops it (and waits for it), :meth:`aclose` stops it at shutdown.
    ``round_trips`` counts its :meth:`SessionStore.apply_batches` calls that got answers.
    """

    def __init__(self, store: SessionStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        # Weak: the registry (`for_store`) is keyed by the store; its writers hold it while
        # the hub has work, so a store no one holds goes, and its hub with it.
        self._store = weakref.ref(store)
        self.clock = clock
        self._writers: dict[HubWriter, None] = {}  # insertion-ordered set
        # When each writer is due, earliest first: (due, tiebreak, writer). Lazy: a writer
        # pushes a new entry whenever its due time may have moved earlier, and an entry whose
        # writer is now due later (or not at all, or gone) is corrected when it reaches the top.
        # So a tick costs the writers it looks at, not every writer of the process.
        self._heap: list[tuple[float, int, HubWriter]] = []
        self._tiebreak = itertools.count()
        self._longest_interval = 0.0  # of the writers registered so far: how far along looks
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._target = -math.inf  # when the sleeping task looks next; -inf: not asleep
        self.round_trips = 0
        self.failures = 0

    @property
    def store(self) -> SessionStore:
        store = self._store()
        if store is None:  # not reached while a writer (which holds its store) is registered
            raise RuntimeError("the writer hub's store is gone")
        return store

    @classmethod
    def for_store(cls, store: SessionStore) -> WriterHub:
        """The store's hub in this process, made on first use (the store does not hold it)."""
        hub = _HUBS.get(store)
        if hub is None:
            hub = _HUBS[store] = cls(store)
        return hub

    @classmethod
    async def close_for(cls, store: SessionStore) -> None:
        """Close the store's hub in this process, if it has one (its last host is closing)."""
        hub = _HUBS.pop(store, None)
        if hub is not None:
            await hub.aclose()

    @property
    def writers(self) -> int:
        return len(self._writers)

    def holds(self, writer: HubWriter) -> bool:
        return writer in self._writers

    # --- registration ------------------------------------------------------------------------

    def register(self, writer: HubWriter) -> None:
        self._writers[writer] = None
        self._longest_interval = max(self._longest_interval, writer.interval)
        if self._task is None or self._task.done():
            self._start_task()
        self.wake(writer)

    def discard(self, writer: HubWriter) -> None:
        """Stop flushing ``writer`` (a task with nothing left to flush then ends by itself)."""
        if writer in self._writers:
            del self._writers[writer]
            self.wake()

    async def unregister(self, writer: HubWriter) -> None:
        """Stop flushing ``writer``; the last one out waits for the hub's task to end."""
        self.discard(writer)
        if not self._writers:
            await self.aclose()
            if self._writers and self._task is None:  # one registered while the task stopped
                self._start_task()

    async def aclose(self) -> None:
        """Stop the task now (shutdown); a write in flight goes back to its writers' queues.

        Writers still registered are flushed again once a writer registers (or by their own
        ``flush()``/``close()``).
        """
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def _start_task(self) -> None:
        self._wake = asyncio.Event()  # bound to the loop the task runs on
        self._task = asyncio.create_task(self._run(), name=f"writer-hub:{self.store.prefix}")

    # --- signals from writers (sync, cheap) -----------------------------------------------------

    def wake(self, writer: HubWriter | None = None) -> None:
        """``writer`` may be due earlier than the hub knows (a state change, a full batch, back
        from a flush): look at it. Without one: look again (a writer left)."""
        if writer is None:
            if self._wake is not None:
                self._wake.set()
        elif (due := writer.flush_due()) is not None:
            self.schedule(writer, due)

    def schedule(self, writer: HubWriter, due: float) -> None:
        """``writer`` needs a write at ``due``: wake only if that is before the current target."""
        heap = self._heap
        if len(heap) > 4 * len(self._writers) + 64:
            self._compact()
        heapq.heappush(heap, (due, next(self._tiebreak), writer))
        if due < self._target and self._wake is not None:
            self._wake.set()

    def _compact(self) -> None:
        """One entry per writer with a write due (stale entries pile up under a busy writer)."""
        entries = [
            (due, next(self._tiebreak), w) for w in self._writers if (due := w.flush_due()) is not None
        ]
        heapq.heapify(entries)
        self._heap = entries

    # --- the task ------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = MIN_BACKOFF_S
        try:
            while self._writers:
                batch = await self._until_due()
                if not batch:
                    continue
                try:
                    await self._flush(batch)
                except Exception as exc:  # StoreUnavailable, or a bug: never end every session's log
                    self.failures += 1
                    level = logging.WARNING if isinstance(exc, StoreUnavailable) else logging.ERROR
                    log.log(
                        level,
                        "writer hub: flush of %d sessions failed, retrying in %.2fs: %r",
                        len(batch),
                        backoff,
                        exc,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
                else:
                    backoff = MIN_BACKOFF_S
        finally:
            self._target = -math.inf
            if self._task is asyncio.current_task():
                self._task = None

    async def _until_due(self) -> list[HubWriter]:
        """Sleep until the earliest writer deadline, waking early for an earlier one; return
        the writers to flush then: those due, and those queued and due within half their
        interval (they ride along on this tick's round trip; see the module docstring)."""
        wake = self._wake
        assert wake is not None
        while self._writers:
            wake.clear()  # cleared before the look: a signal after it is not lost
            heap = self._heap
            now = self.clock()
            batch: dict[HubWriter, None] = {}
            while heap:
                entry_due, _, w = heap[0]
                due = w.flush_due() if w in self._writers else None
                if due is None or w in batch:
                    heapq.heappop(heap)  # nothing to write, in flight, gone, or taken already
                elif due != entry_due:  # moved since: put it where it belongs now
                    heapq.heapreplace(heap, (due, next(self._tiebreak), w))
                elif due <= now:
                    heapq.heappop(heap)
                    batch[w] = None
                else:
                    break
            if batch:
                self._take_along(batch, now)
                return list(batch)
            target = heap[0][0] if heap else math.inf
            self._target = target
            try:
                if math.isinf(target):
                    await wake.wait()
                else:
                    await wait_event(wake, target - now)  # woken early or not: look again
            finally:
                self._target = -math.inf
        return []

    def _take_along(self, batch: dict[HubWriter, None], now: float) -> None:
        """Add the writers with events queued and due within half their interval."""
        heap = self._heap
        horizon = now + self._longest_interval / 2
        later: list[tuple[float, int, HubWriter]] = []
        while heap and heap[0][0] <= horizon:
            entry = heapq.heappop(heap)
            w = entry[2]
            due = w.flush_due() if w in self._writers else None
            if due is None or w in batch:
                continue
            if w.pending and w.retry_at <= now and due - now <= w.interval / 2:
                batch[w] = None
            else:
                later.append((due, entry[1], w))
        for entry in later:
            heapq.heappush(heap, entry)

    async def _flush(self, batch: list[HubWriter]) -> None:
        # One EVALSHA per session: a pipeline is not a transaction, so a session's second chunk
        # could land after its first failed, and the log would skip the first's events.
        claimed = [(w, ops) for w in batch if (ops := w.take(MAX_OPS_PER_CALL)) is not None]
        try:
            results: list[int | StoreError] = await self.store.apply_batches(
                [SessionBatch(w.session_id, ops, w.epoch, w.expires_at) for w, ops in claimed]
            )
        except (StoreUnavailable, asyncio.CancelledError):
            for w, _ in claimed:
                w.settle_failed(retry_later=False)
            raise
        except Exception as exc:  # one session's ops (e.g. a string Redis cannot encode)
            log.warning(
                "writer hub: a pipeline of %d sessions failed (%r): writing them one by one",
                len(claimed),
                exc,
            )
            results = await self._one_by_one(claimed)
        self.round_trips += 1
        for (w, _), result in zip(claimed, results, strict=True):
            try:
                self._settle(w, result)
            except Exception:  # a bug: never leave a writer in flight (its flush() would wait forever)
                log.exception("session %s: settling a flush failed", w.session_id)
                if w.flushing:
                    w.settle_failed(retry_later=True)

    async def _one_by_one(self, claimed: list[tuple[HubWriter, list[BatchOp]]]) -> list[int | StoreError]:
        """Each claimed writer's ops in a pipeline of its own: the writer whose ops raise gets
        :class:`WriteRejected` (fatal for it alone); the others are written as usual."""
        results: list[int | StoreError] = []
        for i, (w, ops) in enumerate(claimed):
            try:
                (result,) = await self.store.apply_batches(
                    [SessionBatch(w.session_id, ops, w.epoch, w.expires_at)]
                )
            except (StoreUnavailable, asyncio.CancelledError):
                for later, _ in claimed[i:]:
                    later.settle_failed(retry_later=False)
                for (done, _), res in zip(claimed[:i], results, strict=True):
                    self._settle(done, res)
                raise
            except Exception as exc:
                log.error("session %s: its log cannot be written: %r", w.session_id, exc)
                result = WriteRejected(w.session_id, exc)
            results.append(result)
        return results

    def _settle(self, w: HubWriter, result: int | StoreError) -> None:
        if isinstance(result, int):
            w.settle_ok(result, round_trips=1)
        elif isinstance(result, StaleEpoch | SessionGone | WriteRejected):
            registered = w in self._writers  # not if close() began meanwhile: it gets the error
            w.settle_fatal(result)
            if registered:
                w.report_fatal(result)
        else:
            w.settle_failed(retry_later=True)
            log.warning(
                "session %s: flush failed, retrying in %.2fs: %s",
                w.session_id,
                w.retry_at - self.clock(),
                result,
            )



# Each store's hub in this process (`WriterHub.for_store`); weak: a store that goes goes with it.
_HUBS: weakref.WeakKeyDictionary[SessionStore, WriterHub] = weakref.WeakKeyDictionary()
