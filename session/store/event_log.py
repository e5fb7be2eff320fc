"""The per-session writer: buffers client-visible events and state changes, flushes them batched.

Hot path: :meth:`SessionWriter.append` is synchronous and does no I/O. It stamps the event's
``event_id`` (see :mod:`session.store.event_ids`), queues it and returns the stamped copy for
the driver to send at once. A background task owned by the writer flushes the queue with
:meth:`SessionStore.apply_batch`, i.e. **one EVALSHA round trip per flush** whatever the
number of events, when any of these happens first:

* ``flush_interval_s`` (default 25 ms) after the first unflushed event: audio deltas at 50/s
  cost ~2 round trips per 100 ms per session, not 5;
* ``max_batch_events`` (default 128) events are queued;
* a state change (:meth:`put_item`, :meth:`delete_item`, :meth:`set_state`,
  :meth:`set_config`): flushed at once, in order after the events queued before it, so a
  committed item is durable as soon as Redis answers;
* :meth:`flush` or :meth:`close` is awaited (close flushes what is left).

No Redis call per input audio frame: those never reach the writer. Activity without events
(:meth:`mark_activity`) refreshes the TTLs at most every ``touch_interval_s``.

Redis down: the live session keeps working; ops stay queued and flushes retry with backoff
(up to 2 s). The queue is bounded (``max_pending``): past it the oldest *events* are dropped
(never items or state); a later replay across them raises ``ReplayUnavailable("gap")`` and the
client is resynced from the snapshot. A flush that hits a stale epoch or a vanished session is
fatal: the writer stops and calls ``on_fatal`` (the driver ends the session locally).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from session.store.aio import cancel_and_wait, wait_event
from session.store.errors import SessionGone, StaleEpoch, StoreError, StoreUnavailable
from session.store.event_ids import StampedEvent, format_event_id, session_tag
from session.store.redis_store import MAX_OPS_PER_CALL, BatchOp, SessionRecord, SessionStore

log = logging.getLogger(__name__)


class SessionWriter:
    """One per live session per process (kept across reconnects of the same session)."""

    def __init__(
        self,
        store: SessionStore,
        record: SessionRecord,
        *,
        epoch: int = 0,
        flush_interval_s: float = 0.025,
        max_batch_events: int = 128,
        max_pending: int = 8192,
        touch_interval_s: float | None = None,
        on_fatal: Callable[[StoreError], None] | None = None,
    ) -> None:
        self.store = store
        self.session_id = record.session_id
        self.epoch = epoch
        self.expires_at = record.expires_at
        self._tag = session_tag(record.session_id)
        self._next_seq = record.event_seq + 1
        self.durable_seq = record.event_seq
        self._interval = flush_interval_s
        self._max_batch = max_batch_events
        self._max_pending = max_pending
        self._touch_interval = touch_interval_s or max(1.0, store.policy.idle_ttl_s / 4)
        self._on_fatal = on_fatal
        self._pending: deque[BatchOp] = deque()
        self._pending_events = 0
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._lock = asyncio.Lock()
        self._activity = False
        self._flushing = False
        self._task: asyncio.Task[None] | None = None
        self.fatal: StoreError | None = None
        self.dropped_events = 0
        self.flushes = 0
        self.round_trips = 0  # apply_batch calls (one EVALSHA each)

    # --- hot path (sync, no I/O) --------------------------------------------------------------

    def append(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Stamp ``event_id``, queue the event, return the stamped copy to send to the client."""
        seq = self._next_seq
        self._next_seq += 1
        stamped = StampedEvent(event)
        stamped["event_id"] = format_event_id(self._tag, self.epoch, seq)
        if self.fatal is None:
            stamped.wire = json.dumps(stamped, separators=(",", ":"))  # logged, and sent as is
            self._queue(("e", str(seq), stamped["event_id"], stamped.wire))
            self._pending_events += 1
            if self._pending_events >= self._max_batch:
                self._urgent.set()
        return stamped

    def mark_activity(self) -> None:
        """Client activity with no logged event (e.g. audio in); keeps the TTL fresh."""
        self._activity = True

    # --- state changes (flushed at once, in order) ----------------------------------------------

    def put_item(self, item: Mapping[str, Any], previous_item_id: str | None = None) -> None:
        """Create or replace a conversation item; new ids go after ``previous_item_id``.

        ``None`` appends, ``"root"`` inserts first (OpenAI Realtime semantics).
        """
        after = "" if previous_item_id is None else "^" if previous_item_id == "root" else previous_item_id
        self._queue(("i", str(item["id"]), json.dumps(item, separators=(",", ":")), after), urgent=True)

    def delete_item(self, item_id: str) -> None:
        self._queue(("d", item_id, "", ""), urgent=True)

    def set_state(self, state: str) -> None:
        self._queue(("m", "state", state, ""), urgent=True)

    def set_config(self, config: Mapping[str, Any]) -> None:
        self._queue(("m", "config", json.dumps(config, separators=(",", ":")), ""), urgent=True)

    def _queue(self, op: BatchOp, *, urgent: bool = False) -> None:
        if self.fatal is not None:
            return
        self._pending.append(op)
        if len(self._pending) > self._max_pending and not self._flushing:
            self._drop_oldest_event()
        self._dirty.set()
        if urgent:
            self._urgent.set()

    def _drop_oldest_event(self) -> None:
        for i, op in enumerate(self._pending):
            if op[0] == "e":
                del self._pending[i]
                self._pending_events -= 1
                self.dropped_events += 1
                return

    # --- flushing ----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Write everything queued so far; returns the number of ops written."""
        async with self._lock:
            if self.fatal is not None:
                raise self.fatal
            ops = list(self._pending)
            if not ops and not self._activity:
                return 0
            self._activity = False
            self._flushing = True
            try:
                calls = max(1, -(-len(ops) // MAX_OPS_PER_CALL))
                self.durable_seq = await self.store.apply_batch(
                    self.session_id, ops, epoch=self.epoch, expires_at=self.expires_at
                )
                self.round_trips += calls
            except (StaleEpoch, SessionGone) as exc:
                self.fatal = exc
                self._pending.clear()
                raise
            finally:
                self._flushing = False
            for _ in range(len(ops)):
                if self._pending.popleft()[0] == "e":
                    self._pending_events -= 1
            self.flushes += 1
            return len(ops)

    async def events_after(self, last_event_id: str | None) -> list[dict[str, Any]]:
        """Replay for a resume on this process: flush what is buffered, then read the stream."""
        await self.flush()
        return await self.store.events_after(self.session_id, last_event_id)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"session-writer:{self.session_id}")

    async def close(self, *, flush: bool = True) -> None:
        """Stop the flush task; flush what is left (best effort when Redis is down)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if flush and self.fatal is None:
            with contextlib.suppress(StoreError):
                await self.flush()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            await wait_event(self._dirty, self._touch_interval)
            if not self._dirty.is_set() and not self._activity:
                continue
            if not self._urgent.is_set():
                await wait_event(self._urgent, self._interval)
            self._dirty.clear()
            self._urgent.clear()
            try:
                await self.flush()
                backoff = 0.05
            except StoreUnavailable as exc:
                log.warning("session %s: flush failed, retrying in %.2fs: %s", self.session_id, backoff, exc)
                self._dirty.set()
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            except StoreError as exc:
                log.warning("session %s: writer stopped: %s", self.session_id, exc)
                if self._on_fatal is not None:
                    self._on_fatal(exc)
                return
