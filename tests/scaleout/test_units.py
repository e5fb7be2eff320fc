"""The scale-out pieces without processes: routing decisions, header and close-code rules, gates."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from session.affinity import Binding, ReplicaInfo
from web.deploy.replica import ReplicaConfig, admin_denial, opens_new_session
from web.gateway.relay import _close_code, forwarded_headers, ws_url
from web.gateway.routing import NoReplicaAvailable, Router

pytestmark = pytest.mark.unit


class FakeRegistry:
    def __init__(self, replicas: Sequence[ReplicaInfo], alive_polls: int = 0) -> None:
        self.replicas = list(replicas)
        self.alive_polls = alive_polls  # is_alive() answers True this many times, then False

    async def live_replicas(self) -> list[ReplicaInfo]:
        return list(self.replicas)

    async def is_alive(self, replica_id: str) -> bool:
        self.alive_polls -= 1
        return self.alive_polls >= 0


class FakeBinding:
    def __init__(self, bound: Binding | None) -> None:
        self.bound = bound

    async def get(self, session_id: str) -> Binding | None:
        return self.bound


def router(replicas: Sequence[ReplicaInfo], bound: Binding | None = None, alive_polls: int = 0) -> Router:
    return Router(
        FakeRegistry(replicas, alive_polls),  # type: ignore[arg-type]
        FakeBinding(bound),  # type: ignore[arg-type]
        rng=random.Random(0),
        poll_s=0.001,
    )


A = ReplicaInfo("rep_a", "http://a", capacity=10, load=1)
B = ReplicaInfo("rep_b", "http://b", capacity=10, load=5)
DRAINING = ReplicaInfo("rep_d", "http://d", capacity=10, load=0, state="DRAINING")


async def test_new_sessions_take_the_less_loaded_serving_replica() -> None:
    r = router([A, B, DRAINING])
    assert {(await r.new_session()).replica_id for _ in range(20)} <= {"rep_a", "rep_b"}
    assert (await router([A, B]).new_session()).replica_id == "rep_a"  # two choices of two
    assert (await r.new_session(exclude={"rep_a"})).replica_id == "rep_b"
    with pytest.raises(NoReplicaAvailable, match="draining"):
        await router([DRAINING]).new_session()
    with pytest.raises(NoReplicaAvailable, match="no live replica"):
        await router([]).new_session()


async def test_a_resume_goes_to_its_owner_even_draining_else_fails_over() -> None:
    owned = Binding("rep_d", 3, won=False)
    route = await router([A, DRAINING], owned).session("sess_x")
    assert (route.kind, route.replica.replica_id, route.epoch) == ("owner", "rep_d", 3)
    lapsed = Binding("rep_gone", 3, won=False)
    route = await router([A, B], lapsed).session("sess_x")
    assert (route.kind, route.replica.replica_id, route.owner) == ("failover", "rep_a", "rep_gone")
    route = await router([A, B]).session("sess_unknown")
    assert route.kind == "unbound"
    with pytest.raises(NoReplicaAvailable):
        await router([DRAINING], lapsed).session("sess_x")  # nobody may take it over


async def test_wait_lapse_polls_until_the_lease_is_gone() -> None:
    assert await router([A], alive_polls=3).wait_lapse("rep_a", timeout_s=1.0)
    assert not await router([A], alive_polls=10_000).wait_lapse("rep_a", timeout_s=0.02)


def test_forwarded_headers_drop_the_hop_and_add_the_client() -> None:
    raw = [
        (b"Host", b"gw"),
        (b"Authorization", b"Bearer k"),
        (b"Sec-WebSocket-Key", b"x"),
        (b"Sec-WebSocket-Protocol", b"realtime"),
        (b"X-Omni-Resume-Token", b"rt_1"),
        (b"X-Forwarded-For", b"10.0.0.1"),
    ]
    assert forwarded_headers(raw, "10.0.0.2") == [
        ("authorization", "Bearer k"),
        ("x-omni-resume-token", "rt_1"),
        ("x-forwarded-for", "10.0.0.1, 10.0.0.2"),
    ]


def test_ws_url_and_close_codes() -> None:
    assert ws_url("https://r:1/", "/v1/realtime", "session_id=s") == "wss://r:1/v1/realtime?session_id=s"
    assert ws_url("http://r:1", "/v1/realtime", "") == "ws://r:1/v1/realtime"
    assert [_close_code(c) for c in (None, 1000, 1005, 1006, 1012, 4000, 99)] == [
        1000,
        1000,
        1000,
        1001,
        1012,
        4000,
        1000,
    ]


def test_admin_key_and_new_session_gate() -> None:
    def status(authorization: str | None, key: str | None) -> int:
        denied = admin_denial(authorization, key)
        return 200 if denied is None else denied[0]

    assert status("Bearer s3cret", "s3cret") == 200
    assert status("Bearer nope", "s3cret") == status(None, "s3cret") == status("s3cret", "s3cret") == 401
    assert status("Bearer x", None) == 403  # no admin key configured: the endpoint is off
    ws = {"type": "websocket", "path": "/v1/realtime", "query_string": b""}
    assert opens_new_session(ws)
    assert not opens_new_session({**ws, "query_string": b"session_id=sess_1&last_event_id=e"})
    assert opens_new_session({"type": "http", "method": "POST", "path": "/v1/realtime/calls"})
    assert not opens_new_session({"type": "http", "method": "GET", "path": "/v1/sessions/sess_1"})


def test_replica_config_is_checked() -> None:
    with pytest.raises(ValueError, match="advertise-url"):
        ReplicaConfig(url="127.0.0.1:8000", capacity=4)
    with pytest.raises(ValueError, match="shorter than the lease"):
        ReplicaConfig(url="http://r", capacity=4, lease_s=2.0, refresh_s=2.0)
