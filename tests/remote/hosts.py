"""Stage hosts as real processes (`python -m web.cli stage ...`) for the remote-stage tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import yaml

from session.store.embedded import find_redis_server
from tests.conftest_redis import RedisServerProcess

ROOT = Path(__file__).resolve().parents[2]
KEY = "remote-stage-test-key-0123456789"


def tiny_pipeline(path: Path, *, max_tokens: int = 10, max_frames: int = 60) -> Path:
    """qwen3-omni-tiny with replies of a fixed length: random weights may stop at any token or
    frame (or never), so every turn has ``max_tokens`` tokens and ``max_frames`` frames of audio."""
    spec = yaml.safe_load((ROOT / "runtime/pipelines/qwen3-omni-tiny.yaml").read_text())
    for stage in spec["stages"]:
        if stage["name"] == "thinker":
            stage["options"].update(max_tokens=max_tokens, min_tokens=max_tokens)
        if stage["name"] == "talker":
            stage["options"].update(max_frames=max_frames, min_frames=max_frames)
    path.write_text(yaml.safe_dump(spec))
    return path


@dataclass
class StageHostProcess:
    proc: subprocess.Popen[str]
    stage: str
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    control: str = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("stage host ready:"):
                self.control = line.split("control=")[1].split()[0]
                self.ready.set()
        self.ready.set()

    @property
    def output(self) -> str:
        return "\n".join(line for line in self.lines if line[:1] not in "IWE" or not line[1:2].isdigit())

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self.ready.wait(timeout) or not self.control:
            raise RuntimeError(f"stage host {self.stage} did not start:\n{self.output[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)


def start_host(
    pipeline: str | Path,
    stage: str,
    redis_url: str,
    *,
    key: str | None = KEY,
    extra: Sequence[str] = (),
    prefix: Sequence[str] = (),
    wait: bool = True,
) -> StageHostProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("OMNIDUPLEX_STAGE_KEY", None)
    if key is not None:
        env["OMNIDUPLEX_STAGE_KEY"] = key
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "web.cli",
        "stage",
        "--pipeline",
        str(pipeline),
        "--stage",
        stage,
        "--redis-url",
        redis_url,
        "--lease-s",
        "3",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    host = StageHostProcess(proc, stage)
    threading.Thread(target=host._read, daemon=True, name=f"host-{stage}").start()
    if wait:
        host.wait_ready()
    return host


async def until(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.1)


async def wait_members(orchestrator: Any, counts: dict[str, int], within_s: float = 60.0) -> None:
    """Until the server's remote stages hold ``counts`` ready replicas (read from another thread)."""
    remote = orchestrator.remote

    def ready() -> dict[str, int]:
        return {
            name: sum(1 for m in list(stage.members.values()) if m.replica.ready)
            for name, stage in remote.stages.items()
        }

    await until(
        lambda: all(ready().get(name, 0) == n for name, n in counts.items()),
        within_s,
        f"remote replicas {counts} (have {ready()}; refused: {remote.refused})",
    )


def restart_tcp_redis(server: RedisServerProcess, timeout_s: float = 10.0) -> RedisServerProcess:
    """A fresh, empty redis-server on the port ``server`` had (stopped first)."""
    server.stop()
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            str(server.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(server.data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return RedisServerProcess(server.url, server.port, server.data_dir, proc)
            except redis.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    proc.kill()
    raise RuntimeError(f"redis-server did not come back on port {server.port}")
