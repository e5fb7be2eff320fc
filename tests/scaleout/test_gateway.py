"""Gateway and registry with real processes: a redis-server, replicas and a gateway on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from loadtest.webrtc_client import RealtimeCallClient
from tests.live_server import free_port
from tests.scaleout.cluster import (
    LEASE_S,
    Cluster,
    Proc,
    RealtimeClient,
    cluster,
    get,
    live_sessions,
    replica_id_of,
    replicas_view,
    wait_until,
)

pytestmark = pytest.mark.system


async def owner_of_only_session(c: Cluster) -> Proc:
    """The replica serving the one open session (its load report takes ~0.1 s)."""
    for _ in range(40):
        for r in c.replicas:
            if await live_sessions(r) == 1:
                return r
        await asyncio.sleep(0.05)
    raise AssertionError("no replica holds the session")


def exited(proc: Proc) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not proc.alive()

    return check


async def test_sessions_spread_across_both_replicas(shared: Cluster) -> None:
    c = shared
    before = [await live_sessions(r) for r in c.replicas]
    clients = []
    try:
        for _ in range(6):
            client = await RealtimeClient.open(c.gateway.ws_url)
            created = await client.next()
            assert created["type"] == "session.created"
            clients.append(client)
            # Each replica pushes its load within ~0.1 s; two choices then pick the emptier one.
            await asyncio.sleep(0.25)
        after = [await live_sessions(r) for r in c.replicas]
        added = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(added) == 6 and min(added) >= 2 and max(after) - min(after) <= 1, (before, after)
        assert sorted(r["load"] for r in await replicas_view(c.gateway)) == sorted(after)
        # Frames relay both ways: a full turn through the gateway.
        done = await clients[0].turn("hello")
        assert done["response"]["status"] == "completed"
    finally:
        for client in clients:
            await client.close()


async def test_drain_admits_nothing_new_and_lets_active_sessions_finish(two_replicas: Cluster) -> None:
    c = two_replicas
    active = await RealtimeClient.open(c.gateway.ws_url)
    await active.until("session.created")
    await asyncio.sleep(0.25)
    draining = await owner_of_only_session(c)
    other = next(r for r in c.replicas if r is not draining)
    draining_id = await replica_id_of(draining)
    # A response in flight when SIGTERM arrives.
    await active.send({"type": "response.create"})
    await active.until("response.created")
    draining.sigterm()

    async def listed_draining() -> bool:
        return any(
            r["id"] == draining_id and r["state"] == "DRAINING" for r in await replicas_view(c.gateway)
        )

    await wait_until(listed_draining, 5, "DRAINING in the registry")
    # Nothing new lands on it: not directly (503 replica_draining) ...
    with pytest.raises(InvalidStatus) as refused:
        await RealtimeClient.open(draining.ws_url)
    assert refused.value.response.status_code == 503
    assert b"replica_draining" in refused.value.response.body
    # ... nor through the gateway.
    newcomers = [await RealtimeClient.open(c.gateway.ws_url) for _ in range(4)]
    for n in newcomers:
        await n.until("session.created")
    await asyncio.sleep(0.25)
    assert await live_sessions(other) == 4 and await live_sessions(draining) == 1
    # The active session finishes its response and can take another turn.
    done = await active.until("response.done")
    assert done["response"]["status"] == "completed"
    assert (await active.turn("still there?"))["response"]["status"] == "completed"
    assert draining.alive()
    await active.close()
    # Its last session gone, the replica deregisters and exits by itself.
    await wait_until(exited(draining), 10, "the drained replica exits")
    assert draining.proc.returncode == 0, draining.tail(4000)
    assert [r["id"] for r in await replicas_view(c.gateway)] == [await replica_id_of(other)]
    for n in newcomers:
        await n.close()


async def test_lease_lapses_and_dead_replica_leaves_the_registry(two_replicas: Cluster) -> None:
    c = two_replicas
    victim, survivor = c.replicas
    victim_id = await replica_id_of(victim)
    victim.kill9()

    async def gone() -> bool:
        return victim_id not in {r["id"] for r in await replicas_view(c.gateway)}

    lapsed_after = await wait_until(gone, LEASE_S + 2, "lease lapse")
    assert lapsed_after <= LEASE_S + 1.0
    # New sessions now all go to the survivor.
    clients = [await RealtimeClient.open(c.gateway.ws_url) for _ in range(3)]
    for client in clients:
        await client.until("session.created")
    await asyncio.sleep(0.2)
    assert await live_sessions(survivor) == 3
    for client in clients:
        await client.close()


async def test_replica_lost_mid_session_closes_client_1012(two_replicas: Cluster) -> None:
    c = two_replicas
    client = await RealtimeClient.open(c.gateway.ws_url)
    await client.until("session.created")
    await asyncio.sleep(0.25)
    owner = await owner_of_only_session(c)
    owner.kill9()
    assert await client.until_closed(5) == 1012 and client.ws.close_reason == "replica_lost"


async def test_admin_key_guards_the_registry(shared: Cluster) -> None:
    c = shared
    url = c.gateway.url + "/v1/replicas"
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (await http.get(url)).status_code == 401
        assert (await http.get(url, headers={"authorization": "Bearer wrong"})).status_code == 401
    body = (await get(url, admin=True)).json()
    assert {r["url"] for r in body["data"]} == {r.url for r in c.replicas}
    assert all(r["state"] == "SERVING" and r["capacity"] == 64 for r in body["data"])
    # REST that any replica answers is forwarded.
    models = (await get(c.gateway.url + "/v1/models")).json()
    assert models["data"][0]["id"] == "history-echo"


async def test_gateway_applies_the_origin_policy_once(shared: Cluster) -> None:
    """The gateway is the edge: it answers preflights and refuses other origins itself, and a
    relayed answer carries one set of CORS headers (the replica never sees the Origin)."""
    gw, page = shared.gateway.url, "http://127.0.0.1:9"  # open mode: loopback pages are allowed
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        pre = await http.options(
            f"{gw}/v1/realtime/calls",
            headers={
                "Origin": page,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,x-openai-agents-sdk",
            },
        )
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == page
        secret = await http.post(f"{gw}/v1/realtime/client_secrets", json={}, headers={"Origin": page})
        assert secret.status_code == 200, secret.text
        assert secret.headers.get_list("access-control-allow-origin") == [page]
        other = await http.post(
            f"{gw}/v1/realtime/client_secrets", json={}, headers={"Origin": "https://elsewhere.example"}
        )
        assert other.status_code == 403 and other.json()["error"]["code"] == "origin_not_allowed"
    with pytest.raises(InvalidStatus) as refused:
        await RealtimeClient.open(shared.gateway.ws_url, origin="https://elsewhere.example")
    assert refused.value.response.status_code == 403
    client = await RealtimeClient.open(shared.gateway.ws_url, origin=page)
    try:
        assert (await client.until("session.created"))["session"]["id"].startswith("sess_")
    finally:
        await client.close(1000)


async def test_no_live_replica_is_503_and_websocket_1013(db_url: str, tmp_path: Path) -> None:
    c = Cluster(db_url, tmp_path)  # a registry nobody registered in
    try:
        gw = c.add_gateway()
        r = await get(gw.url + "/v1/models")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica_available"
        assert (await get(gw.url + "/readyz")).status_code == 503
        client = await RealtimeClient.open(gw.ws_url)
        error = await client.next()
        assert error["type"] == "error" and error["error"]["code"] == "no_replica_available"
        assert await client.until_closed() == 1013
    finally:
        c.stop()


async def test_redis_unreachable_from_gateway_is_503(tmp_path: Path) -> None:
    c = Cluster(f"redis://127.0.0.1:{free_port()}/0", tmp_path)  # nothing listens there
    try:
        gw = c.add_gateway()
        r = await get(gw.url + "/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert (await get(gw.url + "/v1/sessions/sess_abcdefgh12345678")).status_code == 503
        with pytest.raises(InvalidStatus) as refused:
            await RealtimeClient.open(gw.ws_url)
        assert refused.value.response.status_code == 503
        assert b"store_unavailable" in refused.value.response.body
    finally:
        c.stop()


async def test_webrtc_offer_goes_to_a_replica_and_hangup_finds_it(shared: Cluster) -> None:
    c = shared
    before = {r.port: await live_sessions(r) for r in c.replicas}
    async with RealtimeCallClient(c.gateway.url) as client:  # offer → the gateway → a replica
        assert client.call is not None and client.call.status_code == 201
        # The answer carries the replica's own candidates: media and events go there directly.
        await client.wait_event("session.created")
        grown = [r for r in c.replicas if await live_sessions(r) == before[r.port] + 1]
        assert len(grown) == 1
        owner = grown[0]
        assert await client.hangup() == 200  # routed by the call → replica record in Redis

        async def ended() -> bool:
            return await live_sessions(owner) == before[owner.port]

        await wait_until(ended, 10, "the call ends on its replica")
    async with httpx.AsyncClient(trust_env=False) as http:
        gone = await http.post(f"{c.gateway.url}{client.call.location}/hangup")
    assert gone.status_code == 404


async def test_credentials_pass_through_and_refusals_are_relayed(db_url: str, tmp_path: Path) -> None:
    keys = ["--api-keys", "key-a:tenant-a,key-b:tenant-b"]
    with cluster(db_url, tmp_path, replicas=1, extra=keys) as c:
        # No key: the gateway itself refuses, before any replica.
        with pytest.raises(InvalidStatus) as refused:
            await RealtimeClient.open(c.gateway.ws_url)
        assert refused.value.response.status_code == 401
        # A key in the browser subprotocol form passes through to the replica.
        client = await RealtimeClient.open(
            c.gateway.ws_url, subprotocols=["realtime", "openai-insecure-api-key.key-a"]
        )
        created = await client.until("session.created")
        # A client that did not ask for `omni.*` events: the resume data came on the replica's
        # 101, which the gateway relays; no `omni.*` event follows `session.created`.
        assert client.ws.response is not None
        token = client.ws.response.headers["X-Omni-Resume-Token"]
        sid = created["session"]["id"]
        assert client.ws.response.headers["X-Omni-Session-Id"] == sid
        await client.close(4000)
        url = f"{c.gateway.ws_url}?session_id={sid}"
        # The replica's refusals reach the client as they are: a wrong resume token is 403 ...
        with pytest.raises(InvalidStatus) as bad_token:
            await RealtimeClient.open(
                url, additional_headers={"Authorization": "Bearer key-a", "X-Omni-Resume-Token": "rt_wrong"}
            )
        assert bad_token.value.response.status_code == 403
        assert b"invalid_resume_token" in bad_token.value.response.body
        # ... and another tenant's session is 404, over REST too.
        with pytest.raises(InvalidStatus) as other_tenant:
            await RealtimeClient.open(
                url, additional_headers={"Authorization": "Bearer key-b", "X-Omni-Resume-Token": token}
            )
        assert other_tenant.value.response.status_code == 404
        async with httpx.AsyncClient(trust_env=False) as http:
            mine = await http.get(
                f"{c.gateway.url}/v1/sessions/{sid}", headers={"Authorization": "Bearer key-a"}
            )
            theirs = await http.get(
                f"{c.gateway.url}/v1/sessions/{sid}", headers={"Authorization": "Bearer key-b"}
            )
        assert mine.status_code == 200 and mine.json()["replica"]["epoch"] == 1
        assert theirs.status_code == 404
