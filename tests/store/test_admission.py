"""Admission at open: admit / queue / admit-after-wait / reject, counters back to zero."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from session.admission import AdmissionController, Admitted, Queued, Rejected

pytestmark = pytest.mark.system


@pytest.fixture
async def make(redis_client: redis.asyncio.Redis) -> AsyncIterator[type[AdmissionController]]:
    made: list[AdmissionController] = []

    def factory(**kw: object) -> AdmissionController:
        kw.setdefault("replica_id", "r1")
        kw.setdefault("replica_limit", 2)
        ctl = AdmissionController(redis_client, **kw)  # type: ignore[arg-type]
        made.append(ctl)
        return ctl

    yield factory  # type: ignore[misc]
    for ctl in made:
        await ctl.close()


async def test_admit_queue_and_reject_paths(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=2, max_queue=1, default_hold_s=10)
    assert isinstance(await ctl.try_admit("s1", "A"), Admitted)
    assert isinstance(await ctl.try_admit("s1", "A"), Admitted)  # idempotent
    assert isinstance(await ctl.try_admit("s2", "A"), Admitted)
    q = await ctl.try_admit("s3", "A")
    assert isinstance(q, Queued) and q.position == 1 and q.reason == "replica_full"
    assert q.estimated_wait_ms == 5000  # 1 × 10 s hold / 2 slots
    full = await ctl.try_admit("s4", "A")
    assert isinstance(full, Rejected) and full.code == "server_at_capacity" and full.reason == "queue_full"
    assert full.retry_after_s >= 1
    no_queue = await ctl.try_admit("s5", "A", may_queue=False)
    assert isinstance(no_queue, Rejected) and no_queue.reason == "replica_full"
    assert await ctl.release("s1")
    jumper = await ctl.try_admit("s5", "A", may_queue=False)  # the free slot is s3's: no jumping
    assert isinstance(jumper, Rejected) and jumper.reason == "replica_full"
    assert isinstance(await ctl.try_admit("s3", "A"), Admitted)
    assert isinstance(await ctl.try_admit("s5", "A"), Queued)
    counts = await ctl.counts("A")
    assert (counts.replica_active, counts.queued, counts.tenant_active) == (2, 1, 2)


async def test_tenant_limit_and_no_head_of_line_blocking(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=10, tenant_limit=lambda t: 1 if t == "small" else 10)
    assert isinstance(await ctl.try_admit("a1", "small"), Admitted)
    q = await ctl.try_admit("a2", "small")
    assert isinstance(q, Queued) and q.reason == "tenant_limit"
    assert isinstance(await ctl.try_admit("b1", "big"), Admitted)  # not stuck behind a2
    r = await ctl.try_admit("a3", "small", may_queue=False)
    assert isinstance(r, Rejected) and r.reason == "tenant_limit"


async def test_acquire_waits_then_admits(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=1, poll_interval_s=0.02)
    assert isinstance(await ctl.acquire("s1", "A"), Admitted)
    updates: list[Queued] = []

    async def on_queued(q: Queued) -> None:
        updates.append(q)

    waiter = asyncio.create_task(ctl.acquire("s2", "A", deadline_s=5, on_queued=on_queued))
    await asyncio.sleep(0.1)
    assert not waiter.done() and updates and updates[0].position == 1
    await ctl.release("s1")
    assert isinstance(await asyncio.wait_for(waiter, 2), Admitted)
    counts = await ctl.counts()
    assert (counts.replica_active, counts.queued, counts.tickets) == (1, 0, 0)


async def test_acquire_times_out_with_retry_after(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=1, poll_interval_s=0.02)
    await ctl.acquire("s1", "A")
    r = await ctl.acquire("s2", "A", deadline_s=0.15)
    assert isinstance(r, Rejected) and r.reason == "queue_timeout" and r.retry_after_s >= 1
    assert (await ctl.counts()).queued == 0


async def test_admission_across_replicas_shares_tenant_limit(make) -> None:  # type: ignore[no-untyped-def]
    r1 = make(replica_id="r1", replica_limit=5, tenant_limit=2)
    r2 = make(replica_id="r2", replica_limit=5, tenant_limit=2)
    assert isinstance(await r1.try_admit("s1", "A"), Admitted)
    assert isinstance(await r2.try_admit("s2", "A"), Admitted)
    assert isinstance(await r2.try_admit("s3", "A", may_queue=False), Rejected)
    await r1.release("s1")
    assert isinstance(await r2.try_admit("s3", "A"), Admitted)


async def test_draining_rejects_locally(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make()
    ctl.draining = True
    r = await ctl.try_admit("s1", "A")
    assert isinstance(r, Rejected) and r.reason == "draining"


async def test_200_open_close_kill_cycles_return_counters_to_zero(make) -> None:  # type: ignore[no-untyped-def]
    live = make(
        replica_id="live",
        replica_limit=64,
        tenant_limit=500,
        max_queue=200,
        holder_lease_s=0.6,
        poll_interval_s=0.02,
    )
    doomed = make(replica_id="doomed", replica_limit=64, tenant_limit=500, holder_lease_s=0.6)
    await live.start()  # renews its holders; `doomed` never does: it is the replica we kill -9
    rng = random.Random(7)

    killed = await asyncio.gather(*(doomed.acquire(f"sess_k{i:03d}", f"tenant{i % 3}") for i in range(50)))
    assert all(isinstance(d, Admitted) for d in killed)
    assert (await doomed.counts()).holders >= 50  # held, never to be released

    async def session(i: int) -> None:
        sid = f"sess_{i:04d}"
        d = await live.acquire(sid, f"tenant{i % 3}", deadline_s=20)
        assert isinstance(d, Admitted), d
        await asyncio.sleep(rng.random() * 0.05)
        assert await live.release(sid)  # close (any path: close, error, grace expiry)

    await asyncio.gather(*(session(i) for i in range(150)))
    for _ in range(50):  # the dead replica's leases lapse (0.6 s)
        if not (await live.counts()).holders:
            break
        await asyncio.sleep(0.1)
    for ctl in (live, doomed):
        for tenant in ("tenant0", "tenant1", "tenant2"):
            c = await ctl.counts(tenant)
            assert (c.replica_active, c.queued, c.holders, c.tickets, c.tenant_active) == (0, 0, 0, 0, 0)
    keys = await live.redis.keys("omni:{adm}:*")
    assert set(keys) <= {"omni:{adm}:stats", "omni:{adm}:seq"}


async def test_live_holders_survive_lease_period_when_renewed(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=4, holder_lease_s=0.6)
    await ctl.start()
    await ctl.acquire("s1", "A")
    await asyncio.sleep(1.3)  # > 2 leases: renewed every 0.2 s
    assert (await ctl.counts()).replica_active == 1
    await ctl.close()
    await asyncio.sleep(0.8)
    assert (await ctl.counts()).replica_active == 0


async def test_concurrent_opens_are_batched(make) -> None:  # type: ignore[no-untyped-def]
    ctl = make(replica_limit=150, tenant_limit=1000, max_queue=100)
    decisions = await asyncio.gather(*(ctl.try_admit(f"s{i}", "A") for i in range(200)))
    assert sum(isinstance(d, Admitted) for d in decisions) == 150
    queued = [d for d in decisions if isinstance(d, Queued)]
    assert sorted(q.position for q in queued) == list(range(1, 51))
    assert ctl.round_trips <= 3
