"""`omniduplex serve --workers 2` as a real subprocess: one public port (SO_REUSEPORT), two worker
processes, the parent's embedded redis-server; misrouted resumes and REST calls forwarded."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from tests.scaleout.cluster import RealtimeClient, get
from tests.scaleout.workers_parent import start_parent
from web.deploy.workers import strip_flags

pytestmark = pytest.mark.system


def test_strip_flags_drops_what_the_parent_sets() -> None:
    argv = [
        "serve",
        "--workers",
        "2",
        "--redis-url=redis://x",
        "--replica-id",
        "r",
        "--port",
        "9",
        "--insecure",
    ]
    assert strip_flags(argv) == ["serve", "--port", "9", "--insecure"]


async def _workers(public: str) -> list[dict[str, Any]]:
    r = await get(public + "/v1/replicas", admin=True)
    r.raise_for_status()
    data: list[dict[str, Any]] = r.json()["data"]
    return data


async def _counts(urls: list[str]) -> list[int]:
    out = []
    for url in urls:
        r = await get(url + "/readyz")
        out.append(int(r.json()["sessions"]))
    return out


async def test_two_workers_share_the_port_forward_resumes_and_stop_together(tmp_path: Path) -> None:
    parent = start_parent(tmp_path)  # history-echo engine, the parent's embedded redis-server
    port = parent.port
    clients: list[RealtimeClient] = []
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(workers := await _workers(parent.url)) != 2:
            assert time.monotonic() < deadline, workers
            await asyncio.sleep(0.1)
        urls = [w["url"] for w in workers]
        children = psutil.Process(parent.proc.pid).children(recursive=True)
        assert sum("redis-server" in c.name() for c in children) == 1

        # Sessions opened through the one public port land on both workers (the kernel spreads
        # connections; 8 all on one of two has odds 1/128, so open more until both have some).
        ids: list[str] = []
        tokens: list[str] = []
        while len(clients) < 8 or (min(await _counts(urls)) == 0 and len(clients) < 32):
            client = await RealtimeClient.open(f"ws://127.0.0.1:{port}/v1/realtime?omni_extensions=1")
            created = await client.until("session.created")
            resumable = await client.until("omni.session.resumable")
            clients.append(client)
            ids.append(created["session"]["id"])
            tokens.append(resumable["resume_token"])
            await asyncio.sleep(0.05)
        counts = await _counts(urls)
        assert sum(counts) == len(clients) and min(counts) >= 1, counts
        # /metrics?scope=all: the sessions of every worker, summed (the load test's sampler reads
        # it; the other merge rules: tests/scaleout/test_worker_metrics.py).
        metrics = (await get(parent.url + "/metrics?scope=all")).text
        assert f"omniduplex_active_sessions {float(len(clients))!r}" in metrics.splitlines()

        # Which worker owns session 0, from the other one (GET /v1/sessions is forwarded).
        first = (await get(urls[0] + f"/v1/sessions/{ids[0]}")).json()
        owner_url = first["replica"]["url"]
        other_url = next(u for u in urls if u != owner_url)
        assert (await get(other_url + f"/v1/sessions/{ids[0]}")).json()["replica"]["url"] == owner_url

        # A resume that reaches the non-owner is relayed to the owner: the conversation goes on
        # there (no takeover: the owner is alive), with history kept.
        done = await clients[0].turn("remember me")
        assert done["response"]["status"] == "completed"
        last = clients[0].last_event_id
        owner_before, other_before = await _counts([owner_url, other_url])
        await clients[0].close(1001)
        ws_other = other_url.replace("http://", "ws://")
        resumed = await RealtimeClient.open(
            f"{ws_other}/v1/realtime?session_id={ids[0]}&last_event_id={last}",
            additional_headers={"X-Omni-Resume-Token": tokens[0]},
        )
        clients[0] = resumed
        done = await resumed.turn("again")
        assert done["response"]["status"] == "completed"
        assert "remember me" in str(done)  # the history echo: the owner kept the conversation
        assert await _counts([owner_url, other_url]) == [owner_before, other_before]

        # DELETE through the non-owner ends the session on its owner.
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            deleted = await http.delete(other_url + f"/v1/sessions/{ids[0]}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        deadline = time.monotonic() + 10
        while await live_sessions_at(owner_url) != owner_before - 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

        # A hangup that reaches the worker that did not answer the call is tried on its sibling.
        calls_before = await live_sessions_at(owner_url)
        async with RealtimeCallClient(owner_url) as call:
            assert call.call is not None and call.call.status_code == 201
            await call.wait_event("session.created")
            assert await live_sessions_at(owner_url) == calls_before + 1
            async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
                hung = await http.post(f"{other_url}{call.call.location}/hangup")
                unknown = await http.post(f"{other_url}/v1/realtime/calls/rtc_nope/hangup")
            assert hung.status_code == 200
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "call_not_found"
            deadline = time.monotonic() + 10
            while await live_sessions_at(owner_url) != calls_before:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

        # A resume on a new WebRTC call that reaches the non-owner goes to the owner too (the
        # answer carries the owner's candidates); its hangup through the non-owner finds it.
        owner1 = (await get(urls[0] + f"/v1/sessions/{ids[1]}")).json()["replica"]["url"]
        other1 = next(u for u in urls if u != owner1)
        last1 = clients[1].last_event_id
        await clients[1].close(1001)
        call = RealtimeCallClient(other1)
        try:
            info = await call.connect(resume=(ids[1], tokens[1], last1))
            assert info.status_code == 201
            _, back = await call.wait_event("omni.session.resumed")
            assert back["session_id"] == ids[1]
            assert (await get(owner1 + f"/v1/sessions/{ids[1]}")).json()["connected"] is True
            assert await call.hangup() == 200
        finally:
            await call.close()

        for client in clients:
            await client.close()
        clients.clear()
        # SIGTERM to the parent: the workers drain (nothing left) and exit, redis stops.
        pids = [c.pid for c in children]
        parent.sigterm()
        assert parent.proc.wait(timeout=30) == 0
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    finally:
        for client in clients:
            await client.close()
        parent.stop()
        for c in children:  # only after a failure: none may outlive the test
            if c.is_running():
                c.send_signal(signal.SIGKILL)


async def live_sessions_at(url: str) -> int:
    return int((await get(url + "/readyz")).json()["sessions"])
