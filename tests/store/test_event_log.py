"""Event log: append, batched flush, replay after an event id, items, fencing basics."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from session.store import SessionStore, SessionWriter
from session.store.errors import ReplayUnavailable, ResumeTokenInvalid, SessionNotFound
from session.store.event_ids import parse_event_id

pytestmark = pytest.mark.system


@pytest.fixture
async def store(redis_client: redis.asyncio.Redis) -> SessionStore:
    s = SessionStore(redis_client, stream_maxlen=10_000)
    await s.load_scripts()
    return s


def _delta(i: int) -> dict[str, object]:
    # A logged type (audio deltas are held in process: tests/store/test_held_events.py)
    return {"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "delta": f"w{i}"}


async def test_append_stamps_ids_and_flush_is_one_round_trip(store: SessionStore) -> None:
    record, _ = await store.create_session("tenantA", {"voice": "alloy"})
    writer = SessionWriter(store, record)
    sent = [writer.append(_delta(i)) for i in range(50)]
    assert writer.round_trips == 0  # the hot path did no I/O
    assert await writer.flush() == 50
    assert writer.round_trips == 1
    ids = [e["event_id"] for e in sent]
    assert len(set(ids)) == 50
    assert [parse_event_id(i).seq for i in ids] == list(range(1, 51))  # type: ignore[union-attr]
    replay = await store.events_after(record.session_id, ids[19])
    assert replay == sent[20:]


async def test_replay_from_start_and_after_last(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    sent = [writer.append({"type": "x", "n": i}) for i in range(5)]
    await writer.flush()
    assert await store.events_after(record.session_id, None) == sent
    assert await store.events_after(record.session_id, sent[-1]["event_id"]) == []


async def test_timer_flush_batches_and_replay_has_no_gaps_or_duplicates(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, flush_interval_s=0.01, max_batch_events=16)
    await writer.start()
    sent = []
    for i in range(200):
        sent.append(writer.append(_delta(i)))
        if i % 10 == 0:
            await asyncio.sleep(0)  # let the flusher run between bursts
    await writer.close()
    assert writer.pending == 0
    assert writer.round_trips < 200 / 4  # batched: far fewer round trips than events
    replay = await store.events_after(record.session_id, sent[0]["event_id"])
    assert [e["event_id"] for e in replay] == [e["event_id"] for e in sent[1:]]
    assert replay == sent[1:]


async def test_writer_continues_sequence_after_reload(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    w1 = SessionWriter(store, record)
    first = [w1.append({"type": "a", "n": i}) for i in range(3)]
    await w1.close()
    reloaded = await store.get_session("t", record.session_id)
    assert reloaded.event_seq == 3
    w2 = SessionWriter(store, reloaded)
    second = [w2.append({"type": "b", "n": i}) for i in range(3)]
    await w2.close()
    assert await store.events_after(record.session_id, None) == first + second


async def test_state_changes_flush_immediately_in_order(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, flush_interval_s=10.0)  # the timer would never fire
    await writer.start()
    writer.append({"type": "conversation.item.added"})
    writer.put_item({"id": "item_b", "type": "message", "role": "user", "content": []})
    writer.put_item({"id": "item_a", "type": "message"}, previous_item_id="root")
    writer.put_item({"id": "item_c", "type": "message"}, previous_item_id="item_a")
    writer.set_state("detached")
    for _ in range(100):
        if writer.pending == 0:
            break
        await asyncio.sleep(0.01)
    assert writer.pending == 0
    snap = await store.load_snapshot("t", record.session_id)
    assert [i["id"] for i in snap.items] == ["item_a", "item_c", "item_b"]
    assert snap.record.state == "detached"
    writer.put_item({"id": "item_c", "type": "message", "status": "completed"})  # replace keeps place
    writer.delete_item("item_a")
    await writer.close()
    items = await store.list_items(record.session_id)
    assert [(i["id"], i.get("status")) for i in items] == [("item_c", "completed"), ("item_b", None)]


async def test_retried_batch_is_idempotent(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    ops = [("e", "1", "event_x_0_1", '{"n":1}'), ("i", "item_1", '{"id":"item_1"}', "")]
    await store.apply_batch(record.session_id, ops, expires_at=record.expires_at)
    await store.apply_batch(record.session_id, ops, expires_at=record.expires_at)  # as after a lost reply
    assert await store.redis.xlen(store.keys(record.session_id).events) == 1
    assert await store.list_items(record.session_id) == [{"id": "item_1"}]


async def test_replay_errors(store: SessionStore) -> None:
    small = SessionStore(store.redis, stream_maxlen=10)
    record, _ = await small.create_session("t")
    writer = SessionWriter(small, record)
    sent = [writer.append({"type": "x", "n": i}) for i in range(500)]
    await writer.flush()
    with pytest.raises(ReplayUnavailable) as trimmed:
        await small.events_after(record.session_id, sent[0]["event_id"])
    assert trimmed.value.reason == "trimmed"
    with pytest.raises(ReplayUnavailable) as foreign:
        await small.events_after(record.session_id, "event_ABCDEFGH_0_3")
    assert foreign.value.reason == "unknown_event_id"
    future = sent[-1]["event_id"].rsplit("_", 1)[0] + "_999"
    with pytest.raises(ReplayUnavailable) as ahead:
        await small.events_after(record.session_id, future)
    assert ahead.value.reason == "unknown_event_id"
    other_epoch = sent[-1]["event_id"].replace("_0_", "_7_")
    with pytest.raises(ReplayUnavailable):
        await small.events_after(record.session_id, other_epoch)
    with pytest.raises(SessionNotFound):
        await small.events_after("sess_doesnotexist0000", None)


async def test_dropped_events_during_outage_show_as_gap(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record, max_pending=5)
    sent = [writer.append({"type": "x", "n": i}) for i in range(8)]  # as if Redis were down
    assert writer.dropped_events == 3
    await writer.flush()
    assert await store.events_after(record.session_id, sent[-2]["event_id"]) == sent[-1:]
    with pytest.raises(ReplayUnavailable) as gap:
        await store.events_after(record.session_id, None)
    assert gap.value.reason in {"gap", "trimmed"}


async def test_writer_survives_redis_outage_and_catches_up(store: SessionStore, redis_url: str) -> None:
    record, _ = await store.create_session("t")
    dead = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True)
    offline = SessionStore(dead)
    writer = SessionWriter(offline, record)
    sent = [writer.append({"type": "x", "n": i}) for i in range(3)]
    from session.store.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable):
        await writer.flush()
    assert writer.pending == 3  # kept for the retry
    writer.store = store  # Redis is back
    await writer.flush()
    assert await store.events_after(record.session_id, None) == sent
    await dead.aclose()


async def test_resume_mid_response_matches_uninterrupted_run(store: SessionStore) -> None:
    record, token = await store.create_session("tenantA")
    writer = SessionWriter(store, record, flush_interval_s=0.005)
    await writer.start()
    client_got: list[dict[str, object]] = []
    all_sent: list[dict[str, object]] = []
    for i in range(60):  # a response streaming; the socket drops after event 25
        event = writer.append(_delta(i))
        all_sent.append(event)
        if i < 25:
            client_got.append(event)
        if i % 7 == 0:
            await asyncio.sleep(0.002)
    last = str(client_got[-1]["event_id"])
    with pytest.raises(ResumeTokenInvalid):
        await store.resume("tenantA", record.session_id, "rt_wrong", last)
    with pytest.raises(SessionNotFound):
        await store.resume("tenantB", record.session_id, token, last)
    await writer.flush()  # the resuming process flushes its own writer first (SessionWriter.replay)
    resumed = await store.resume("tenantA", record.session_id, token, last)
    assert resumed.replay_unavailable is None and resumed.events is not None
    client_got += resumed.events
    client_got.append(writer.append({"type": "response.done"}))  # live again
    all_sent.append(client_got[-1])
    assert [e["event_id"] for e in client_got] == [e["event_id"] for e in all_sent]
    assert client_got == all_sent
    await writer.close()
    unavailable = await store.resume("tenantA", record.session_id, token, "event_nope")
    assert unavailable.events is None and unavailable.replay_unavailable is not None
