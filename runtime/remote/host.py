"""A stage host: one stage's engine replicas serving work calls from servers on other hosts.

Each replica is an :class:`~runtime.worker.EngineHost` (the same engine, options and budget as
in the server) on threads of its own; the control server's I/O thread only routes messages,
so neither it nor the caller's event loop ever runs model code. Payloads come and go through
the host's :class:`~runtime.remote.connector.MooncakeConnector`: chunks are pulled from
whichever process owns them, outputs (downstream and client) are put into this host's pool and
named by their handles in the reply, which the server forwards. Releases and cleanups of this
host's slices arrive as control messages; abandoned ones are reaped (``reap``).

Registration in Redis and signal handling are the caller's (``web/stage_host.py``): this
module knows nothing of Redis.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.connectors import ConnectorError, Handle
from runtime.engine import Engine
from runtime.kv import SessionKVStore, bind_thread_store
from runtime.registry import engine_class
from runtime.remote.auth import CurveKeys
from runtime.remote.connector import MooncakeConnector
from runtime.remote.control import ControlServer
from runtime.remote.transfer import TransferEndpoint
from runtime.spec import PipelineSpec, StageSpec
from runtime.worker import CallResult, EngineHost, WorkCall

log = logging.getLogger(__name__)

KIND = "mooncake"
KV_PREFIX = "kv:"  # request ids under which exported session KV waits in the pool


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What a host tells a server in its hello (checked against the server's pipeline)."""

    pipeline: str
    stage: str
    engine: str
    replica: int
    replicas: int
    session: str  # the transfer engine's host:port
    pid: int
    hostname: str


class HostReplica:
    def __init__(
        self,
        spec: StageSpec,
        index: int,
        engine_cls: type[Engine],
        connector: MooncakeConnector,
        out_edges: int,
    ) -> None:
        self.index = index
        self.host = EngineHost(
            spec.name,
            engine_cls,
            spec.options,
            resolve=connector.get,
            store=lambda request_id, key, payload, _kind, refs: connector.put(
                request_id, key, payload, refs=refs
            ),
            out_kinds={KIND: out_edges} if out_edges else {},
            client_kind=KIND,
            key_prefix=f"{spec.name}.{connector.session}.{index}",
        )
        self.kv = SessionKVStore(spec.budget.kv_bytes)
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, spec.budget.workers),
            thread_name_prefix=f"stage-{spec.name}.{index}",
            initializer=bind_thread_store,
            initargs=(self.kv,),
        )
        self._lock = threading.Lock()
        self.peers: dict[str, bytes] = {}  # request id -> the control peer that started it
        self.seen: dict[str, float] = {}  # request id -> its last call (time.monotonic)
        self.calls = 0
        self.failures = 0
        self.kv_imported = 0  # session KV entries taken over from a draining replica
        self.exported: dict[str, tuple[Handle, int]] | None = None  # set once it drains

    @property
    def load(self) -> int:
        return len(self.host.states)

    def run(self, peer: bytes, call: WorkCall) -> CallResult:
        now = time.monotonic()
        with self._lock:
            for request in call.starts:
                self.peers[request.request_id] = peer
            for request_id in [*(r.request_id for r in call.starts), *(i.request_id for i in call.items)]:
                self.seen[request_id] = now
        try:
            result = self.host.run(call)
        except Exception:
            self.failures += 1
            raise
        finally:
            self.calls += 1
        with self._lock:
            for request_id in [r for r in self.seen if r not in self.host.states]:
                del self.seen[request_id]
                self.peers.pop(request_id, None)
        return result

    def idle(self, ttl_s: float) -> list[str]:
        """Requests with no call for ``ttl_s``: their server is gone (it never said finish)."""
        cutoff = time.monotonic() - ttl_s
        with self._lock:
            return [r for r, at in self.seen.items() if at < cutoff]

    def reset(self, peer: bytes) -> int:
        """Finish every request ``peer`` started (it lost its connection and failed them)."""
        with self._lock:
            orphans = [r for r, p in self.peers.items() if p == peer]
        if orphans:
            self.run(peer, WorkCall(finishes=[(r, True) for r in orphans]))
        return len(orphans)


class StageHost:
    def __init__(
        self,
        pipeline: PipelineSpec,
        stage: str,
        *,
        listen: str,
        advertise: str,
        keys: CurveKeys | None,
        replicas: int | None = None,
        pool_bytes: int = 256 << 20,
    ) -> None:
        self.pipeline = pipeline
        self.spec = pipeline.stage(stage)  # KeyError: the caller reports it
        self.replica_count = replicas or self.spec.replicas
        self.listen = listen
        self.advertise = advertise
        self.keys = keys
        self.pool_bytes = pool_bytes
        self.connector: MooncakeConnector | None = None
        self.replicas: list[HostReplica] = []
        self.server: ControlServer | None = None
        self.draining = False

    def open(self) -> None:
        """Load the engines and start listening (blocking: run it off any event loop)."""
        engine_cls = engine_class(self.spec.engine)
        self.connector = MooncakeConnector(TransferEndpoint(self.advertise, self.pool_bytes))
        out_edges = len(self.pipeline.outgoing(self.spec.name))
        self.replicas = [
            HostReplica(self.spec, i, engine_cls, self.connector, out_edges)
            for i in range(self.replica_count)
        ]
        for replica in self.replicas:
            replica.executor.submit(replica.host.open).result()
        self.server = ControlServer(f"tcp://{self.listen}", self.keys, self._handle)

    @property
    def endpoint(self) -> str:
        """The control endpoint servers connect to (the advertised address, the bound port)."""
        assert self.server is not None
        port = self.server.endpoint.rpartition(":")[2]
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"tcp://{host}:{port}"

    @property
    def load(self) -> int:
        return sum(r.load for r in self.replicas)

    def info(self, replica: int) -> HostInfo:
        assert self.connector is not None
        return HostInfo(
            self.pipeline.name,
            self.spec.name,
            self.spec.engine,
            replica,
            len(self.replicas),
            self.connector.session,
            os.getpid(),
            socket.gethostname(),
        )

    def reap(self) -> int:
        """Free abandoned slices, and finish requests nobody has called for ``ttl_s`` (their
        server died, or lost this host and failed them); how many slices were freed."""
        if self.connector is None:
            return 0
        for replica in self.replicas:
            orphans = replica.idle(self.connector.ttl_s)
            if orphans:
                log.warning(
                    "stage %s replica %d: finishing %d abandoned request(s)",
                    self.spec.name,
                    replica.index,
                    len(orphans),
                )
                replica.executor.submit(replica.run, b"", WorkCall(finishes=[(r, True) for r in orphans]))
        return self.connector.reap()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for replica in self.replicas:
            replica.executor.submit(replica.host.close).result()
            replica.executor.shutdown(wait=True)
        if self.connector is not None:
            self.connector.close()

    def stats(self) -> dict[str, Any]:
        return {
            "replicas": [{"replica": r.index, "load": r.load, "calls": r.calls} for r in self.replicas],
            "connector": self.connector.health() if self.connector is not None else {},
        }

    # -- on the control server's I/O thread: route, never compute -----------------------------

    def _handle(self, peer: bytes, kind: str, call_id: bytes, body: bytes) -> None:
        server, connector = self.server, self.connector
        assert server is not None and connector is not None
        if kind in ("kv_export", "stats"):
            index = int(pickle.loads(body))
            if not 0 <= index < len(self.replicas):
                server.reply(peer, "error", call_id, f"no replica {index} on this host".encode())
                return
            replica = self.replicas[index]
            task = self._export if kind == "kv_export" else self._stats
            replica.executor.submit(task, replica, peer, call_id)
        elif kind == "call":
            index = int.from_bytes(body[:2], "big")
            if index >= len(self.replicas):
                server.reply(peer, "error", call_id, f"no replica {index} on this host".encode())
                return
            replica = self.replicas[index]
            replica.executor.submit(self._run, replica, peer, call_id, body[2:])
        elif kind == "release":
            for handle in pickle.loads(body):
                connector.release(handle)
        elif kind == "cleanup":
            connector.drop(body.decode())
        elif kind == "hello":
            index, reset = pickle.loads(body)
            if not 0 <= index < len(self.replicas):
                server.reply(peer, "error", call_id, f"no replica {index} on this host".encode())
                return
            replica = self.replicas[index]
            replica.executor.submit(self._hello, replica, peer, call_id, reset)
        else:
            server.reply(peer, "error", call_id, f"unknown message {kind!r}".encode())

    # -- on a replica's threads ---------------------------------------------------------------

    def _run(self, replica: HostReplica, peer: bytes, call_id: bytes, body: bytes) -> None:
        assert self.server is not None
        try:
            call, imports = pickle.loads(body)
            self._import(replica, imports)
            result = replica.run(peer, call)
            reply = pickle.dumps(result, protocol=5)
        except Exception as exc:
            log.exception("stage %s replica %d: work call failed", self.spec.name, replica.index)
            self.server.reply(peer, "error", call_id, f"{type(exc).__name__}: {exc}".encode())
            return
        self.server.reply(peer, "ok", call_id, reply)

    def _import(self, replica: HostReplica, imports: list[tuple[str, Handle, int]]) -> None:
        """Session KV another replica handed on (it drained): pulled into this replica's store
        before the call that starts the session's request here."""
        assert self.connector is not None
        for session_key, handle, nbytes in imports:
            try:
                replica.kv.put(session_key, self.connector.get(handle), nbytes=nbytes)
                replica.kv_imported += 1
            except ConnectorError as exc:  # its host is gone: the engine rebuilds from the history
                log.warning("stage %s: KV of session %s not moved: %s", self.spec.name, session_key, exc)

    def export_kv(self) -> int:
        """Draining: put every replica's session KV in the pool, for the replicas that take the
        sessions over to pull (``kv_export`` hands the handles to the server); how many."""
        assert self.connector is not None
        for replica in self.replicas:
            replica.executor.submit(self._exported, replica).result()
        return sum(len(r.exported or {}) for r in self.replicas)

    def _exported(self, replica: HostReplica) -> dict[str, tuple[Handle, int]]:
        assert self.connector is not None
        if replica.exported is None:
            replica.exported = {}
            for key, value, nbytes in replica.kv.entries():
                try:
                    handle = self.connector.put(f"{KV_PREFIX}{key}", "kv", value)
                except Exception as exc:  # too big for the pool, say: that session rebuilds
                    log.warning("stage %s: KV of session %s not exported: %s", self.spec.name, key, exc)
                    continue
                replica.exported[key] = (handle, nbytes)
        return replica.exported

    def _export(self, replica: HostReplica, peer: bytes, call_id: bytes) -> None:
        """Reply ``{session key: (handle, nbytes)}`` of ``replica``'s exported session KV."""
        assert self.server is not None
        self.server.reply(peer, "ok", call_id, pickle.dumps(self._exported(replica), protocol=5))

    def _stats(self, replica: HostReplica, peer: bytes, call_id: bytes) -> None:
        assert self.server is not None
        engine = replica.host.engine
        stats = {
            "kv": replica.kv.stats(),
            "kv_imported": replica.kv_imported,
            "engine": dict(getattr(engine, "stats", {}) or {}),
        }
        self.server.reply(peer, "ok", call_id, pickle.dumps(stats))

    def exports_pending(self) -> int:
        """Exported session KV not yet released by the replica that took it over."""
        return self.connector.holding(KV_PREFIX) if self.connector is not None else 0

    def _hello(self, replica: HostReplica, peer: bytes, call_id: bytes, reset: bool) -> None:
        assert self.server is not None
        if reset:
            dropped = replica.reset(peer)
            if dropped:
                log.info(
                    "stage %s replica %d: finished %d request(s) of a reconnected server",
                    self.spec.name,
                    replica.index,
                    dropped,
                )
        self.server.reply(peer, "ok", call_id, pickle.dumps(self.info(replica.index)))


def encode_call(index: int, call: WorkCall, imports: list[tuple[str, Handle, int]] | None = None) -> bytes:
    """A work call for replica ``index``, with the session KV it should take in first."""
    return index.to_bytes(2, "big") + pickle.dumps((call, imports or []), protocol=5)
