"""`omniduplex serve --workers N`: N server processes behind one port, one Redis between them.

Why: one Python event loop saturates at ~100-150 full-duplex sessions on a small host
(docs/loadtest.md); more sessions need more loops, i.e. more processes.

Design (opt-in; ``--workers 1`` is the plain single process):

* **The parent** serves nothing. It starts the embedded ``redis-server`` once (or uses
  ``--redis-url``), then N workers: ``omniduplex serve`` with the same arguments plus
  ``--redis-url``, a fresh ``--replica-id`` and ``--advertise-url http://127.0.0.1:<private
  port>``, and the hidden ``--worker``. Each worker is a replica of the scale-out design
  (web/deploy/replica.py): registry lease, session binding with epochs, drain on SIGTERM.
* **One public port.** Each worker binds its own ``SO_REUSEPORT`` socket on ``host:port``;
  the kernel spreads new connections over them. Each also listens on its private loopback
  port, where its siblings forward requests for the sessions it owns (web/deploy/worker_forward.py).
* **Signals.** SIGTERM to the parent is forwarded: every worker drains (its sessions finish,
  new ones go to... nobody: the port closes with the last worker), then redis stops. SIGINT is
  forwarded too (immediate shutdown). A second signal is forwarded again.
* **A worker that dies is restarted** (fresh replica id, same private port); its sessions are
  taken over by whichever worker the client's resume reaches once the dead one's lease lapses.
  The restart waits ``BACKOFF_S``, doubled for each earlier exit of that worker within
  ``RESTART_WINDOW_S`` (at most ``BACKOFF_MAX_S``), so a worker that dies at start is not
  respawned in a tight loop. A worker that exits more than ``MAX_RESTARTS`` times within the
  window is crash-looping: the parent gives up, logs it, drains the other workers (SIGTERM:
  their sessions finish) and exits 1. (:class:`RestartPolicy` decides, on times it is given.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from web.settings import ServerSettings

log = logging.getLogger("omniduplex.workers")

MAX_RESTARTS = 5  # per worker, within RESTART_WINDOW_S
RESTART_WINDOW_S = 60.0
BACKOFF_S = 0.25  # before the first restart; doubled per earlier exit in the window
BACKOFF_MAX_S = 8.0
POLL_S = 0.2
_WORKER_REPLICA = re.compile(r"rep_w(\d+)_[0-9a-f]+")
# Flags the parent sets per worker (the user's values are dropped); True: takes a value.
_PARENT_FLAGS = {"--workers": True, "--redis-url": True, "--replica-id": True, "--advertise-url": True}


def strip_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without the flags the parent sets itself (both ``--f v`` and ``--f=v`` forms)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _PARENT_FLAGS:
            skip = "=" not in arg and _PARENT_FLAGS[name]
            continue
        out.append(arg)
    return out


def launcher(argv: Sequence[str]) -> list[str]:
    """The command that started this process, minus ``argv`` (e.g. ``python -m web.cli``), so a
    worker runs the same entry point (tests start servers with their own engine modules)."""
    orig = list(sys.orig_argv)
    n = len(argv)
    if n and orig[-n:] == list(argv) and len(orig) > n:
        return orig[:-n]
    return [sys.executable, "-m", "web.cli"]


def replica_id_for(index: int) -> str:
    """A fresh replica id for worker ``index`` (a new one at each restart)."""
    return f"rep_w{index}_{secrets.token_hex(4)}"


def worker_label(replica_id: str) -> str:
    """The ``worker`` label of a replica's per-process metrics: the worker's index, which
    stays the same across its restarts (the replica id itself for a replica that is no worker)."""
    m = _WORKER_REPLICA.fullmatch(replica_id)
    return m.group(1) if m is not None else replica_id


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to restart a worker that exited, and when to give up. Pure: it is given the times."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    backoff_s: float = BACKOFF_S
    backoff_max_s: float = BACKOFF_MAX_S

    def recent(self, exits: Sequence[float], now: float) -> list[float]:
        """The exit times that still count at ``now``."""
        return [t for t in exits if now - t < self.window_s]

    def delay(self, exits: Sequence[float], now: float) -> float | None:
        """Seconds to wait before restarting a worker whose exit times within the window are
        ``exits`` (the latest one included), or None: it is crash-looping, give up."""
        n = len(self.recent(exits, now))
        if n > self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, n - 1))


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reuseport_socket(host: str, port: int) -> socket.socket:
    """The public listening socket of one worker: ``SO_REUSEPORT``, so N workers share the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def private_socket(advertise_url: str) -> socket.socket:
    """The worker's own loopback listener at its ``--advertise-url`` port."""
    port = int(advertise_url.rstrip("/").rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@dataclass(slots=True)
class Worker:
    index: int
    port: int  # private (advertise) port
    proc: subprocess.Popen[bytes] | None = None
    replica_id: str = ""
    exits: list[float] = field(default_factory=list)  # recent exit times (RestartPolicy's window)
    restart_at: float | None = None  # exited, restart due then

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(slots=True)
class Supervisor:
    """Starts, watches, restarts and stops the workers (synchronous: the parent has no loop)."""

    command: list[str]  # launcher + serve arguments, without the per-worker flags
    redis_url: str
    count: int
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    poll_s: float = POLL_S
    clock: Callable[[], float] = time.monotonic
    workers: list[Worker] = field(default_factory=list)
    stopping: bool = False

    def start(self) -> None:
        self.workers = [Worker(i, free_loopback_port()) for i in range(self.count)]
        for w in self.workers:
            self._spawn(w)

    def _spawn(self, w: Worker) -> None:
        w.replica_id = replica_id_for(w.index)
        w.restart_at = None
        args = [
            *self.command,
            "--worker",
            "--redis-url",
            self.redis_url,
            "--replica-id",
            w.replica_id,
            "--advertise-url",
            w.url,
        ]
        w.proc = subprocess.Popen(args)
        log.info("worker %d: pid %d, replica %s at %s", w.index, w.proc.pid, w.replica_id, w.url)

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    def check(self) -> bool:
        """Schedule the restart of workers that exited and start those that are due; False
        when one is crash-looping (more exits in the window than the policy allows)."""
        if self.stopping:
            return True
        now = self.clock()
        for w in self.workers:
            if w.proc is None or w.proc.poll() is None:
                continue
            if w.restart_at is None:  # a new exit
                w.exits = [*self.policy.recent(w.exits, now), now]
                delay = self.policy.delay(w.exits, now)
                if delay is None:
                    log.error(
                        "worker %d is crash-looping (%d exits in %.0f s, the last with code %s): "
                        "giving up; draining the other workers, then exiting 1",
                        w.index,
                        len(w.exits),
                        self.policy.window_s,
                        w.proc.returncode,
                    )
                    return False
                w.restart_at = now + delay
                log.warning(
                    "worker %d (pid %d) exited with %s; restarting it in %.2f s",
                    w.index,
                    w.proc.pid,
                    w.proc.returncode,
                    delay,
                )
            if now >= w.restart_at:
                self._spawn(w)
        return True

    def alive(self) -> bool:
        return any(w.proc is not None and w.proc.poll() is None for w in self.workers)

    def supervise(self, signals: list[int]) -> int:
        """Watch the started workers until every one has stopped: 0, or 1 after a crash loop.

        ``signals`` (appended to by the parent's handlers) are forwarded to every worker:
        SIGTERM drains, SIGINT stops at once. A crash loop drains the others, as SIGTERM would."""
        code = 0
        while self.alive() or not self.stopping:
            while signals:
                sig = signals.pop(0)
                self.stopping = True
                self.signal_all(sig)
            if not self.check():
                code = 1
                self.stopping = True
                self.signal_all(signal.SIGTERM)
            time.sleep(self.poll_s)
        return code

    def wait_all(self, timeout_s: float) -> None:
        """Wait for every worker to exit; SIGKILL what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        self.signal_all(signal.SIGKILL)
        for w in self.workers:
            if w.proc is not None:
                w.proc.wait()


def run_workers(args: argparse.Namespace, settings: ServerSettings) -> int:
    """The parent of ``serve --workers N``: returns when every worker stopped (0), 1 on a crash loop."""
    from session.store.embedded import EmbeddedRedis

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    embedded: EmbeddedRedis | None = None
    redis_url = settings.redis_url
    if redis_url is None:
        embedded = EmbeddedRedis(settings.data_dir)
        redis_url = asyncio.run(embedded.start())
    sup = Supervisor([*launcher(argv), *strip_flags(argv)], redis_url, int(args.workers))
    signals: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        signals.append(sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sup.start()
        log.info("%d workers on %s:%d (redis %s)", sup.count, settings.host, settings.port, redis_url)
        return sup.supervise(signals)
    finally:
        sup.stopping = True
        sup.signal_all(signal.SIGINT)
        sup.wait_all(timeout_s=15.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if embedded is not None:
            asyncio.run(embedded.stop())


def worker_sockets(settings: ServerSettings) -> list[socket.socket]:
    """A worker's listeners: the shared public port and its private advertise port."""
    if not settings.advertise_url:
        raise ValueError("--worker needs --advertise-url (set by `serve --workers N`)")
    return [reuseport_socket(settings.host, settings.port), private_socket(settings.advertise_url)]
