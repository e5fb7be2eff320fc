"""Real processes on loopback for the scale-out tests: replicas and gateways as subprocesses.

Each process runs on a free port with its output in a log file under the test's tmp dir
(printed when a start fails). Replicas are ``omniduplex serve`` with the session tests'
history-echo engine (``tests.sessions.serve_with_test_engines``): a reply says what history it
was given, so a migrated session visibly kept its conversation; it starts 30 ms after
admission and streams 600 ms of audio in real time, so a test can act mid-response. Leases
are short (1.5 s, beats every 0.3 s) so a lapse takes ~1.5 s, not 5 s.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.realtime_client import RealtimeClient
from loadtest.server_process import Child, replica_args, spawn
from tests.live_server import free_port
from tests.sessions.history_engine import pipeline_file

LEASE_S = 1.5
REFRESH_S = 0.3
ADMIN_KEY = "test-admin-key"


Proc = Child  # a replica or gateway subprocess: ``name`` is its role


def _spawn(role: str, args: Sequence[str], log_dir: Path, port: int, *, module: str = "web.cli") -> Proc:
    return spawn(role, ["-m", module, *args], log_dir, port, drop_env=("OMNIDUPLEX_API_KEYS",))


def start_replica(redis_url: str, tmp: Path, *, lease_s: float = LEASE_S, extra: Sequence[str] = ()) -> Proc:
    port = free_port()
    pipeline = pipeline_file(tmp / "pipeline", delay_ms=30, audio_ms=600)
    serve = replica_args(
        redis_url,
        port,
        pipeline=str(pipeline),
        lease_s=lease_s,
        refresh_s=REFRESH_S,
        data_dir=tmp / f"data-{port}",
    )
    args = [
        *serve,
        "--admin-key",
        ADMIN_KEY,
        "--log-level",
        os.environ.get("SCALEOUT_LOG_LEVEL", "warning"),
        *extra,
    ]
    return _spawn("replica", args, tmp / "logs", port, module="tests.sessions.serve_with_test_engines")


def start_gateway(redis_url: str, tmp: Path, *, extra: Sequence[str] = ()) -> Proc:
    port = free_port()
    args = ["gateway", "--redis-url", redis_url, "--port", str(port), "--admin-key", ADMIN_KEY]
    return _spawn("gateway", [*args, "--log-level", "warning", *extra], tmp / "logs", port)


def wait_ready(procs: Sequence[Proc], *, path: str = "/healthz", timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        p = pending[0]
        if not p.alive():
            raise RuntimeError(f"{p.name} on {p.port} exited ({p.proc.returncode}):\n{p.tail(4000)}")
        try:
            if httpx.get(p.url + path, timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{p.name} on {p.port} not ready in {timeout_s} s:\n{p.tail(4000)}")
        time.sleep(0.05)


async def get(url: str, *, admin: bool = False, timeout_s: float = 10.0) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"} if admin else None
    async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as http:
        return await http.get(url, headers=headers)


async def replicas_view(proc: Proc) -> list[dict[str, Any]]:
    """``GET /v1/replicas`` (admin) of a gateway or replica: the live registry."""
    r = await get(proc.url + "/v1/replicas", admin=True)
    r.raise_for_status()
    data: list[dict[str, Any]] = r.json()["data"]
    return data


async def replica_id_of(replica: Proc) -> str:
    r = await get(replica.url + "/v1/replicas", admin=True)
    r.raise_for_status()
    return str(r.json()["self"])


async def live_sessions(replica: Proc) -> int:
    return int((await get(replica.url + "/readyz")).json()["sessions"])


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str, poll_s: float = 0.05
) -> float:
    """Poll ``await predicate()`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


@dataclass
class Cluster:
    redis_url: str
    tmp: Path
    replicas: list[Proc] = field(default_factory=list)
    gateways: list[Proc] = field(default_factory=list)

    @property
    def gateway(self) -> Proc:
        return self.gateways[0]

    def add_replicas(self, n: int, **kwargs: Any) -> list[Proc]:
        new = [start_replica(self.redis_url, self.tmp, **kwargs) for _ in range(n)]
        self.replicas += new
        wait_ready(new, path="/readyz")
        return new

    def add_gateway(self, redis_url: str | None = None, *, extra: Sequence[str] = ()) -> Proc:
        gw = start_gateway(redis_url or self.redis_url, self.tmp, extra=extra)
        self.gateways.append(gw)
        wait_ready([gw])
        return gw

    def wait_registered(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        url = self.gateway.url + "/v1/replicas"
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        while len(httpx.get(url, headers=headers, timeout=5).json()["data"]) != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} replicas not registered in {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.gateways + self.replicas:
            p.stop()


@contextmanager
def cluster(redis_url: str, tmp: Path, *, replicas: int = 2, extra: Sequence[str] = ()) -> Iterator[Cluster]:
    """A gateway and ``replicas`` replicas (``extra``: arguments for all of them)."""
    c = Cluster(redis_url, tmp)
    try:
        c.add_gateway(extra=extra)
        c.add_replicas(replicas, extra=extra)
        c.wait_registered(replicas)
        yield c
    finally:
        c.stop()


@dataclass
class Session:
    """A session opened through a gateway: its id, resume token and current connection."""

    session_id: str
    token: str
    client: RealtimeClient

    @classmethod
    async def open(cls, gateway: Proc) -> Session:
        client = await RealtimeClient.open(f"{gateway.ws_url}?omni_extensions=1")  # asks for omni.*
        created = await client.until("session.created")
        resumable = await client.until("omni.session.resumable")
        assert resumable["session_id"] == created["session"]["id"]
        return cls(created["session"]["id"], resumable["resume_token"], client)

    async def resume(self, gateway: Proc, last_event_id: str | None = None) -> RealtimeClient:
        """Reconnect through ``gateway`` from ``last_event_id`` (default: the last one seen)."""
        last = last_event_id or self.client.last_event_id
        url = f"{gateway.ws_url}?session_id={self.session_id}&last_event_id={last}"
        self.client = await RealtimeClient.open(url, additional_headers={"X-Omni-Resume-Token": self.token})
        return self.client
