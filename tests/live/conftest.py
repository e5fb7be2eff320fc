"""GPT-Live session tests: a real server on ``duplex-tiny`` (tests/live_server.py, its own
embedded redis-server), driven by LiveKit Agents' unmodified ``GPTLiveModel`` and by raw
WebSocket clients.

``livekit-agents`` 1.8.9 pins ``opentelemetry-sdk`` 1.45.2, whose API pin would downgrade the
server environment's ``opentelemetry-api``, so the plugin lives in a venv of its own: ``make
livekit-venv`` creates it (``make test`` does so first); a run without it creates it here, once,
from the package index. Its interpreter runs ``gpt_live_client.py`` as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.live_server import LiveServer, live_server

REPO = Path(__file__).resolve().parents[2]
# An empty variable means "unset": Path("") is the working directory, never a venv to create.
LIVEKIT_VENV = Path(os.environ.get("OMNIDUPLEX_LIVEKIT_VENV") or REPO / ".venv-livekit").resolve()
LIVEKIT_REQUIREMENTS = ["livekit-agents==1.8.9"]
CLIENT = Path(__file__).with_name("gpt_live_client.py")
KEYS = {"sk-live-a": "tenant-a", "sk-live-b": "tenant-b"}


def livekit_python() -> Path:
    """The livekit venv's interpreter, creating the venv when it is missing (only in a directory
    that does not exist yet or is a half-made venv: ``venv`` never runs over anything else)."""
    python = LIVEKIT_VENV / "bin" / "python"
    ready = LIVEKIT_VENV / ".installed"
    if not ready.exists():
        leftovers = {p.name for p in LIVEKIT_VENV.iterdir()} if LIVEKIT_VENV.is_dir() else set()
        if leftovers - {"bin", "include", "lib", "lib64", "pyvenv.cfg", "share"}:
            raise RuntimeError(f"{LIVEKIT_VENV} is not a venv; point OMNIDUPLEX_LIVEKIT_VENV elsewhere")
        subprocess.run([sys.executable, "-m", "venv", str(LIVEKIT_VENV)], check=True, timeout=300)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *LIVEKIT_REQUIREMENTS], check=True, timeout=900
        )
        ready.touch()
    return python


@pytest.fixture(scope="session")
def livekit_client_python() -> Path:
    return livekit_python()


def run_gpt_live(python: Path, server: LiveServer, *args: str, timeout_s: float = 120) -> dict[str, Any]:
    """Run the GPTLiveModel client against ``server``; its JSON report."""
    done = subprocess.run(
        [str(python), str(CLIENT), "--base-url", server.base_url, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=str(CLIENT.parent),  # not the repo root: the client imports nothing of ours
    )
    assert done.returncode == 0, f"client failed ({done.returncode}):\n{done.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = ",".join(f"{key}:{tenant}" for key, tenant in KEYS.items())
    with live_server(
        Path(tmp_path_factory.mktemp("srv")),
        pipeline="duplex-tiny",
        vad=False,
        api_keys=keys,
        disconnect_grace_s=2.0,
    ) as live:
        yield live
