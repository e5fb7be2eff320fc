"""Session-layer tests: real servers (tests/live_server.py) on real `redis-server`s.

Each module gets its own redis-server on a free port (`module_redis`), so admission counters
and keys of one module never meet another's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.conftest_redis import RedisServerProcess, start_tcp_redis
from tests.live_server import LiveServer, live_server
from tests.sessions.history_engine import pipeline_file, register

T = TypeVar("T")


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServerProcess]:
    server = start_tcp_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def session_server(
    folder: Path,
    redis_url: str | None,
    *,
    audio_ms: int = 800,
    engine_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Iterator[LiveServer]:
    """A live server on the history-echo test pipeline (no VAD model) using `redis_url`
    (None: its own embedded redis-server in `folder`); `engine_options` go to its engine."""
    register()
    pipeline = pipeline_file(folder, audio_ms=audio_ms, **(engine_options or {}))
    settings: dict[str, Any] = {"pipeline": str(pipeline), "vad": False, **overrides}
    if redis_url is not None:
        settings["redis_url"] = redis_url
    with live_server(folder, **settings) as live:
        yield live


def on_server(server: LiveServer, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    """Run a coroutine on the server's event loop (its Redis client lives there)."""
    loop = server.ctx.host.loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


async def on_server_async(server: LiveServer, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    loop = server.ctx.host.loop
    assert loop is not None
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
