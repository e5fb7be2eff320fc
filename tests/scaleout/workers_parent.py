"""`omniduplex serve --workers N` as a real subprocess for the worker tests: start it, find its
workers (registry entries and processes), stop everything it started."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from loadtest.server_process import Child, spawn
from tests.live_server import free_port
from tests.scaleout.cluster import ADMIN_KEY, get, wait_ready
from tests.sessions.history_engine import pipeline_file


@dataclass(slots=True)
class WorkerView:
    """One live worker as the registry lists it, and its process."""

    replica_id: str
    url: str  # private advertise URL
    pid: int


def start_parent(tmp_path: Path, workers: int = 2, *, log_level: str = "warning") -> Child:
    """The parent of ``serve --workers N`` (history-echo engine, embedded redis-server, short leases)."""
    port = free_port()
    pipeline = pipeline_file(tmp_path / "pipeline", delay_ms=30, audio_ms=300)
    args = [
        "-m",
        "tests.sessions.serve_with_test_engines",  # the workers run the same entry point
        "serve",
        "--workers",
        str(workers),
        "--pipeline",
        str(pipeline),
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
        "--admin-key",
        ADMIN_KEY,
        "--replica-lease-s",
        "1.5",
        "--replica-refresh-s",
        "0.3",
        "--log-level",
        log_level,
    ]
    parent = spawn("workers", args, tmp_path / "logs", port, drop_env=("OMNIDUPLEX_API_KEYS",))
    try:
        wait_ready([parent], path="/readyz", timeout_s=90)
    except BaseException:
        parent.stop()
        raise
    return parent


def _pid_of(parent: Child, replica_id: str) -> int:
    for child in psutil.Process(parent.proc.pid).children():
        if replica_id in child.cmdline():
            return int(child.pid)
    raise LookupError(f"no worker process with --replica-id {replica_id}")


async def live_workers(parent: Child, count: int, timeout_s: float = 30.0) -> list[WorkerView]:
    """The ``count`` live workers, by replica id, once that many are registered."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await get(parent.url + "/v1/replicas", admin=True)
        r.raise_for_status()
        data: list[dict[str, Any]] = r.json()["data"]
        if len(data) == count:
            rows = sorted(data, key=lambda d: str(d["id"]))
            return [WorkerView(d["id"], d["url"], _pid_of(parent, d["id"])) for d in rows]
        assert time.monotonic() < deadline, data
        await asyncio.sleep(0.1)


def descendants(parent: Child) -> list[psutil.Process]:
    return list(psutil.Process(parent.proc.pid).children(recursive=True))


def stop_everything(parent: Child, children: list[psutil.Process]) -> None:
    """After a failure: nothing the test started may outlive it."""
    parent.stop()
    for c in children:
        if c.is_running():
            c.send_signal(signal.SIGKILL)


def gone(pids: list[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
