"""Issue 13 on real Redis: one session's unwritable data never stalls the others' persistence,
and a session's event stream and queue are bounded in bytes, not only in entries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio

from session.store import SessionStore, SessionWriter, WriterHub
from session.store.errors import ReplayUnavailable, StoreError, WriteRejected

pytestmark = pytest.mark.system


async def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_a_session_whose_ops_cannot_be_encoded_fails_alone(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    await store.load_scripts()
    fatal: list[StoreError] = []
    bad_record, _ = await store.create_session("t")
    good_record, _ = await store.create_session("t")
    bad = SessionWriter(store, bad_record, flush_interval_s=0.01, on_fatal=fatal.append)
    good = SessionWriter(store, good_record, flush_interval_s=0.01)
    await bad.start()
    await good.start()
    # A raw lone surrogate (past any edge check): redis-py cannot encode the item id.
    bad.put_item({"id": "\ud800x", "type": "message"})
    good.put_item({"id": "item_ok", "type": "message"})
    sent = [good.append({"type": "x", "n": i}) for i in range(5)]
    await wait_until(lambda: bool(fatal) and good.pending == 0)
    assert isinstance(fatal[0], WriteRejected) and isinstance(bad.fatal, WriteRejected)
    assert [i["id"] for i in await store.list_items(good.session_id)] == ["item_ok"]
    assert await store.events_after(good.session_id, None) == sent
    later = good.append({"type": "after"})  # the hub goes on writing the good session
    await wait_until(lambda: good.pending == 0)
    assert (await store.events_after(good.session_id, None))[-1] == later
    await bad.close()  # never raises, whatever the writer hit
    await good.close()
    assert WriterHub.for_store(store).writers == 0


async def test_close_runs_after_a_direct_flush_raised(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    await store.load_scripts()
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, flush_interval_s=10.0)
    writer.put_item({"id": "\udfffbad", "type": "message"})
    try:
        await writer.flush()
    except WriteRejected:
        pass
    else:
        raise AssertionError("the unwritable op was accepted")
    await writer.close()  # returns: a release path after it runs


async def test_event_stream_is_bounded_in_bytes(redis_client: redis.asyncio.Redis) -> None:
    budget = 4 << 20
    store = SessionStore(redis_client, stream_maxlen=4096, log_max_bytes=budget)
    await store.load_scripts()
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, flush_interval_s=0.005)
    await writer.start()
    big = "r" * (1900 * 1024)  # the conversation.item.retrieve amplification: 1.9 MB per event
    for i in range(40):
        writer.append({"type": "conversation.item.retrieved", "n": i, "text": big})
        await asyncio.sleep(0)
    await wait_until(lambda: writer.pending == 0, timeout_s=20)
    stream = store.keys(record.session_id).events
    entries = await redis_client.xrange(stream)
    stored = sum(len(fields["e"]) for _, fields in entries)
    assert stored <= budget, f"{stored} bytes kept, budget {budget}"
    assert len(entries) >= 1 and entries[-1][0] == f"0-{writer.durable_seq}"  # the newest kept
    usage = await redis_client.memory_usage(stream)
    assert usage is not None and usage < 2 * budget, usage
    await writer.close()


async def test_queue_is_bounded_in_bytes_while_redis_is_away(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    await store.load_scripts()
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, max_pending_bytes=2 << 20)  # not started: nothing flushes
    for i in range(20):
        writer.append({"type": "big", "n": i, "text": "q" * (500 * 1024)})
    assert writer._pending_bytes <= 2 << 20 and writer.dropped_events >= 15
    writer.put_item({"id": "item_kept", "type": "message"})  # state is never dropped
    await writer.start()
    await wait_until(lambda: writer.pending == 0)
    assert [i["id"] for i in await store.list_items(record.session_id)] == ["item_kept"]
    await writer.close()


async def test_queue_stays_bounded_while_a_flush_is_in_flight(redis_client: redis.asyncio.Redis) -> None:
    """Redis slower than the session (a client sending thousands of events a second): the
    writer always has a flush in flight, and its queue still keeps to its bytes bound."""
    store = SessionStore(redis_client)
    await store.load_scripts()
    record, _ = await store.create_session("t")
    bound = 1 << 20
    writer = SessionWriter(store, record, max_pending_bytes=bound)  # not started: flushed by hand
    first = [writer.append({"type": "x", "n": i}) for i in range(3)]
    in_flight = writer.take()
    assert in_flight is not None and writer.flushing
    later = [writer.append({"type": "big", "n": i, "text": "q" * (100 * 1024)}) for i in range(30)]
    assert writer._pending_bytes <= bound and writer.dropped_events >= 20
    seq = await store.apply_batch(record.session_id, in_flight, epoch=0, expires_at=record.expires_at)
    writer.settle_ok(seq, round_trips=1)  # the ops in flight were kept, in order
    await writer.flush()
    assert await store.events_after(record.session_id, later[-2]["event_id"]) == later[-1:]
    with pytest.raises(ReplayUnavailable) as gap:  # the dropped ones: the client is resynced
        await store.events_after(record.session_id, first[-1]["event_id"])
    assert gap.value.reason == "gap"
    await writer.close()
