"""The parent of `serve --workers N` restarts a dead worker with a growing delay and gives up on
a crash loop: it logs why, drains the other workers and exits 1 (web/deploy/workers.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.scaleout.workers_parent import descendants, gone, live_workers, start_parent, stop_everything
from web.deploy.workers import RestartPolicy, Supervisor, worker_label

pytestmark = pytest.mark.system

# A stand-in worker for the supervisor alone: worker 1 dies at start, every time; the others
# serve until SIGTERM, then exit 0 (as a drained worker does).
FAKE_WORKER = """
import signal, sys, time
replica = sys.argv[sys.argv.index("--replica-id") + 1]
if replica.startswith("rep_w1_"):
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


def test_restart_delay_doubles_per_recent_exit_and_gives_up_past_the_limit() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=60.0, backoff_s=0.25, backoff_max_s=2.0)
    exits: list[float] = []
    delays = []
    for now in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0):
        exits = [*policy.recent(exits, now), now]
        delays.append(policy.delay(exits, now))
    assert delays == [0.25, 0.5, 1.0, 2.0, 2.0, None]  # capped, then the sixth exit: give up


def test_exits_older_than_the_window_are_forgotten() -> None:
    """A worker that dies now and then (once a minute) is restarted soon, for ever."""
    policy = RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.25)
    exits: list[float] = []
    for now in range(0, 600, 61):
        exits = [*policy.recent(exits, float(now)), float(now)]
        assert policy.delay(exits, float(now)) == 0.25


def test_worker_label_is_the_index_across_restarts() -> None:
    assert worker_label("rep_w3_0a1b2c3d") == "3"
    assert worker_label("rep_5f00d") == "rep_5f00d"  # a plain replica keeps its id


def test_a_worker_dying_at_start_is_restarted_with_backoff_then_the_others_drain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    policy = RestartPolicy(max_restarts=4, window_s=60.0, backoff_s=0.1, backoff_max_s=0.4)
    sup = Supervisor([sys.executable, str(script)], "redis://unused", 2, policy=policy, poll_s=0.02)
    caplog.set_level(logging.INFO, logger="omniduplex.workers")
    sup.start()
    try:
        wall0, cpu0 = time.monotonic(), time.process_time()
        code = sup.supervise([])
        wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    finally:
        sup.stopping = True
        sup.signal_all(signal.SIGKILL)
        sup.wait_all(timeout_s=5.0)
    assert code == 1
    healthy, looping = sup.workers
    # Five exits of worker 1 (four restarts allowed), each restart later than the one before.
    assert len(looping.exits) == 5
    gaps = [b - a for a, b in zip(looping.exits, looping.exits[1:], strict=False)]
    assert all(gap >= delay for gap, delay in zip(gaps, (0.1, 0.2, 0.4, 0.4), strict=True)), gaps
    assert wall >= 1.1
    # No spinning: the parent slept between polls (its own CPU, children not counted).
    assert cpu < 0.3 * wall, (cpu, wall)
    # The healthy worker got SIGTERM (drain) and exited 0: not SIGINT, not SIGKILL.
    assert healthy.proc is not None and healthy.proc.returncode == 0
    assert sum(r.message.startswith("worker 0: pid") for r in caplog.records) == 1
    give_up = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(give_up) == 1 and "worker 1 is crash-looping (5 exits in 60 s" in give_up[0].message
    assert "draining the other workers, then exiting 1" in give_up[0].message


async def test_a_worker_whose_port_is_taken_crash_loops_and_the_parent_exits_1(tmp_path: Path) -> None:
    """The real failure: worker 1 is killed and its private port taken, so every restart fails
    to bind and exits at once. The parent backs off, gives up, drains worker 0, exits 1."""
    parent = start_parent(tmp_path, workers=2)
    children = descendants(parent)
    squatter: socket.socket | None = None
    try:
        w0, w1 = await live_workers(parent, 2)
        assert (worker_label(w0.replica_id), worker_label(w1.replica_id)) == ("0", "1")
        port = int(w1.url.rsplit(":", 1)[1])
        children = descendants(parent)
        started = time.monotonic()
        os.kill(w1.pid, signal.SIGKILL)
        squatter = take_port(port, timeout_s=5.0)
        code = parent.proc.wait(timeout=90)
        elapsed = time.monotonic() - started
        log = parent.log_path.read_text(errors="replace")
        assert code == 1, log[-3000:]
        assert "worker 1 is crash-looping (6 exits in 60 s" in log, log[-3000:]
        assert "Address already in use" in log  # each restart failed on the taken port
        # Five restarts, 0.25 + 0.5 + 1 + 2 + 4 s apart at least: backoff, not a tight loop.
        assert elapsed >= 7.75, elapsed
        assert gone([c.pid for c in children])  # worker 0 drained and exited, redis stopped
        assert "worker 0 (pid" not in log  # worker 0 never died: it was drained, not restarted
    finally:
        if squatter is not None:
            squatter.close()
        stop_everything(parent, children)


def take_port(port: int, timeout_s: float) -> socket.socket:
    """Listen on ``port`` as soon as the killed worker's socket is gone (before its restart,
    which needs a second or so to import the server, binds it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
