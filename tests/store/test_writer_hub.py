"""Writer hub: one pipelined round trip per tick for every session of the process, on real Redis.

Round trips are counted two ways: a store subclass that records each ``apply_batches`` call
(the real method runs), and Redis' own ``INFO commandstats`` (EVALSHA calls, no SCRIPT EXISTS).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from session.store import SessionBatch, SessionRecord, SessionStore, SessionWriter, WriterHub
from session.store.embedded import find_redis_server
from session.store.errors import SessionGone, StaleEpoch, StoreError, StoreUnavailable
from session.store.redis_store import MAX_OPS_PER_CALL, BatchOp

pytestmark = pytest.mark.system


class CountingStore(SessionStore):
    """The real store, recording which sessions each pipelined write carried."""

    def __init__(self, client: redis.asyncio.Redis, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.pipelines: list[list[str]] = []
        self.op_counts: list[list[int]] = []
        self.single_writes = 0

    async def apply_batches(self, batches: Sequence[SessionBatch]) -> list[int | StoreError]:
        self.pipelines.append([b.session_id for b in batches])
        self.op_counts.append([len(b.ops) for b in batches])
        return await super().apply_batches(batches)

    async def apply_batch(
        self, session_id: str, ops: Sequence[BatchOp], *, epoch: int = 0, expires_at: float
    ) -> int:
        self.single_writes += 1
        return await super().apply_batch(session_id, ops, epoch=epoch, expires_at=expires_at)


@pytest.fixture
async def store(redis_client: redis.asyncio.Redis) -> CountingStore:
    s = CountingStore(redis_client, stream_maxlen=10_000)
    await s.load_scripts()
    return s


async def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def commandstats(client: redis.asyncio.Redis) -> dict[str, int]:
    info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def new_writers(store: SessionStore, n: int, **kwargs: Any) -> list[SessionWriter]:
    writers = []
    for _ in range(n):
        record, _ = await store.create_session("t")
        writers.append(SessionWriter(store, record, **kwargs))
    return writers


def hub_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("writer-hub") and not t.done()]


async def test_many_writers_share_one_round_trip(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    writers = await new_writers(store, 20, flush_interval_s=0.05)
    for w in writers:
        await w.start()
    hub = WriterHub.for_store(store)
    assert hub.writers == 20 and len(hub_tasks()) == 1  # one task for all sessions, not 20
    await redis_client.config_resetstat()
    sent = {w.session_id: [w.append({"type": "x", "n": i}) for i in range(10)] for w in writers}
    await wait_until(lambda: all(w.pending == 0 for w in writers))
    assert len(store.pipelines) == 1 and len(store.pipelines[0]) == 20
    assert store.single_writes == 0
    stats = await commandstats(redis_client)
    assert stats["evalsha"] == 20  # one script call per session, all in the one pipeline
    assert "script|exists" not in stats and "script|load" not in stats  # no extra round trip
    assert hub.round_trips == 1 and all(w.round_trips == 1 and w.flushes == 1 for w in writers)
    for w in writers:
        assert w.durable_seq == 10
        assert await store.events_after(w.session_id, None) == sent[w.session_id]
    for w in writers:
        await w.close()
    assert hub_tasks() == [] and hub.writers == 0


async def test_ticks_on_earliest_deadline_and_takes_the_nearly_due_along(store: CountingStore) -> None:
    slow, ripe, fast = await new_writers(store, 3)
    slow.interval, ripe.interval, fast.interval = 10.0, 1.0, 0.05  # fast's deadline drives the tick
    for w in (slow, ripe, fast):
        await w.start()
    slow.append({"type": "slow"})
    ripe.append({"type": "ripe"})
    await asyncio.sleep(0.6)  # ripe's deadline is now 0.4 s away: under half its interval
    fast.append({"type": "fast"})
    await wait_until(lambda: fast.pending == 0, timeout_s=2.0)
    assert ripe.pending == 0  # rode along before its own deadline
    assert slow.pending == 1  # nowhere near its deadline: not written for one event
    # one round trip for both (the order of sessions inside a pipeline means nothing)
    assert [sorted(p) for p in store.pipelines] == [sorted([ripe.session_id, fast.session_id])]
    for w in (slow, ripe, fast):
        await w.close()


async def test_state_change_is_flushed_at_once_with_the_nearly_due(store: CountingStore) -> None:
    a, b, fresh, idle = await new_writers(store, 4, flush_interval_s=10.0)  # the timer would never fire
    b.interval = 1.0
    for w in (a, b, fresh, idle):
        await w.start()
    b.append({"type": "x"})
    await asyncio.sleep(0.6)  # b's deadline is 0.4 s away: under half its interval
    fresh.append({"type": "y"})
    a.put_item({"id": "item_1", "type": "message"})
    a.set_state("detached")
    t0 = time.monotonic()
    await wait_until(lambda: a.pending == 0 and b.pending == 0, timeout_s=2.0)
    assert time.monotonic() - t0 < 1.0
    # The idle writer had nothing; the fresh one's one event waits for its own deadline (a tick
    # that a state change woke does not write every session's newest event on its own).
    assert [sorted(p) for p in store.pipelines] == [sorted([a.session_id, b.session_id])]
    assert fresh.pending == 1
    snap = await store.load_snapshot("t", a.session_id)
    assert snap.record.state == "detached" and [i["id"] for i in snap.items] == ["item_1"]
    for w in (a, b, fresh, idle):
        await w.close()


async def test_full_batch_wakes_the_hub(store: CountingStore) -> None:
    (w,) = await new_writers(store, 1, flush_interval_s=10.0, max_batch_events=8)
    await w.start()
    sent = [w.append({"type": "x", "n": i}) for i in range(8)]
    await wait_until(lambda: w.pending == 0, timeout_s=2.0)
    assert await store.events_after(w.session_id, None) == sent
    await w.close()


async def test_stale_epoch_of_one_writer_spares_the_others(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    fenced, gone, healthy = await new_writers(store, 3, flush_interval_s=0.02)
    fenced.epoch = 1
    await redis_client.hset(store.keys(fenced.session_id).owner, "epoch", "2")  # another replica took it
    fatal: dict[str, list[StoreError]] = {fenced.session_id: [], gone.session_id: []}
    fenced._on_fatal = fatal[fenced.session_id].append
    gone._on_fatal = fatal[gone.session_id].append
    for w in (fenced, gone, healthy):
        await w.start()
    await store.delete_session(gone.session_id)
    first = [healthy.append({"type": "h", "n": 0})]
    fenced.append({"type": "zombie"})
    gone.append({"type": "late"})
    await wait_until(lambda: healthy.pending == 0 and fenced.fatal is not None and gone.fatal is not None)
    assert len(store.pipelines) == 1 and len(store.pipelines[0]) == 3  # all three in one round trip
    assert [type(e) for e in fatal[fenced.session_id]] == [StaleEpoch]  # called exactly once
    assert [type(e) for e in fatal[gone.session_id]] == [SessionGone]
    hub = WriterHub.for_store(store)
    assert hub.writers == 1  # the fatal writers left the hub
    first.append(healthy.append({"type": "h", "n": 1}))  # the healthy session goes on
    await wait_until(lambda: healthy.pending == 0)
    assert await store.events_after(healthy.session_id, None) == first
    assert await store.events_after(fenced.session_id, None) == []  # the zombie write never landed
    with pytest.raises(StaleEpoch):
        await fenced.flush()
    for w in (fenced, gone, healthy):
        await w.close()
    assert sum(len(v) for v in fatal.values()) == 2
    assert hub_tasks() == []


async def test_error_reply_for_one_session_is_retried_not_fatal(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    broken, fine = await new_writers(store, 2, flush_interval_s=0.01)
    events_key = store.keys(broken.session_id).events
    await redis_client.set(events_key, "not a stream")  # XADD fails: WRONGTYPE for this session only
    fatal: list[StoreError] = []
    broken._on_fatal = fatal.append
    for w in (broken, fine):
        await w.start()
    sent = [broken.append({"type": "x", "n": i}) for i in range(3)]
    fine_sent = [fine.append({"type": "y"})]
    await wait_until(lambda: fine.pending == 0 and len(store.pipelines) >= 2)
    assert broken.pending == 3 and broken.fatal is None and fatal == []  # kept, retried with backoff
    await redis_client.delete(events_key)
    await wait_until(lambda: broken.pending == 0)
    assert await store.events_after(broken.session_id, None) == sent
    assert await store.events_after(fine.session_id, None) == fine_sent
    for w in (broken, fine):
        await w.close()


async def test_apply_batches_maps_results_per_session(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    ok, stale, wrongtype = [(await store.create_session("t"))[0] for _ in range(3)]
    await redis_client.hset(store.keys(stale.session_id).owner, "epoch", "5")
    await redis_client.set(store.keys(wrongtype.session_id).events, "x")
    ev: list[BatchOp] = [("e", "1", "event_x_0_1", '{"n":1}')]
    results = await store.apply_batches(
        [
            SessionBatch(ok.session_id, ev, 0, ok.expires_at),
            SessionBatch(stale.session_id, ev, 4, stale.expires_at),
            SessionBatch(wrongtype.session_id, ev, 0, wrongtype.expires_at),
            SessionBatch("sess_gone000000000000", ev, 0, ok.expires_at),
        ]
    )
    assert results[0] == 1
    assert isinstance(results[1], StaleEpoch) and results[1].current == 5
    assert isinstance(results[2], StoreUnavailable) and "WRONGTYPE" in str(results[2])
    assert isinstance(results[3], SessionGone)
    assert await store.apply_batches([]) == []


async def test_noscript_after_script_flush(store: CountingStore, redis_client: redis.asyncio.Redis) -> None:
    writers = await new_writers(store, 3, flush_interval_s=0.01)
    for w in writers:
        await w.start()
    await redis_client.script_flush()  # as after a Redis restart
    await redis_client.config_resetstat()
    sent = {w.session_id: [w.append({"type": "x", "n": i}) for i in range(4)] for w in writers}
    await wait_until(lambda: all(w.pending == 0 for w in writers))
    assert all(w.fatal is None for w in writers)
    stats = await commandstats(redis_client)
    assert stats["script|load"] == 1 and stats["evalsha"] == 6  # bounced once each, then applied
    for w in writers:
        assert await store.events_after(w.session_id, None) == sent[w.session_id]
        await w.close()


async def test_noscript_with_chunked_batches_keeps_order(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    big, small = [(await store.create_session("t"))[0] for _ in range(2)]
    n = MAX_OPS_PER_CALL * 2 + 10  # three chunks, whose order matters
    big_ops: list[BatchOp] = [("e", str(i), f"event_b_0_{i}", f'{{"n":{i}}}') for i in range(1, n + 1)]
    small_ops: list[BatchOp] = [("e", "1", "event_s_0_1", '{"n":1}'), ("m", "state", "detached", "")]
    await redis_client.script_flush()
    await redis_client.config_resetstat()
    results = await store.apply_batches(
        [
            SessionBatch(big.session_id, big_ops, 0, big.expires_at),
            SessionBatch(small.session_id, small_ops, 0, small.expires_at),
        ]
    )
    assert results == [n, 1]
    stats = await commandstats(redis_client)
    assert stats["script|load"] == 1 and stats["evalsha"] == 4  # loaded up front: nothing bounced
    replay = await store.events_after(big.session_id, None)
    assert [e["n"] for e in replay] == list(range(1, n + 1))
    assert (await store.get_session("t", small.session_id)).state == "detached"


# --- Redis down, then back --------------------------------------------------------------------


class RestartableRedis:
    """A redis-server on a fixed loopback port with an AOF, to stop and start again."""

    def __init__(self, data_dir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *(
                    find_redis_server(),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.data_dir),
                ),
                *("--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the AOF is complete on disk
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
async def restartable(tmp_path: Path) -> AsyncIterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_redis_down_then_back_loses_nothing(restartable: RestartableRedis) -> None:
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
        restartable.url, decode_responses=True, socket_connect_timeout=0.5, socket_timeout=2.0
    )
    try:
        store = CountingStore(client)
        await store.load_scripts()
        fatal: list[StoreError] = []
        writers = await new_writers(store, 5, flush_interval_s=0.01, on_fatal=fatal.append)
        for w in writers:
            await w.start()
        sent: dict[str, list[dict[str, Any]]] = {w.session_id: [] for w in writers}
        for i in range(3):
            for w in writers:
                sent[w.session_id].append(w.append({"type": "before", "n": i}))
        await wait_until(lambda: all(w.pending == 0 for w in writers))

        restartable.stop()
        for i in range(20):
            for w in writers:
                sent[w.session_id].append(w.append({"type": "during", "n": i}))
            writers[0].put_item({"id": f"item_{i}", "type": "message"})  # urgent: wakes the hub
            await asyncio.sleep(0.01)
        hub = WriterHub.for_store(store)
        await wait_until(lambda: hub.failures >= 2)  # it kept trying, with backoff
        assert all(w.pending > 0 and w.fatal is None for w in writers)

        restartable.start()  # the AOF brings the sessions back; the scripts are gone (NOSCRIPT)
        await wait_until(lambda: all(w.pending == 0 for w in writers), timeout_s=10.0)
        assert fatal == [] and all(w.dropped_events == 0 for w in writers)
        for w in writers:
            assert await store.events_after(w.session_id, None) == sent[w.session_id]
        assert len(await store.list_items(writers[0].session_id)) == 20
        for w in writers:
            await w.close()
        assert hub_tasks() == []
    finally:
        await client.aclose()


async def test_outage_bound_drops_oldest_events_under_the_hub(restartable: RestartableRedis) -> None:
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
        restartable.url, decode_responses=True, socket_connect_timeout=0.5
    )
    try:
        store = SessionStore(client)
        (w,) = await new_writers(store, 1, flush_interval_s=0.01, max_pending=5)
        await w.start()
        restartable.stop()
        sent = [w.append({"type": "x", "n": i}) for i in range(8)]
        w.put_item({"id": "item_1", "type": "message"})  # never dropped
        assert w.dropped_events == 4 and w.pending == 5
        await asyncio.sleep(0.1)
        restartable.start()
        await wait_until(lambda: w.pending == 0, timeout_s=10.0)
        assert await store.events_after(w.session_id, sent[-2]["event_id"]) == sent[-1:]
        assert [i["id"] for i in await store.list_items(w.session_id)] == ["item_1"]
        await w.close()
    finally:
        await client.aclose()


# --- direct flushes, touches, lifecycle -------------------------------------------------------


async def test_direct_flushes_race_the_hub_without_loss_or_duplicates(store: CountingStore) -> None:
    writers = await new_writers(store, 6, flush_interval_s=0.002, max_batch_events=7)
    for w in writers:
        await w.start()
    sent: dict[str, list[dict[str, Any]]] = {w.session_id: [] for w in writers}

    async def drive(w: SessionWriter, k: int) -> None:
        for i in range(120):
            sent[w.session_id].append(w.append({"type": "x", "n": i}))
            if i % 5 == k % 5:
                w.put_item({"id": f"item_{i}", "type": "message"})
            if i % 9 == k % 9:
                await w.flush()  # concurrently with the hub's ticks
            elif i % 3 == 0:
                await asyncio.sleep(0.001)

    async with asyncio.TaskGroup() as tg:
        for k, w in enumerate(writers):
            tg.create_task(drive(w, k))
    for w in writers:
        await w.close()
    assert store.single_writes > 0 and len(store.pipelines) > 1
    for w in writers:
        assert w.pending == 0 and w.durable_seq == 120
        assert await store.events_after(w.session_id, None) == sent[w.session_id]


async def test_replay_flushes_first(store: CountingStore) -> None:
    (w,) = await new_writers(store, 1, flush_interval_s=10.0)
    await w.start()
    sent = [w.append({"type": "x", "n": i}) for i in range(3)]
    assert (await w.replay(sent[0]["event_id"])).events == sent[1:]
    assert w.pending == 0
    await w.close()


async def test_activity_touches_at_most_every_touch_interval(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    (w,) = await new_writers(store, 1, touch_interval_s=0.1)
    await w.start()
    meta = store.keys(w.session_id).meta
    before = float(await redis_client.hget(meta, "last_active") or 0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.45:
        w.mark_activity()  # per input audio frame
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.15)  # the last activity's touch
    assert 3 <= w.flushes <= 6 and w.pending == 0  # ~every 0.1 s, not per frame (45 marks)
    assert float(await redis_client.hget(meta, "last_active") or 0) > before
    flushes = w.flushes
    await asyncio.sleep(0.25)  # no activity, no writes
    assert w.flushes == flushes
    await w.close()


async def test_hub_stops_with_its_last_writer_and_restarts(store: CountingStore) -> None:
    a, b = await new_writers(store, 2)
    hub = WriterHub.for_store(store)
    assert WriterHub.for_store(store) is hub
    await a.start()
    await b.start()
    await a.close()
    assert len(hub_tasks()) == 1
    await b.close()
    assert hub_tasks() == []
    await a.start()  # a writer can be started again (e.g. the session is resumed here)
    a.set_state("active")
    await wait_until(lambda: a.pending == 0)
    assert len(hub_tasks()) == 1
    await a.close()
    assert hub_tasks() == []


async def test_hub_aclose_at_shutdown_puts_work_back(store: CountingStore) -> None:
    (w,) = await new_writers(store, 1, flush_interval_s=10.0)
    await w.start()
    sent = [w.append({"type": "x"})]
    hub = WriterHub.for_store(store)
    await hub.aclose()
    assert hub_tasks() == [] and w.pending == 1
    await w.close()  # the final flush writes it directly
    assert await store.events_after(w.session_id, None) == sent


async def test_writer_given_its_own_hub(store: CountingStore) -> None:
    record: SessionRecord = (await store.create_session("t"))[0]
    hub = WriterHub(store)
    w = SessionWriter(store, record, hub=hub, flush_interval_s=0.01)
    await w.start()
    assert hub.writers == 1 and WriterHub.for_store(store).writers == 0
    w.append({"type": "x"})
    await wait_until(lambda: w.pending == 0)
    assert hub.round_trips == 1
    await w.close()


async def test_a_direct_flush_that_finds_the_session_fenced_ends_it(
    store: CountingStore, redis_client: redis.asyncio.Redis
) -> None:
    """Callers of flush() (describe, a resume's replay) may swallow the error: the writer must
    still report it, or the session would run on with a dead log."""
    (w,) = await new_writers(store, 1, flush_interval_s=10.0)
    fatal: list[StoreError] = []
    w._on_fatal = fatal.append
    await w.start()
    w.epoch = 1
    await redis_client.hset(store.keys(w.session_id).owner, "epoch", "2")
    w.append({"type": "zombie"})
    with pytest.raises(StaleEpoch):
        await w.flush()
    assert [type(e) for e in fatal] == [StaleEpoch]
    assert not WriterHub.for_store(store).holds(w)
    await w.close()
    assert len(fatal) == 1


async def test_the_hub_sends_one_chunk_per_session_per_tick(store: CountingStore) -> None:
    """A pipeline is not a transaction: a session's second chunk must never ride with its first
    (it could land after the first failed, and the log would skip the first's events)."""
    (w,) = await new_writers(store, 1, flush_interval_s=0.01, max_pending=10 * MAX_OPS_PER_CALL)
    n = 2 * MAX_OPS_PER_CALL + 5
    sent = [w.append({"type": "x", "n": i}) for i in range(n)]
    await w.start()
    await wait_until(lambda: w.pending == 0)
    assert store.op_counts == [[MAX_OPS_PER_CALL], [MAX_OPS_PER_CALL], [5]]  # one chunk per pipeline
    assert await store.events_after(w.session_id, None) == sent
    await w.close()
