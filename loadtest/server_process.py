"""A server under test: an external URL, or an ``omniduplex serve`` subprocess we start and stop."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Target:
    """Where the load goes: ``base_url`` is ``http://host:port``."""

    base_url: str
    label: str = "server"
    server_args: list[str] = field(default_factory=list)  # when we started it ourselves
    idle_rss_mb: float | None = None  # before the first level: the baseline for RSS growth
    pid: int | None = None  # a server we started: its process tree (with redis) is sampled too

    @property
    def ws_url(self) -> str:
        return "ws" + self.base_url.removeprefix("http") + "/v1/realtime"


@dataclass(slots=True)
class ConfigSpec:
    """A server configuration to start: ``LABEL=ARGS`` on the command line."""

    label: str
    args: list[str]

    @classmethod
    def parse(cls, text: str) -> ConfigSpec:
        label, sep, args = text.partition("=")
        if not sep or not label.strip():
            raise ValueError(f"expected LABEL=SERVER_ARGS, got {text!r}")
        return cls(label.strip(), shlex.split(args))


async def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited during startup (code {proc.returncode})")
            try:
                if (await client.get(f"{base_url}/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.25)


class ServerProcess:
    """``python -m web.cli serve`` on a free loopback port with a throwaway data dir."""

    def __init__(
        self, config: ConfigSpec, *, log_dir: Path, ready_timeout_s: float = 600.0, nice: int = 0
    ) -> None:
        self.config = config
        self.nice = nice
        self.port = free_port()
        self.log_path = log_dir / f"server-{safe_name(config.label)}.log"
        self.ready_timeout_s = ready_timeout_s
        self._data_dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def target(self) -> Target:
        pid = self._proc.pid if self._proc is not None else None
        return Target(f"http://127.0.0.1:{self.port}", self.config.label, list(self.config.args), pid=pid)

    @property
    def command(self) -> list[str]:
        assert self._data_dir is not None
        # `nice` before exec, so every thread of the server inherits the priority; its -n is
        # relative to our own niceness (which the load generator may already have changed).
        adjust = self.nice - os.getpriority(os.PRIO_PROCESS, 0) if self.nice else 0
        prefix = ["nice", "-n", str(adjust)] if adjust else []
        return [
            *prefix,
            sys.executable,
            "-m",
            "web.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            self._data_dir,
            "--log-level",
            "warning",
            # load runs measure the server, not a language model: the echo unless asked
            *([] if "--responder" in self.config.args else ["--responder", "echo"]),
            *self.config.args,
        ]

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._data_dir = tempfile.mkdtemp(prefix="omniduplex-loadtest-")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    async def __aenter__(self) -> Target:
        self._proc = await asyncio.to_thread(self._spawn)
        try:
            await wait_ready(self.target.base_url, self.ready_timeout_s, self._proc)
        except BaseException:
            await self.stop()
            raise
        return self.target

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None


def server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def safe_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "server"


# --- child processes on loopback ports (the benches' and the scale-out tests') ---------------------


@dataclass
class Child:
    """A subprocess we started (and only that one is ever signalled)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def sigterm(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGINT)  # uvicorn: shut down now, no drain
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()

    def tail(self, chars: int = 3000) -> str:
        """The end of its log (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def spawn(name: str, args: Sequence[str], log_dir: Path, port: int, *, drop_env: Sequence[str] = ()) -> Child:
    """``python ARGS`` in the repository root, output in ``log_dir/NAME-PORT.log``; ``drop_env``:
    environment variables it must not inherit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in drop_env:
        env.pop(key, None)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return Child(name, port, proc, log_path)


def replica_args(
    redis_url: str, port: int, *, pipeline: str, lease_s: float, refresh_s: float, data_dir: Path
) -> list[str]:
    """``serve`` arguments for a replica on ``port`` that registers itself in ``redis_url``."""
    return [
        "serve",
        "--pipeline",
        pipeline,
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--advertise-url",
        f"http://127.0.0.1:{port}",
        "--replica-lease-s",
        str(lease_s),
        "--replica-refresh-s",
        str(refresh_s),
        "--data-dir",
        str(data_dir),
    ]
