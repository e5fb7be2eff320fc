"""World sessions scaled out: two replica processes on one redis-server (tests/scaleout's
helpers). A world is bound to the replica that opened it, like a voice session: its state
answers with that owner everywhere, and a resume on another replica is refused with 409
``session_elsewhere`` while the owner lives (the world's rolling context lives only there);
once the owner is dead, 404 and its slot is given back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.conftest_redis import RedisServerProcess
from tests.scaleout.cluster import Proc, replica_id_of, start_replica, wait_ready

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def replicas(
    redis_server: RedisServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("replicas")
    started: list[Proc] = []
    try:
        started = [start_replica(redis_server.url, Path(tmp)) for _ in range(2)]
        wait_ready(started, path="/readyz")
        yield started[0], started[1]
    finally:
        for proc in started:
            proc.stop()


HOLDERS = "omni:{adm}:holder"  # session/admission.py: admitted session id → tenant, replica


def ws_url(replica: Proc, query: str = "") -> str:
    return replica.url.replace("http://", "ws://") + "/v1/realtime/video" + query


async def test_world_is_bound_to_its_replica(replicas: tuple[Proc, Proc]) -> None:
    owner, other = replicas
    owner_id = await replica_id_of(owner)
    async with connect(ws_url(owner, "?omni_extensions=1")) as ws:
        resumable = json.loads(await ws.recv())
        assert resumable["type"] == "omni.session.resumable"
        session_id, token = resumable["session_id"], resumable["resume_token"]
        async with httpx.AsyncClient(trust_env=False) as http:
            here = (await http.get(f"{owner.url}/v1/sessions/{session_id}")).json()
            there = (await http.get(f"{other.url}/v1/sessions/{session_id}")).json()
        assert here["kind"] == "world" and here["live_here"] is True
        assert here["replica"]["id"] == owner_id and here["replica"]["epoch"] >= 1
        assert there["live_here"] is False and there["replica"]["id"] == owner_id
        try:
            await connect(
                ws_url(other, f"?session_id={session_id}"), additional_headers={"X-Omni-Resume-Token": token}
            )
            raise AssertionError("a resume on the wrong replica was accepted")
        except InvalidStatus as exc:
            assert exc.response.status_code == 409
            assert json.loads(exc.response.body)["error"]["code"] == "session_elsewhere"
    async with httpx.AsyncClient(trust_env=False) as http:
        for _ in range(100):  # a clean close ends it; its record goes
            if (await http.get(f"{owner.url}/v1/sessions/{session_id}")).status_code == 404:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the world outlived its clean close")


async def test_resume_after_the_owner_died_is_404_and_frees_the_slot(
    redis_server: RedisServerProcess, replicas: tuple[Proc, Proc], tmp_path: Path
) -> None:
    _, other = replicas
    owner = start_replica(redis_server.url, tmp_path, extra=["--max-sessions", "1"])
    try:
        wait_ready([owner], path="/readyz")
        async with connect(ws_url(owner, "?omni_extensions=1")) as ws:
            resumable = json.loads(await ws.recv())
            session_id, token = resumable["session_id"], resumable["resume_token"]
            client = Redis.from_url(redis_server.url)
            try:
                assert await client.hexists(HOLDERS, session_id)  # it holds a slot
            finally:
                await client.aclose()
            owner.kill9()  # the world dies with its process; its binding and slot stay in Redis
        resume = ws_url(other, f"?session_id={session_id}")
        headers = {"X-Omni-Resume-Token": token}
        for _ in range(100):  # while the dead owner's lease runs: 409, it may still be alive
            try:
                await connect(resume, additional_headers=headers)
                raise AssertionError("a resume of a dead world was accepted")
            except InvalidStatus as exc:
                body = json.loads(exc.response.body)
                if exc.response.status_code == 404:
                    assert body["error"]["code"] == "session_not_found"
                    break
                assert exc.response.status_code == 409 and body["error"]["code"] == "session_elsewhere"
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("still 409 long after the owner's lease lapsed")
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{other.url}/v1/sessions/{session_id}")).status_code == 404
        # Its admission slot is given back at once (not only when the dead holder's 6 s slot
        # lease lapses): the 404 came ~1.5 s after the kill.
        client = Redis.from_url(redis_server.url)
        try:
            assert not await client.hexists(HOLDERS, session_id)
        finally:
            await client.aclose()
    finally:
        owner.stop()
