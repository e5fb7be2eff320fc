"""Redis faults: down at open → 503 before the upgrade; lost during a session → the session
keeps working in this process, its writer buffers and catches up once Redis is back, and the
events of the outage replay on a resume."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import websockets
from websockets.exceptions import InvalidStatus

from session.store.embedded import find_redis_server
from tests.conftest_redis import _free_port
from tests.live_server import LiveServer
from tests.sessions.client import logged, opened, realtime_url, resumed, seq, turn, until
from tests.sessions.conftest import session_server

pytestmark = pytest.mark.system


class DurableRedis:
    """A redis-server on a fixed port with an AOF, so it can be killed and come back whole."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen([find_redis_server(), *args], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[DurableRedis]:
    server = DurableRedis(tmp_path / "redis")
    server.folder.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def server(tmp_path: Path, durable_redis: DurableRedis) -> Iterator[LiveServer]:
    with session_server(tmp_path / "srv", durable_redis.url, audio_ms=400) as live:
        yield live


async def event_count(server: LiveServer, session_id: str) -> int:
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        response = await http.get(f"/v1/sessions/{session_id}")
        return int(response.json()["event_count"]) if response.status_code == 200 else -1


async def test_redis_lost_during_a_session(server: LiveServer, durable_redis: DurableRedis) -> None:
    async with opened(server) as conn:
        await turn(conn, "before the outage")
        durable_redis.kill()

        # Opens are refused with 503 before the upgrade, with a clear body.
        with pytest.raises(InvalidStatus) as caught:
            async with websockets.connect(realtime_url(server), open_timeout=10):
                pass
        assert caught.value.response.status_code == 503
        assert json.loads(caught.value.response.body)["error"]["code"] == "store_unavailable"
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            assert (await http.get(f"/v1/sessions/{conn.session_id}")).status_code == 503

        # The live session keeps working in this process.
        mark = len(conn.events.log)
        during = await turn(conn, "during the outage")
        assert during[-1].raw["response"]["status"] == "completed"
        assert server.ctx.host.sessions[conn.session_id].writer.pending > 0

        # Redis comes back: the writer catches up on its own (backoff ≤ 2 s).
        durable_redis.start()
        last = seq(conn.events.log[-1].raw)
        await until(lambda: _count_is(server, conn.session_id, last), within_s=15)
        conn.abort()

    # What was said during the outage replays exactly.
    resume_from = conn.events.log[mark - 1].raw["event_id"]
    async with resumed(server, conn.session_id, conn.resume_token, resume_from) as again:
        replayed = await again.events.collect_until("response.done", within_s=10)
    assert logged(replayed) == logged(conn.events.log[mark:])


async def _count_is(server: LiveServer, session_id: str, expected: int) -> bool:
    return await event_count(server, session_id) == expected
