"""Retention: pure timer logic on virtual time, and Redis TTL / lifetime expiry."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from session.retention import RetentionPolicy, RetentionTimer, Verdict, expire_session
from session.store import SessionStore, SessionWriter
from session.store.errors import SessionGone, SessionNotFound

pytestmark = pytest.mark.system


def test_defaults() -> None:
    p = RetentionPolicy()
    assert (p.idle_ttl_s, p.max_lifetime_s, p.disconnect_grace_s) == (600, 3600, 30)
    with pytest.raises(ValueError):
        RetentionPolicy(idle_ttl_s=0)


def test_timer_grace_idle_lifetime() -> None:
    t = RetentionTimer(RetentionPolicy(), created_at=1000.0, now=1000.0)
    assert t.check(1000.0) is Verdict.ACTIVE
    t.on_activity(1500.0)
    assert t.check(2000.0) is Verdict.ACTIVE
    t.on_disconnect(2000.0)
    assert t.check(2029.0) is Verdict.DETACHED
    assert t.next_deadline(2029.0) == 2030.0
    assert t.check(2030.0) is Verdict.GRACE_EXPIRED  # cancel the in-flight response, stay resumable
    t.on_reconnect(2100.0)
    assert t.connected and t.check(2100.0) is Verdict.ACTIVE
    assert t.check(2700.0) is Verdict.IDLE_EXPIRED and t.check(2700.0).terminal
    t.on_activity(4500.0)
    assert t.check(4600.0) is Verdict.LIFETIME_EXPIRED  # created 1000 + 3600
    assert t.key_ttl_ms(4590.0) == 10_000  # lifetime caps the key TTL
    assert t.key_ttl_ms(1000.0) == 600_000


async def test_idle_ttl_expiry_in_redis(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client, policy=RetentionPolicy(idle_ttl_s=1.0, max_lifetime_s=60))
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    writer.append({"type": "x"})
    writer.put_item({"id": "item_1"})
    await writer.flush()
    assert 0 < await store.ttl_ms(record.session_id) <= 1000
    for key in store.keys(record.session_id).all()[:4]:
        assert 0 < await redis_client.pttl(key) <= 1000
    await asyncio.sleep(0.6)
    await store.touch(record.session_id, expires_at=record.expires_at)  # activity refreshes the TTL
    await asyncio.sleep(0.6)  # 1.2 s after creation, but touched at 0.6: still there
    assert (await store.get_session("t", record.session_id)).session_id == record.session_id
    await asyncio.sleep(1.1)
    with pytest.raises(SessionNotFound):
        await store.get_session("t", record.session_id)
    assert await redis_client.keys("*") == []
    with pytest.raises(SessionGone):  # a writer of an expired session stops
        await store.touch(record.session_id, expires_at=record.expires_at)


async def test_lifetime_expiry_caps_ttl_despite_activity(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client, policy=RetentionPolicy(idle_ttl_s=60, max_lifetime_s=0.6))
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    await writer.start()
    for _ in range(4):
        writer.append({"type": "x"})
        await asyncio.sleep(0.1)
    assert await store.ttl_ms(record.session_id) <= 600
    await asyncio.sleep(0.5)
    with pytest.raises(SessionNotFound):
        await store.get_session("t", record.session_id)
    await writer.close()
    assert await redis_client.keys("*") == []


async def test_expire_session_deletes_every_key(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    writer.append({"type": "x"})
    writer.put_item({"id": "item_1"})
    await writer.close()
    await redis_client.hset(store.keys(record.session_id).owner, mapping={"replica": "r1", "epoch": 1})
    assert len(await redis_client.keys("*")) == 5
    assert await expire_session(store, record.session_id)
    assert await redis_client.keys("*") == []
    assert not await expire_session(store, record.session_id)


async def test_writer_on_expired_session_reports_fatal(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    record, _ = await store.create_session("t")
    fatal: list[Exception] = []
    writer = SessionWriter(store, record, flush_interval_s=0.01, on_fatal=fatal.append)
    await writer.start()
    await store.delete_session(record.session_id)
    writer.append({"type": "x"})
    for _ in range(100):
        if fatal:
            break
        await asyncio.sleep(0.01)
    assert isinstance(fatal[0], SessionGone) and writer.fatal is not None
    await writer.close()
