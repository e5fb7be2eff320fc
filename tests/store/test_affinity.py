"""Affinity: registry leases, power-of-two choices, binding first-writer-wins, epoch fencing."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio

from session.affinity import (
    ReplicaInfo,
    ReplicaLease,
    ReplicaRegistry,
    SessionBinding,
    pick_replica,
)
from session.store import SessionStore, SessionWriter
from session.store.errors import StaleEpoch

pytestmark = pytest.mark.system


async def test_registry_lease_refresh_and_lapse(redis_client: redis.asyncio.Redis) -> None:
    registry = ReplicaRegistry(redis_client, lease_s=1.0)
    alive = ReplicaLease(registry, ReplicaInfo("r1", "http://r1", capacity=10), refresh_s=0.2)
    dying = ReplicaLease(registry, ReplicaInfo("r2", "http://r2", capacity=10), refresh_s=0.2)
    await alive.start()
    await dying.start()
    assert {r.replica_id for r in await registry.live_replicas()} == {"r1", "r2"}
    await dying.stop(deregister=False)  # kill -9: it just stops heartbeating
    await asyncio.sleep(0.3)
    assert await registry.is_alive("r2")  # still within its lease
    await asyncio.sleep(1.0)
    live = await registry.live_replicas()
    assert [r.replica_id for r in live] == ["r1"]  # r2's lease lapsed; r1 kept refreshing
    assert not await registry.is_alive("r2")
    assert await redis_client.exists("omni:{replicas}:r:r2") == 0
    await dying.start()  # a returning replica re-registers with a new lease
    assert await registry.is_alive("r2")
    await alive.drain()
    assert [r.state for r in await registry.live_replicas() if r.replica_id == "r1"] == ["DRAINING"]
    await alive.stop()
    await dying.stop()
    assert await registry.live_replicas() == []


def test_power_of_two_choices_prefers_less_loaded() -> None:
    rng = random.Random(1)
    replicas = [
        ReplicaInfo("busy", "u", capacity=10, load=9),
        ReplicaInfo("idle", "u", capacity=10, load=1),
        ReplicaInfo("full", "u", capacity=10, load=10),
        ReplicaInfo("drain", "u", capacity=10, load=0, state="DRAINING"),
    ]
    picks = [pick_replica(replicas, rng) for _ in range(50)]
    assert {p.replica_id for p in picks if p} == {"idle"}  # busy vs idle: idle; full/draining never
    assert pick_replica([replicas[2], replicas[3]], rng) is None
    spread = [
        pick_replica([ReplicaInfo(f"r{i}", "u", 10, load=0) for i in range(4)], rng) for _ in range(200)
    ]
    assert len({p.replica_id for p in spread if p}) == 4


async def test_binding_first_writer_wins(redis_client: redis.asyncio.Redis) -> None:
    binding = SessionBinding(redis_client)
    results = await asyncio.gather(*(binding.bind("sess_abcdefgh1234", f"r{i}") for i in range(20)))
    winners = [b for b in results if b.won]
    assert len(winners) == 1 and winners[0].epoch == 1
    assert {b.replica_id for b in results} == {winners[0].replica_id}
    assert await binding.get("sess_abcdefgh1234") == type(winners[0])(winners[0].replica_id, 1, won=False)


async def test_takeover_after_lease_lapse_and_stale_epoch_rejected(redis_client: redis.asyncio.Redis) -> None:
    store = SessionStore(redis_client)
    registry = ReplicaRegistry(redis_client, lease_s=1.0)
    binding = SessionBinding(redis_client)
    await registry.heartbeat(ReplicaInfo("r1", "http://r1", 10))
    await registry.heartbeat(ReplicaInfo("r2", "http://r2", 10))
    record, _ = await store.create_session("t")
    sid = record.session_id

    first = await binding.claim(sid, "r1", registry.is_alive)
    assert (first.replica_id, first.epoch, first.won) == ("r1", 1, True)
    old_writer = SessionWriter(store, record, epoch=first.epoch)
    old_writer.append({"type": "a"})
    await old_writer.flush()

    # r1 alive: r2 cannot take the session
    again = await binding.claim(sid, "r2", registry.is_alive)
    assert (again.replica_id, again.epoch, again.won) == ("r1", 1, False)

    await asyncio.sleep(1.1)  # r1 dies (no heartbeat); r2 keeps beating
    await registry.heartbeat(ReplicaInfo("r2", "http://r2", 10))
    moved = await binding.claim(sid, "r2", registry.is_alive)
    assert (moved.replica_id, moved.epoch, moved.won, moved.previous_replica) == ("r2", 2, True, "r1")

    # a racing second takeover at the old epoch loses
    late = await binding.takeover(sid, "r3", expected_epoch=1)
    assert (late.replica_id, late.epoch, late.won) == ("r2", 2, False)

    # the old owner comes back and writes with its stale epoch: rejected atomically
    old_writer.append({"type": "zombie"})
    with pytest.raises(StaleEpoch) as err:
        await old_writer.flush()
    assert err.value.current == 2
    new_writer = SessionWriter(store, await store.get_session("t", sid), epoch=moved.epoch)
    e = new_writer.append({"type": "b"})
    await new_writer.flush()
    assert e["event_id"].endswith("_2_2")
    replay = await store.events_after(sid, None)
    assert [ev["type"] for ev in replay] == ["a", "b"]  # the zombie write never landed
    assert await redis_client.pttl(store.keys(sid).owner) > 0  # the binding expires with the session
