"""A replica whose engine runs in a child process (spawn), fed over shared memory.

Control messages (work calls with handles, results with handles) go over a pipe; payload
arrays go through the orchestrator's :class:`~runtime.shm.SharedMemoryConnector`: the child
reads chunk segments the parent created and writes its outputs into segments under its own
name prefix, which the parent adopts. When the child dies, the in-flight call and the
sentinel both report it, the replica fails its requests with ``stage X worker process died
(exit code N)``, and :meth:`ProcessWorker.restart` sweeps the dead child's segments and spawns
a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from runtime.engine import Engine
from runtime.kv import SessionKVStore, bind_process_store
from runtime.registry import engine_path, load_engine_path
from runtime.shm import SharedMemoryConnector, sweep_segments
from runtime.worker import CallResult, Done, EngineHost, WorkCall, Worker, WorkerDied, submit_on

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ChildConfig:
    stage: str
    engine_path: str  # module:QualName, imported in the child
    options: Mapping[str, Any]
    prefix: str  # shared-memory name prefix of this child
    out_kinds: Mapping[str, int]
    kv_bytes: int


def child_main(conn: Connection, config: ChildConfig) -> None:
    """Entry point of the worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        producer = SharedMemoryConnector.producer(config.prefix)
        bind_process_store(SessionKVStore(config.kv_bytes))
        host = EngineHost(
            config.stage,
            load_engine_path(config.engine_path),
            config.options,
            resolve=producer.get,
            store=lambda request_id, key, payload, _kind, _refs: producer.put(request_id, key, payload),
            out_kinds=config.out_kinds,
            client_kind="shm",
            key_prefix=f"{config.stage}.{config.prefix}",
        )
        host.open()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone
                return
            if message[0] == "close":
                return
            try:
                conn.send(("ok", host.run(message[1])))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        host.close()


class ProcessWorker(Worker):
    def __init__(
        self,
        stage: str,
        engine_cls: type[Engine],
        options: Mapping[str, Any],
        shm: SharedMemoryConnector,
        out_kinds: Mapping[str, int],
        *,
        index: int = 0,
        kv_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        bad = sorted(set(out_kinds) - {"shm"})
        if bad:
            raise ValueError(f"stage {stage}: a worker process can only feed shm edges, not {bad}")
        self.stage = stage
        self._engine_path = engine_path(engine_cls)
        self._options = dict(options)
        self._shm = shm
        self._out_kinds = dict(out_kinds)
        self._kv_bytes = kv_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"proc-{stage}-{index}")
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._prefix = ""
        self._on_death: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def prefix(self) -> str:
        """Shared-memory name prefix of the current child."""
        return self._prefix

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(self._executor, self._spawn)
        self._watch_sentinel()

    def watch(self, on_death: Callable[[str], None]) -> None:
        self._on_death = on_death

    async def restart(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._reap)
        await loop.run_in_executor(self._executor, self._spawn)
        self._watch_sentinel()

    async def close(self) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and self._loop is not None:
            self._loop.remove_reader(proc.sentinel)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._stop)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, call: WorkCall, done: Done) -> None:
        submit_on(self._executor, self._run_sync, call, done)

    # -- on the worker's thread ---------------------------------------------------------------

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        prefix = self._shm.child_prefix()
        config = ChildConfig(
            self.stage, self._engine_path, self._options, prefix, self._out_kinds, self._kv_bytes
        )
        proc = ctx.Process(
            target=child_main, args=(child, config), name=f"omniduplex-{self.stage}", daemon=True
        )
        proc.start()
        child.close()
        try:
            kind, detail = parent.recv()
        except (EOFError, OSError):
            proc.join(JOIN_TIMEOUT_S)
            parent.close()
            sweep_segments(prefix)
            raise WorkerDied(self._died(proc)) from None
        if kind != "ready":
            proc.join(JOIN_TIMEOUT_S)
            parent.close()
            sweep_segments(prefix)
            raise RuntimeError(f"stage {self.stage}: worker process could not load its engine:\n{detail}")
        self._proc, self._conn, self._prefix = proc, parent, prefix

    def _run_sync(self, call: WorkCall) -> CallResult:
        conn, proc = self._conn, self._proc
        if conn is None or proc is None:
            raise WorkerDied(f"stage {self.stage} worker process is not running")
        try:
            conn.send(("run", call))
            kind, payload = conn.recv()
        except (EOFError, OSError):
            proc.join(JOIN_TIMEOUT_S)
            raise WorkerDied(self._died(proc)) from None
        finally:
            for handle in call.releases():
                self._shm.release(handle)
        if kind != "ok":
            raise RuntimeError(f"stage {self.stage}: worker process error:\n{payload}")
        result: CallResult = payload
        for item in result.items:
            for connector_kind, handles in item.downstream.items():
                for handle in handles:
                    self._shm.adopt(handle, refs=self._out_kinds[connector_kind])
            if item.client:
                client = []
                for handle in item.client:
                    self._shm.adopt(handle)
                    client.append(self._shm.get(handle))
                    self._shm.release(handle)
                item.client = client
        return result

    def _reap(self) -> None:
        """Make sure the old child is gone and its leftover segments too."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        if self._prefix:
            sweep_segments(self._prefix)

    def _stop(self) -> None:
        conn, proc = self._conn, self._proc
        if conn is not None and proc is not None and proc.is_alive():
            with contextlib.suppress(OSError):
                conn.send(("close",))
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
        self._reap()

    def _died(self, proc: BaseProcess) -> str:
        # The loop's sentinel reader and the step thread may both join the dead process: the
        # one whose waitpid loses the race sees no exit code until the winner has stored it,
        # microseconds later. Wait that out (bounded; only ever after a death).
        deadline = time.monotonic() + 0.1
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return f"stage {self.stage} worker process died (exit code {proc.exitcode})"

    # -- on the loop --------------------------------------------------------------------------

    def _watch_sentinel(self) -> None:
        proc, loop = self._proc, self._loop
        if proc is not None and loop is not None:
            loop.add_reader(proc.sentinel, self._sentinel_ready, proc)

    def _sentinel_ready(self, proc: BaseProcess) -> None:
        if self._loop is not None:
            self._loop.remove_reader(proc.sentinel)
        if self._closing or proc is not self._proc:
            return
        proc.join(JOIN_TIMEOUT_S)  # it has exited: this returns at once and sets exitcode
        if self._on_death is not None:
            self._on_death(self._died(proc))
