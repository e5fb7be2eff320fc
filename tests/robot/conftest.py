"""Robot session tests: a real server (tests/live_server.py) with the bare openpi port on a
real redis-server, and the real ``openpi-client`` in its own virtual environment.

openpi-client pins ``numpy<2`` (the server's environment has numpy 2), so it lives in a venv
of its own: ``make openpi-venv`` creates it (``make test`` does so first); a run without it
creates it here, once, from the package index (a few seconds with pip's cache). Its
interpreter runs ``openpi_client_script.py`` as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest_redis import RedisServerProcess, start_tcp_redis
from tests.live_server import LiveServer, free_port, live_server

REPO = Path(__file__).resolve().parents[2]
# An empty variable means "unset": Path("") is the working directory, never a venv to create.
OPENPI_VENV = Path(os.environ.get("OMNIDUPLEX_OPENPI_VENV") or REPO / ".venv-openpi").resolve()
OPENPI_REQUIREMENTS = ["openpi-client==0.1.2", "typing_extensions"]  # 0.1.2 imports it undeclared
KEYS = {"sk-robot-a": "tenant-a", "sk-robot-b": "tenant-b"}
GRACE_S = 15.0  # a resuming openpi client is a new process: its start must fit in it on a busy host


def openpi_python() -> Path:
    """The openpi-client venv's interpreter, creating the venv when it is missing. It is made
    only in a directory that does not exist yet or is a (half-made) venv: never over a folder
    with anything else in it (``venv --clear`` would empty it)."""
    python = OPENPI_VENV / "bin" / "python"
    ready = OPENPI_VENV / ".installed"
    if not ready.exists():
        leftovers = {p.name for p in OPENPI_VENV.iterdir()} if OPENPI_VENV.is_dir() else set()
        if leftovers - {"bin", "include", "lib", "lib64", "pyvenv.cfg", "share"}:
            raise RuntimeError(f"{OPENPI_VENV} is not a venv; point OMNIDUPLEX_OPENPI_VENV elsewhere")
        subprocess.run([sys.executable, "-m", "venv", str(OPENPI_VENV)], check=True, timeout=300)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *OPENPI_REQUIREMENTS], check=True, timeout=600
        )
        ready.touch()
    return python


@pytest.fixture(scope="session")
def openpi_client_python() -> Path:
    return openpi_python()


@pytest.fixture(scope="module")
def robot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    redis: RedisServerProcess = start_tcp_redis(tmp_path_factory.mktemp("redis"))
    try:
        with live_server(
            Path(tmp_path_factory.mktemp("srv")),
            pipeline="null",
            vad=False,
            redis_url=redis.url,
            api_keys=",".join(f"{k}:{t}" for k, t in KEYS.items()),
            openpi_port=free_port(),
            max_sessions=16,
            admission_queue_max=0,
            disconnect_grace_s=GRACE_S,
        ) as live:
            yield live
    finally:
        redis.stop()
