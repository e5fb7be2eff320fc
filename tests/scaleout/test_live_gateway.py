"""GPT-Live sessions behind the gateway, with real processes (a redis-server, two duplex-tiny
replicas and a gateway on loopback): ``/v1/live/sessions`` is routed and relayed like
``/v1/realtime`` (a new session → a picked replica, ``?session_id=`` → its owner, which the
session API names), so a dropped socket resumes through the gateway on the replica that holds
the model's context; when that replica is lost the session is gone with it (its context was
there): a resume is ``404 session_not_found`` once another replica has taken the binding."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.live.wire import LiveClient, append, start_event
from tests.scaleout.cluster import Cluster, Proc, get, replica_id_of, start_replica, wait_ready

pytestmark = pytest.mark.system


def live_url(proc: Proc, query: str = "") -> str:
    return proc.url.replace("http://", "ws://") + "/v1/live/sessions" + query


async def _connect(proc: Proc, query: str = "", headers: dict[str, str] | None = None) -> LiveClient:
    return LiveClient(await connect(live_url(proc, query), additional_headers=headers or {}, max_size=None))


async def test_a_live_session_resumes_through_the_gateway_and_ends_with_its_replica(
    fresh_db: Callable[[], str], tmp_path: Path
) -> None:
    c = Cluster(fresh_db(), tmp_path)
    try:
        c.add_gateway()
        duplex = ["--pipeline", "duplex-tiny", "--disconnect-grace-s", "30"]
        c.replicas += [start_replica(c.redis_url, tmp_path, extra=duplex) for _ in range(2)]
        wait_ready(c.replicas, path="/readyz", timeout_s=120)
        c.wait_registered(2)
        ids = {await replica_id_of(r): r for r in c.replicas}

        client = await _connect(c.gateway)
        sid = client.ws.response.headers["X-Omni-Session-Id"]
        token = client.ws.response.headers["X-Omni-Resume-Token"]
        await client.send(start_event())
        assert (await client.wait_for("session.started"))["session"]["id"] == sid
        for i in range(5):
            await client.send(append(0.1, seed=i))
        state = (await get(f"{c.gateway.url}/v1/sessions/{sid}")).json()
        assert state["kind"] == "live"
        owner_id = state["replica"]["id"]
        client.ws.transport.abort()  # lost, not closed: the session waits on its owner

        back = await _connect(c.gateway, f"?session_id={sid}", {"X-Omni-Resume-Token": token})
        started = await back.wait_for("session.started")
        assert started["session"]["omni"]["resumed"] is True
        assert started["session"]["omni"]["usage_s"] == 0.5
        assert (await get(f"{c.gateway.url}/v1/sessions/{sid}")).json()["replica"]["id"] == owner_id

        ids[owner_id].kill9()
        back.ws.transport.abort()
        with pytest.raises(InvalidStatus) as gone:
            await _connect(c.gateway, f"?session_id={sid}", {"X-Omni-Resume-Token": token})
        assert gone.value.response.status_code == 404
        assert json.loads(gone.value.response.body)["error"]["code"] == "session_not_found"
    finally:
        c.stop()
