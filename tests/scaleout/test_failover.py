"""Resume routing, failover and fencing with real processes: redis-server, two replicas, a gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import redis.asyncio

from session.affinity import SessionBinding
from session.store import SessionStore
from tests.scaleout.cluster import (
    LEASE_S,
    Cluster,
    Proc,
    Session,
    get,
    live_sessions,
    replica_id_of,
    replicas_view,
    wait_until,
)
from tests.timing import slack

pytestmark = pytest.mark.system


def reply_text(done: dict[str, Any]) -> str:
    parts = done["response"]["output"][0]["content"]
    return " ".join(str(p.get("transcript") or p.get("text") or "") for p in parts)


async def owner_of(c: Cluster, session_id: str) -> Proc:
    view = (await get(f"{c.gateway.url}/v1/sessions/{session_id}")).json()
    owner_id = view["replica"]["id"]
    for r in c.replicas:
        if r.alive() and await replica_id_of(r) == owner_id:
            return r
    raise AssertionError(f"no live replica is {owner_id}")


async def test_resume_through_the_gateway_lands_on_the_owner(shared: Cluster) -> None:
    c = shared
    s = await Session.open(c.gateway)
    first = await s.client.turn("remember the blue door")
    assert first["response"]["status"] == "completed"
    owner = await owner_of(c, s.session_id)
    other = next(r for r in c.replicas if r is not owner)
    view = (await get(f"{c.gateway.url}/v1/sessions/{s.session_id}")).json()
    assert view["replica"] == {"id": await replica_id_of(owner), "url": owner.url, "epoch": 1, "alive": True}
    last = s.client.last_event_id
    await s.client.close(4000)  # a dropped connection: the session stays live on its owner
    await asyncio.sleep(0.2)
    client = await s.resume(c.gateway, last)
    resumed = await client.until("omni.session.resumed")
    assert resumed["replay_count"] == 0
    served = (await get(f"{c.gateway.url}/v1/sessions/{s.session_id}")).json()  # asks the owner
    assert served["replica"]["id"] == view["replica"]["id"] and served["live_here"] and served["connected"]
    assert not (await get(f"{other.url}/v1/sessions/{s.session_id}")).json()["live_here"]
    second = await client.turn("what did I say?")
    assert "user:remember the blue door" in reply_text(second)
    assert (await get(f"{c.gateway.url}/v1/sessions/{s.session_id}")).json()["replica"]["epoch"] == 1
    await client.close()


@pytest.mark.timing
async def test_kill9_owner_session_migrates_with_its_history(two_replicas: Cluster) -> None:
    c = two_replicas
    s = await Session.open(c.gateway)
    assert (await s.client.turn("remember the blue door"))["response"]["status"] == "completed"
    owner = await owner_of(c, s.session_id)
    survivor = next(r for r in c.replicas if r is not owner)
    owner_id, survivor_id = await replica_id_of(owner), await replica_id_of(survivor)
    # A second turn, killed mid-response (its audio is streaming).
    await s.client.send(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "and a key"}],
            },
        }
    )
    await s.client.send({"type": "response.create"})
    created = await s.client.until("response.created")
    in_flight = created["response"]["id"]
    await s.client.until("response.output_audio.delta")
    owner.kill9()
    killed_at = time.monotonic()
    assert await s.client.until_closed() == 1012  # the gateway: replica_lost, resume
    last = s.client.last_event_id
    client = await s.resume(c.gateway, last)  # the gateway waits out the owner's lease
    resumed = await client.until("omni.session.resumed")
    # The dead replica's audio deltas were held there, not logged: the replay has every logged
    # event, and says the audio after the client's last event is not kept (or resyncs).
    assert resumed.get("audio_replay") == "not_kept" or resumed.get("replay_unavailable")
    migrated = await client.until("omni.session.migrated")
    assert migrated["session_id"] == s.session_id
    assert migrated["from_replica"] == owner_id and migrated["to_replica"] == survivor_id
    # The response that was in flight on the dead replica ends: failed, replica_lost (in the
    # replay, or live right after it).
    after_resume = client.events[client.events.index(resumed) + 1 :]
    done = next((e for e in after_resume if e["type"] == "response.done"), None)
    if done is None:
        done = await client.until("response.done")
    assert done["response"]["id"] == in_flight and done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "replica_lost"
    # The next turn runs on the survivor with the whole history.
    third = await client.turn("what did I say?")
    elapsed = time.monotonic() - killed_at
    assert third["response"]["status"] == "completed"
    history = reply_text(third)
    assert "user:remember the blue door" in history and "user:and a key" in history
    assert elapsed <= slack(LEASE_S + 2.0), f"failover + next turn took {elapsed:.2f} s"
    view = (await get(f"{c.gateway.url}/v1/sessions/{s.session_id}")).json()
    assert view["replica"]["id"] == survivor_id and view["replica"]["epoch"] == 2
    await client.close()


async def test_returning_replica_is_fenced_and_reregisters(two_replicas: Cluster) -> None:
    """SIGSTOP the owner past its lease: the session moves. After SIGCONT the old owner
    registers again, notices its lease had lapsed, and its write for the moved session is
    rejected (stale epoch): it ends its copy, closing the connection it still had (1012)."""
    c = two_replicas
    s = await Session.open(c.gateway)
    assert (await s.client.turn("remember the blue door"))["response"]["status"] == "completed"
    zombie = s.client  # stays connected (through the gateway) to the frozen owner
    owner = await owner_of(c, s.session_id)
    owner_id = await replica_id_of(owner)
    os.kill(owner.proc.pid, signal.SIGSTOP)
    try:

        async def lapsed() -> bool:
            return owner_id not in {r["id"] for r in await replicas_view(c.gateway)}

        await wait_until(lapsed, LEASE_S + 3, "the frozen owner's lease lapses")
        client = await s.resume(c.gateway, zombie.last_event_id)
        migrated = await client.until("omni.session.migrated")
        assert migrated["from_replica"] == owner_id
        new_owner = migrated["to_replica"]
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
    r = redis.asyncio.Redis.from_url(c.redis_url, decode_responses=True)
    try:
        items_before = await SessionStore(r).list_items(s.session_id)

        async def back() -> bool:
            return owner_id in {x["id"] for x in await replicas_view(c.gateway)}

        await wait_until(back, 5, "the old owner registers again")
        assert await zombie.until_closed() == 1012
        assert zombie.ws.close_reason == "session moved to another replica"

        async def let_go() -> bool:
            return await live_sessions(owner) == 0

        await wait_until(let_go, 5, "the old owner drops the session")
        bound = await SessionBinding(r).get(s.session_id)
        assert bound is not None and (bound.replica_id, bound.epoch) == (new_owner, 2)
        assert await SessionStore(r).list_items(s.session_id) == items_before
    finally:
        await r.aclose()
    third = await client.turn("what did I say?")
    assert "user:remember the blue door" in reply_text(third)
    await client.close()


async def test_stale_epoch_write_is_rejected_and_ends_the_local_session(shared: Cluster) -> None:
    c = shared
    s = await Session.open(c.gateway)
    await s.client.turn("one")
    owner = await owner_of(c, s.session_id)
    r = redis.asyncio.Redis.from_url(c.redis_url, decode_responses=True)
    try:
        moved = await SessionBinding(r).takeover(s.session_id, "rep_elsewhere", 1)  # as a failover would
        assert moved.won and moved.epoch == 2
        items = await SessionStore(r).list_items(s.session_id)
        await s.client.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "two"}],
                },
            }
        )
        code = await s.client.until_closed()
        assert code == 1012 and s.client.ws.close_reason == "session moved to another replica"
        assert await SessionStore(r).list_items(s.session_id) == items  # the write was refused
    finally:
        await r.aclose()

    async def gone() -> bool:
        return not (await get(f"{owner.url}/v1/sessions/{s.session_id}")).json()["live_here"]

    await wait_until(gone, 5, "the fenced replica drops its copy")


async def test_a_call_resume_after_the_owner_died_waits_out_its_lease(two_replicas: Cluster) -> None:
    """`POST /v1/realtime/calls?session_id=` right after kill -9 of the owner: the gateway
    waits for the owner's lease to lapse (as for a WebSocket resume) and the survivor takes
    the session over on the new call, with its history; no 409 meanwhile."""
    from loadtest.webrtc_client import RealtimeCallClient

    c = two_replicas
    s = await Session.open(c.gateway)
    assert (await s.client.turn("remember the blue door"))["response"]["status"] == "completed"
    owner = await owner_of(c, s.session_id)
    survivor = next(r for r in c.replicas if r is not owner)
    last = s.client.last_event_id
    owner.kill9()
    killed_at = time.monotonic()
    assert await s.client.until_closed() == 1012
    call = RealtimeCallClient(c.gateway.url)
    try:
        info = await call.connect(resume=(s.session_id, s.token, last))
        assert info.status_code == 201
        assert time.monotonic() - killed_at <= LEASE_S + 3.0
        _, resumed = await call.wait_event("omni.session.resumed")
        assert resumed["session_id"] == s.session_id
        view = (await get(f"{c.gateway.url}/v1/sessions/{s.session_id}")).json()
        assert view["replica"]["id"] == await replica_id_of(survivor)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and?"}]}
        call.send({"type": "conversation.item.create", "item": item})
        call.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        _, done = await call.wait_event("response.done", timeout_s=20)
        assert done["response"]["status"] == "completed"
        assert "user:remember the blue door" in reply_text(done)
    finally:
        await call.close()
