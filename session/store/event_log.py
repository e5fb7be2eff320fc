"""The per-session writer: buffers client-visible events and state changes, flushes them batched.

Hot path: :meth:`SessionWriter.append` is synchronous and does no I/O. It stamps the event's
``event_id`` (see :mod:`session.store.event_ids`), queues it and returns the stamped copy for
the driver to send at once. A started writer is flushed by its store's
:class:`~session.store.writer_hub.WriterHub`, one per store per process: one task that
writes every due writer's ops with :meth:`SessionStore.apply_batches`, i.e. **one pipelined
round trip per tick for all the sessions of the process** (an EVALSHA each inside it), not one
per session. A writer is due, whichever comes first:

* ``flush_interval_s`` (default 100 ms) after its first unflushed event: audio deltas at
  25/s cost ~2.5 events per write per session, and one tick carries every writer that is due,
  so 200 such sessions cost tens of round trips a second rather than ~5,000;
* ``max_batch_events`` (default 128) events are queued;
* a state change (:meth:`put_item`, :meth:`delete_item`, :meth:`set_state`,
  :meth:`set_config`): the hub wakes at once, in order after the events queued before it, so a
  committed item is durable as soon as Redis answers;
* :meth:`flush` or :meth:`close` is awaited (close flushes what is left); these write just
  this session, with :meth:`SessionStore.apply_batch`.

The hub ticks on the earliest deadline and takes along every writer whose deadline is less
than half an interval away: the round trip is shared, and a writer's batch is still at least
half an interval of its events. (Taking every writer with anything queued made each tick that
a state change woke write every streaming session's one newest delta: at 200 sessions, one
EVALSHA per event, and the hub's share of the event loop doubled.)
No Redis call per input audio frame: those never reach the writer. Activity without events
(:meth:`mark_activity`) refreshes the TTLs at most every ``touch_interval_s``.

Held events: the store's ``held_event_types`` (audio deltas) are stamped and sent like any
other but kept here (:class:`~session.store.held_events.HeldEvents`: the PCM bytes, the JSON
around them once per response, rebuilt byte for byte on a replay), not queued for Redis: the
newest ``held_max_bytes`` of them (4 MiB), and
while the session is connected none older than ``held_window_s`` (55 s: how long a dead
connection can go unnoticed, the 20 s ping interval plus its 20 s timeout plus the 15 s a full
send buffer may wait); once it is detached (:meth:`set_state`), none made more than that
before it went, however long the resume takes (the disconnect grace bounds that). Their id is
the logged event they follow plus ``.<n>`` (:mod:`session.store.event_ids`), and
:meth:`replay` puts them back between the logged events for a resume on this process. A
resume on another process (restart, failover) replays every logged event, items and
transcripts included, without them, and says so (``Replay.held``).

Redis down: the live session keeps working; ops stay queued and the hub retries with backoff
(0.05 s doubling to 2 s). The queue is bounded (``max_pending`` ops, ``max_pending_bytes``
of event JSON, also while a flush is in flight: Redis slower than the session is the same
case): past it the oldest *events* not in flight are dropped (never items or state); a later
replay across them raises ``ReplayUnavailable("gap")`` and the client is resynced from the
snapshot. A flush that hits a stale epoch or a vanished session is fatal for that writer
alone: it stops and calls ``on_fatal`` (the driver ends the session locally); the other
sessions go on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from session import json_text
from session.store.errors import (
    ReplayUnavailable,
    SessionGone,
    StaleEpoch,
    StoreError,
    WriteRejected,
)
from session.store.event_ids import (
    StampedEvent,
    format_event_id,
    parse_event_id,
    session_tag,
)
from session.store.held_events import HeldEvents
from session.store.log_budget import LogBudget
from session.store.redis_store import MAX_OPS_PER_CALL, BatchOp, SessionRecord, SessionStore
from session.store.writer_hub import MAX_BACKOFF_S, MIN_BACKOFF_S, WriterHub

log = logging.getLogger(__name__)



class _Taken(NamedTuple):
    """What a flush took from the writer, put back if the write fails."""

    ops: list[BatchOp]
    urgent: bool
    due: float | None
    activity: bool


class Replay(NamedTuple):
    """What :meth:`SessionWriter.replay` found after a client's last event id.

    ``held``: whether the events kept in process (audio deltas) after that id are all in
    ``events``: ``"complete"``; ``"trimmed"``: some were past this process's bound (bytes or
    age) and are left out; ``"not_kept"``: the id is from before this writer had the session
    (a restart, a failover, or a session parked and restored) and whatever the earlier one
    held after it is gone (it may have held nothing).
    Every logged event after the id is in ``events`` in all three cases."""

    events: list[dict[str, Any]]
    held: str


class SessionWriter:
    """One per live session per process (kept across reconnects of the same session)."""

    def __init__(
        self,
        store: SessionStore,
        record: SessionRecord,
        *,
        epoch: int = 0,
        flush_interval_s: float = 0.1,
        max_batch_events: int = 128,
        max_pending: int = 8192,
        max_pending_bytes: int = 32 * 1024 * 1024,
        touch_interval_s: float | None = None,
        on_fatal: Callable[[StoreError], None] | None = None,
        hub: WriterHub | None = None,
    ) -> None:
        self.store = store
        self.session_id = record.session_id
        self.epoch = epoch
        self.expires_at = record.expires_at
        self._tag = session_tag(record.session_id)
        self._next_seq = record.event_seq + 1
        self.durable_seq = record.event_seq
        self.interval = flush_interval_s
        self._max_batch = max_batch_events
        self._max_pending = max_pending
        limits = store.writer_limits
        # Bytes, not only counts: queued event JSON while Redis is down (no more than the
        # stream's own budget: events past it would be trimmed as soon as they were written),
        # and that budget (entries past it are trimmed, oldest first, with a ``t`` op).
        self._max_pending_bytes = min(max_pending_bytes, limits.log_max_bytes or max_pending_bytes)
        self._pending_bytes = 0
        self._log = LogBudget(limits.log_max_bytes, limits.stream_maxlen)
        # Events kept in this process, not logged (``store.held_event_types``).
        self._held_types = limits.held_event_types
        self._held = HeldEvents(max_bytes=limits.held_max_bytes, window_s=limits.held_window_s)
        # The logged seq this writer began after: held events after it are this writer's; an
        # earlier process's (restart, failover) are not here. Until this writer logged an event
        # of its own, a held one is logged instead, so positions never repeat an earlier one's.
        self._origin = record.event_seq
        self._logged_own = False
        self._touch_interval = touch_interval_s or max(1.0, store.policy.idle_ttl_s / 4)
        self._on_fatal = on_fatal
        self._pending: deque[BatchOp] = deque()
        self._pending_events = 0
        self._activity = False
        # Hub scheduling (meaningful once started): when the hub must write us next.
        self._hub_choice = hub
        self._hub: WriterHub | None = None
        self._due: float | None = None  # flush_interval_s after the first unflushed op
        self._urgent = False  # a state change or a full batch: the hub's next tick, now
        self._last_write = 0.0
        self.retry_at = 0.0  # after an error reply for this session alone
        self._backoff = MIN_BACKOFF_S
        # One flush at a time, by the hub or by flush(): ``_flushing`` marks the one in flight
        # (the hub skips such a writer this tick), ``_lock`` queues direct flush() callers.
        self._lock = asyncio.Lock()
        self.flushing = False
        self._flush_done = asyncio.Event()
        self._flush_done.set()
        self._taken: _Taken | None = None
        self.fatal: StoreError | None = None
        self.dropped_events = 0
        self.flushes = 0
        # Round trips this writer took part in: a direct flush counts its EVALSHA calls, a hub
        # tick counts one (its pipeline is shared with the other sessions of the tick).
        self.round_trips = 0

    # --- hot path (sync, no I/O) --------------------------------------------------------------

    def append(self, event: Mapping[str, Any], logged: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Stamp ``event_id``, queue the event (or keep it here: a held type), return the
        stamped copy to send to the client. ``logged``: what to log in its place under the
        same id (a reference a replay resolves, e.g. session/voice/retrieved.py)."""
        if self._logged_own and event.get("type") in self._held_types:
            return self._hold(event)
        self._logged_own = True
        seq = self._next_seq
        self._next_seq += 1
        stamped = StampedEvent(event)
        stamped["event_id"] = format_event_id(self._tag, self.epoch, seq)
        if self.fatal is None:
            stamped.wire = json_text.dumps(stamped)  # logged, and sent as is
            text = stamped.wire
            if logged is not None:
                text = json_text.dumps({**logged, "event_id": stamped["event_id"]})
            self._pending_events += 1
            self._pending_bytes += len(text)
            op = ("e", str(seq), stamped["event_id"], text)
            self._queue(op, urgent=self._pending_events >= self._max_batch)
            trim_to = self._log.add(seq, len(text))
            if trim_to:  # past the stream's byte budget: the oldest go
                self._queue(("t", str(trim_to), "", ""))
            while self._pending_bytes > self._max_pending_bytes and self._pending_events > 1:
                if not self._drop_oldest_event():
                    break
        return stamped

    def _hold(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Keep the event in this process only (see :class:`HeldEvents` for its bounds)."""
        stamped = self._held.hold(event, tag=self._tag, epoch=self.epoch, seq=self._next_seq - 1)
        self.mark_activity()  # not logged, but the session is active: keep its keys alive
        return stamped

    @property
    def held_bytes(self) -> int:
        """Bytes kept in this process for a resume here: the held audio deltas' PCM, and the
        JSON around it once per response (:attr:`HeldEvents.nbytes`)."""
        return self._held.nbytes

    @property
    def held_dropped(self) -> int:
        """Held events that left past a bound (bytes or age)."""
        return self._held.dropped

    def mark_activity(self) -> None:
        """Client activity with no logged event (e.g. audio in); keeps the TTL fresh."""
        if not self._activity:  # called per input frame: only the first one since a write counts
            self._activity = True
            if self._hub is not None and not self._pending:
                self._hub.schedule(self, self._last_write + self._touch_interval)

    # --- state changes (flushed at once, in order) ----------------------------------------------

    def put_item(self, item: Mapping[str, Any], previous_item_id: str | None = None) -> None:
        """Create or replace a conversation item; new ids go after ``previous_item_id``.

        ``None`` appends, ``"root"`` inserts first (OpenAI Realtime semantics).
        """
        after = "" if previous_item_id is None else "^" if previous_item_id == "root" else previous_item_id
        self._queue(("i", str(item["id"]), json_text.dumps(item), after), urgent=True)

    def delete_item(self, item_id: str) -> None:
        self._queue(("d", item_id, "", ""), urgent=True)

    def set_state(self, state: str) -> None:
        """The session's state (``active``, ``detached``, ``parked``...). While ``detached``,
        held events are kept from ``held_window_s`` before the connection went on, for the
        resume to replay (see the module doc)."""
        self._held.set_detached(state == "detached")
        self._queue(("m", "state", state, ""), urgent=True)

    def set_config(self, config: Mapping[str, Any]) -> None:
        self._queue(("m", "config", json_text.dumps(config), ""), urgent=True)

    def set_open_response(self, response: Mapping[str, Any] | None) -> None:
        """The response in progress (``{"id", "audio"}``), or None once it ended: a restore
        after this process dies ends it for the client even if it had no output yet."""
        value = json_text.dumps(response) if response else ""
        self._queue(("m", "response", value, ""), urgent=True)

    def _queue(self, op: BatchOp, *, urgent: bool = False) -> None:
        if self.fatal is not None:
            return
        self._pending.append(op)
        if len(self._pending) > self._max_pending:
            self._drop_oldest_event()
        hub = self._hub
        if urgent and not self._urgent:
            self._urgent = True
            if hub is not None:
                hub.wake(self)
        if self._due is None and hub is not None:
            self._due = hub.clock() + self.interval
            hub.schedule(self, self._due)

    def _drop_oldest_event(self) -> bool:
        """Drop the oldest queued event not in a flush in flight (those are the first ops of
        ``_pending``, popped by position when Redis answers). Skipping them, rather than
        dropping nothing while a flush is in flight, keeps the bound when Redis is slower than
        the session: a client sending thousands of events a second kept a writer always in
        flight and its queue grew past 10 MB over its 4 MiB bound (issue 33)."""
        pending = self._pending
        in_flight = len(self._taken.ops) if self._taken is not None else 0
        newest = len(pending) - 1  # the newest event stays (a trim op may follow it)
        while newest > in_flight and pending[newest][0] != "e":
            newest -= 1
        for i, op in enumerate(itertools.islice(pending, in_flight, newest), start=in_flight):
            if op[0] == "e":
                del pending[i]
                self._pending_events -= 1
                self._pending_bytes -= len(op[3])
                self.dropped_events += 1
                return True
        return False

    # --- flushing ----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> int:
        """Write everything queued so far (after a hub write in flight); returns the ops written."""
        async with self._lock:
            while self.flushing:  # the hub has our ops in its pipeline: let it answer first
                await self._flush_done.wait()
            if self.fatal is not None:
                raise self.fatal
            ops = self.take()
            if ops is None:
                return 0
            try:
                seq = await self.store.apply_batch(
                    self.session_id, ops, epoch=self.epoch, expires_at=self.expires_at
                )
            except (StaleEpoch, SessionGone) as exc:
                registered = self._hub is not None and self._hub.holds(self)  # not once close() began
                self.settle_fatal(exc)
                if registered:  # callers of flush() may swallow the error: the session must still end
                    self.report_fatal(exc)
                raise
            except StoreError:
                self.settle_failed(retry_later=False)
                raise
            except Exception as exc:  # not Redis: these ops can never be written (see WriteRejected)
                rejected = WriteRejected(self.session_id, exc)
                registered = self._hub is not None and self._hub.holds(self)
                self.settle_fatal(rejected)
                if registered:
                    self.report_fatal(rejected)
                raise rejected from exc
            except BaseException:
                self.settle_failed(retry_later=False)
                raise
            self.settle_ok(seq, round_trips=max(1, -(-len(ops) // MAX_OPS_PER_CALL)))
            return len(ops)

    async def replay(self, last_event_id: str | None) -> Replay:
        """The session's events after ``last_event_id`` for a resume on this process, in order:
        flush what is buffered, read the logged ones from the stream (one round trip), and put
        the held ones between them. Raises what ``SessionStore.events_after`` raises, and
        ``ReplayUnavailable("unknown_event_id")`` for a held id this writer never made."""
        ref = parse_event_id(last_event_id) if last_event_id else None
        after = ref.position if ref is not None else (0, 0)
        if ref is not None and ref.held and ref.seq > self._origin and ref.held >= self._held.next:
            raise ReplayUnavailable(self.session_id, last_event_id, "unknown_event_id")
        await self.flush()
        logged = await self.store.events_after(self.session_id, last_event_id)
        # Held events up to the last logged one read: a later logged event was appended after
        # the flush, so it and the held ones after it reach the client live (see serve_resume).
        through = _logged_seq(logged[-1]) if logged else after[0]
        events = self._held.merge(logged, after, through, _logged_seq)
        if self._origin and after[0] <= self._origin:
            held = "not_kept"
        elif self._held.dropped_position > after:
            held = "trimmed"
        else:
            held = "complete"
        return Replay(events, held)

    async def start(self) -> None:
        """Hand the writer to its hub (the store's unless one was given), which flushes it."""
        if self._hub is not None:
            return
        hub = self._hub_choice or WriterHub.for_store(self.store)
        self._hub = hub
        self._last_write = hub.clock()
        if self._pending and self._due is None:
            self._due = hub.clock()  # queued before start: due now
        hub.register(self)

    async def close(self, *, flush: bool = True) -> None:
        """Leave the hub; flush what is left (best effort when Redis is down)."""
        hub, self._hub = self._hub, None
        if hub is not None:
            await hub.unregister(self)
        if flush and self.fatal is None:
            try:
                await self.flush()
            except StoreError as exc:
                log.debug("session %s: final flush failed: %s", self.session_id, exc)
            except Exception as exc:  # whatever it raised, the caller's release paths must run
                log.warning("session %s: final flush failed: %r", self.session_id, exc)

    # --- the flush protocol, shared by flush() and the hub -----------------------------------

    def flush_due(self) -> float | None:
        """When the hub must write this writer next; ``None``: nothing to write, or not now."""
        if self.fatal is not None or self.flushing:
            return None
        if self._pending:
            due = -math.inf if self._urgent or self._due is None else self._due
        elif self._activity:
            due = self._last_write + self._touch_interval
        else:
            return None
        return max(due, self.retry_at)

    def take(self, limit: int | None = None) -> list[BatchOp] | None:
        """Start a flush: the ops to write (possibly none: a TTL touch), or None if idle.
        `limit`: at most that many (the rest is due at once, for the next flush)."""
        if not self._pending and not self._activity:
            return None
        # Stay queued until Redis answers: a failure loses nothing.
        ops = list(self._pending) if limit is None else list(itertools.islice(self._pending, limit))
        self._taken = _Taken(ops, self._urgent, self._due, self._activity)
        self._urgent, self._due, self._activity = False, None, False
        self.flushing = True
        self._flush_done.clear()
        return ops

    def settle_ok(self, durable_seq: int, *, round_trips: int) -> None:
        taken = self._end_flight()
        for _ in range(len(taken.ops)):
            op = self._pending.popleft()
            if op[0] == "e":
                self._pending_events -= 1
                self._pending_bytes -= len(op[3])
        self.durable_seq = durable_seq
        self.flushes += 1
        self.round_trips += round_trips
        self._backoff, self.retry_at = MIN_BACKOFF_S, 0.0
        if self._hub is not None:
            self._last_write = self._hub.clock()
        self._wake_hub_if_dirty()

    def settle_failed(self, *, retry_later: bool) -> None:
        """Put the flush back: its ops are still queued; the due time and flags come back."""
        taken = self._end_flight()
        self._urgent = self._urgent or taken.urgent
        self._activity = self._activity or taken.activity
        if taken.due is not None:
            self._due = taken.due if self._due is None else min(self._due, taken.due)
        hub = self._hub
        if hub is not None:
            now = hub.clock()
            if self._pending and self._due is None:
                self._due = now
            if retry_later:  # an error reply for this session alone: back off this writer
                self.retry_at = now + self._backoff
                self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)
        self._wake_hub_if_dirty()

    def settle_fatal(self, exc: StoreError) -> None:
        self._end_flight()
        self.fatal = exc
        self._pending.clear()
        self._pending_events = 0
        self._pending_bytes = 0
        if self._hub is not None:
            self._hub.discard(self)

    def _end_flight(self) -> _Taken:
        taken, self._taken = self._taken, None
        assert taken is not None, "settled a flush that was not taken"
        self.flushing = False
        self._flush_done.set()
        return taken

    def _wake_hub_if_dirty(self) -> None:
        if self._hub is not None and (self._pending or self._activity):
            self._hub.wake(self)  # it may have skipped us while we were in flight

    def report_fatal(self, exc: StoreError) -> None:
        log.warning("session %s: writer stopped: %s", self.session_id, exc)
        if self._on_fatal is not None:
            try:
                self._on_fatal(exc)
            except Exception:  # one session's callback must not stop the hub for all others
                log.exception("session %s: on_fatal failed", self.session_id)


def _logged_seq(event: Mapping[str, Any]) -> int:
    ref = parse_event_id(str(event.get("event_id", "")))
    return ref.seq if ref is not None else 0
