"""A real omniduplex server on a free loopback port, run by uvicorn in a background thread.

The server gets its own event loop (so test loops come and go freely) and, unless a Redis URL
is given, its own embedded redis-server in a temp data dir.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from web.commands.serve import uvicorn_config
from web.settings import ServerSettings

_GIVEN_PORTS: set[int] = set()
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never handed out before in this process: the kernel may give
    the same ephemeral port to two binds in a row once the first socket is closed, and two servers
    started one after the other (before either binds) then race for one port."""
    with _GIVEN_LOCK:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port
    raise RuntimeError("no loopback port left that this process has not handed out")


@dataclass
class LiveServer:
    settings: ServerSettings
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.settings.port}"

    @property
    def base_url(self) -> str:
        """For `AsyncOpenAI(base_url=...)`."""
        return f"{self.http_url}/v1"

    @property
    def ctx(self) -> Any:
        """The server's ServerContext (touch it only from the server's loop, or read-only)."""
        return self.server.config.app.state.ctx


@contextmanager
def live_server(data_dir: Path, **overrides: Any) -> Iterator[LiveServer]:
    names = {f.name for f in fields(ServerSettings)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown ServerSettings fields: {sorted(unknown)}")
    # The echo responder ("You said: ...") unless a test asks for the default LM: deterministic
    # answers, and no language model to load for every server a test starts.
    overrides.setdefault("responder", "echo")
    settings = ServerSettings(port=free_port(), data_dir=str(data_dir), **overrides)
    server = uvicorn.Server(uvicorn_config(settings, log_level="warning"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server thread died during startup")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start in 120 s")
        time.sleep(0.02)
    live = LiveServer(settings, server, thread)
    assert httpx.get(f"{live.http_url}/readyz", timeout=10).status_code == 200
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
