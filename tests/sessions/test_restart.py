"""kill -9 of `omniduplex serve`, then a new process on the same embedded data directory:
the session resumes (its log replays, a response cut by the crash is ended) and the
conversation continues with its history."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from session.store.embedded import pid_alive
from tests.conftest_redis import _free_port
from tests.sessions.client import logged, opened, reply_text, resumed, turn
from tests.sessions.history_engine import pipeline_file

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`omniduplex serve` (with the test engines registered) as a child process."""

    def __init__(self, data_dir: Path, pipeline: Path) -> None:
        self.data_dir = data_dir
        self.pipeline = pipeline
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "tests.sessions.serve_with_test_engines", "serve"]
        cmd += ["--port", str(self.port), "--data-dir", str(self.data_dir), "--pipeline", str(self.pipeline)]
        cmd += ["--log-level", "warning"]
        log = (self.data_dir.parent / f"server-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.1)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def stop_embedded_redis(data_dir: Path) -> None:
    """The embedded redis-server outlives a kill -9 of its server (by design); end it."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((data_dir / "redis.pid").read_text().strip())
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "od"
    try:
        yield folder
    finally:
        stop_embedded_redis(folder)


async def test_kill9_restart_resume_and_continue_with_history(tmp_path: Path, data_dir: Path) -> None:
    pipeline = pipeline_file(tmp_path / "pipeline", audio_ms=3000)
    first = ServerProcess(data_dir, pipeline)
    first.start()
    try:
        async with opened(first.base) as conn:
            done = await turn(conn, "my name is Ada", audio=False)
            assert reply_text(done) == "my name is Ada | history: -"
            # A second turn the crash cuts in the middle.
            await turn(conn, "count to ten", wait=False)
            await conn.events.wait_for("response.output_audio.delta", within_s=10)
            first.kill9()
            await conn.events.close_code(within_s=10)
        seen = logged(conn.events.log)
    finally:
        first.stop()
    cut = next(e for e in reversed(seen) if e["type"] == "response.created")["response"]["id"]

    second = ServerProcess(data_dir, pipeline)
    second.start()
    try:
        async with resumed(second.base, conn.session_id, conn.resume_token, conn.last_event_id) as again:
            try:
                ended = (await again.events.wait_for("response.done", within_s=10)).raw["response"]
            except TimeoutError:
                print([(r.type, r.raw["event_id"]) for r in again.events.log])
                raise
            # The dead process held its audio deltas (not logged): the replay says they are not
            # kept, or the client resyncs (its last event was not durable yet).
            hello = again.events.log[0].raw
            assert hello["type"] == "omni.session.resumed"
            assert hello.get("audio_replay") == "not_kept" or hello.get("replay_unavailable")
            # The response the crash cut short is ended for the client, as failed.
            assert ended["id"] == cut and ended["status"] == "failed"
            reply = await turn(again, "what is my name?", audio=False)
            text = reply_text(reply)
            assert text.startswith(
                "what is my name? | history: user:my name is Ada / assistant:my name is Ada"
            )
            assert "user:count to ten" in text
            # Ids continue after the restart without colliding with the dead process's.
            ids = [e["event_id"] for e in logged(again.events.log)]
            assert not set(ids) & {e["event_id"] for e in seen}
    finally:
        second.stop()
    # A clean stop (SIGTERM) also stops the embedded redis-server it adopted.
    pidfile = data_dir / "redis.pid"
    assert not pidfile.exists() or not pid_alive(int(pidfile.read_text()))


async def test_response_cut_before_its_first_output_is_ended_after_restart(
    tmp_path: Path, data_dir: Path
) -> None:
    """The crash comes after `response.created` but before any output: there is no output
    item to find in progress, so the store's record of the open response is what ends it."""
    pipeline = pipeline_file(tmp_path / "pipeline", delay_ms=30_000)
    first = ServerProcess(data_dir, pipeline)
    first.start()
    try:
        async with opened(first.base) as conn:
            await turn(conn, "a slow one", wait=False)
            created = await conn.events.wait_for("response.created", within_s=10)
            await asyncio.sleep(0.3)  # the open response is flushed at once; give it time
            first.kill9()
            await conn.events.close_code(within_s=10)
        seen = logged(conn.events.log)
    finally:
        first.stop()
    cut = created.raw["response"]["id"]
    assert not [e for e in seen if e["type"] == "response.output_item.added"]

    second = ServerProcess(data_dir, pipeline)
    second.start()
    try:
        async with resumed(second.base, conn.session_id, conn.resume_token, conn.last_event_id) as again:
            ended = (await again.events.wait_for("response.done", within_s=10)).raw["response"]
            assert ended["id"] == cut and ended["status"] == "failed" and ended["output"] == []
            await asyncio.sleep(0.3)  # its end is flushed at once too
            second.kill9()
            await again.events.close_code(within_s=10)
    finally:
        second.stop()
    # Ended once: the store no longer has it open, so the next restore does not end it again.
    third = ServerProcess(data_dir, pipeline)
    third.start()
    try:
        async with resumed(third.base, conn.session_id, conn.resume_token, again.last_event_id) as last:
            assert last.events.log[0].type == "omni.session.resumed"
            await asyncio.sleep(0.5)
            assert not [r for r in last.events.log if r.type == "response.done"]
    finally:
        third.stop()
