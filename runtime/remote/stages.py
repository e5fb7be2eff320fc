"""The server's remote stages: replica pools that fill from the registry as hosts come and go.

:class:`RemoteStage` is a :class:`~runtime.stage.Stage` whose replicas are
:class:`~runtime.remote.worker.RemoteWorker` s on stage hosts. :class:`RemoteStages` polls the
registry (a callable the caller provides: Redis in the server, see ``web/deploy/stages.py``) once a
``poll_s``, says hello to every new replica (a host with another stage key fails the handshake
and is kept out, retried later), and removes replicas whose lease lapsed. A replica that
vanishes from the registry but still answers keeps serving for ``missing_grace_s`` (Redis
restarted: hosts register again on their next heartbeat); one whose host is gone is dropped as
soon as the registry drops it, and its requests failed the moment the connection closed.
A replica that left is closed on a task of its own (within ``CLOSE_WITHIN_S``), so a host that
does not answer its close holds up no adoption of new members on any stage.
It is also the connector's :class:`~runtime.remote.connector.RemoteOwners`: releases and
cleanups of slices a host owns go to that host over the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from runtime.connectors import Handle
from runtime.metrics import RuntimeMetrics
from runtime.progress import AdmissionError
from runtime.remote.auth import CurveKeys
from runtime.remote.connector import MooncakeConnector
from runtime.remote.worker import RemoteWorker
from runtime.spec import StageSpec
from runtime.stage import STICKY_KEYS, Replica, Stage, StageSink

log = logging.getLogger(__name__)

REFUSED_RETRY_S = 10.0
CLOSE_WITHIN_S = 10.0  # a removed replica's close (its control thread joins within 5 s)


@dataclass(frozen=True, slots=True)
class Registered:
    """One replica as the registry lists it (``url``: ``tcp://host:port/index``)."""

    replica_id: str
    url: str
    state: str = "SERVING"
    load: int = 0
    lease_until_ms: int = 0

    def endpoint(self) -> tuple[str, int]:
        base, _, index = self.url.rpartition("/")
        if not base.startswith("tcp://") or not index.isdigit():
            raise ValueError(f"stage replica url {self.url!r} is not tcp://host:port/index")
        return base, int(index)


Lister = Callable[[str], Awaitable[list[Registered]]]  # stage name -> its registered replicas


@dataclass(eq=False, slots=True)
class Member:
    replica: Replica
    worker: RemoteWorker
    entry: Registered
    missing_since: float | None = None


class RemoteStage(Stage):
    def __init__(self, spec: StageSpec, metrics: RuntimeMetrics) -> None:
        super().__init__(spec, [])
        metrics.add_stage(spec.name, 0)
        self.metrics = metrics
        self.members: dict[str, Member] = {}
        self._sticky_ids: OrderedDict[str, str] = OrderedDict()
        # session KV handed on by draining replicas, taken by the next call that starts the
        # session elsewhere (bounded: the oldest dropped; its slice is reaped by its owner)
        self.kv_moves: OrderedDict[str, tuple[Handle, int]] = OrderedDict()

    async def start(self) -> None:
        """Replicas arrive from the registry (:class:`RemoteStages`)."""

    def add(self, member: Member) -> None:
        self.members[member.entry.replica_id] = member
        self.replicas.append(member.replica)

    def detach(self, replica_id: str, reason: str | None) -> Member | None:
        """Take a replica out of assignment; with a ``reason``, fail what it still holds (at
        once) with it. The caller closes it (:meth:`close_member`)."""
        member = self.members.pop(replica_id, None)
        if member is None:
            return None
        self.replicas.remove(member.replica)
        if reason is not None:
            member.worker.report_lost(reason)
        return member

    async def close_member(self, member: Member) -> None:
        await member.replica.close()
        self.metrics.queue(self.name, member.replica.index, 0, 0)

    async def remove(self, replica_id: str, reason: str | None) -> None:
        """Drop a replica and close it."""
        member = self.detach(replica_id, reason)
        if member is not None:
            await self.close_member(member)

    async def close(self) -> None:
        for replica_id in list(self.members):
            await self.remove(replica_id, None)  # the orchestrator has ended its requests

    def assign(self, session_key: str | None) -> Replica:
        cap = self.spec.budget.max_concurrency
        usable = {
            rid: m
            for rid, m in self.members.items()
            if m.replica.ready and m.entry.state == "SERVING" and m.replica.load < cap
        }
        if session_key is not None:
            rid = self._sticky_ids.get(session_key)
            if rid in usable:
                self._sticky_ids.move_to_end(session_key)
                return usable[rid].replica
        if not usable:
            raise AdmissionError(f"stage_unavailable: stage {self.name} has no live replica on a stage host")
        rid, member = min(usable.items(), key=lambda kv: (kv[1].replica.load, kv[1].replica.index))
        if session_key is not None:
            self._sticky_ids[session_key] = rid
            self._sticky_ids.move_to_end(session_key)
            while len(self._sticky_ids) > STICKY_KEYS:
                self._sticky_ids.popitem(last=False)
        return member.replica

    def serves_elsewhere(self, replica: Replica | None) -> bool:
        """Another replica than ``replica`` is ready and serving (a re-run could go there)."""
        return any(
            m.replica is not replica and m.replica.ready and m.entry.state == "SERVING"
            for m in self.members.values()
        )

    def replica_id_for(self, session_key: str) -> str | None:
        return self._sticky_ids.get(session_key)


@dataclass(slots=True)
class RemoteStages:
    """Every remote stage of one orchestrator, their registry watcher, and the owners' router."""

    pipeline: str
    lister: Lister
    keys: CurveKeys | None
    poll_s: float = 1.0
    missing_grace_s: float = 6.0
    stages: dict[str, RemoteStage] = field(default_factory=dict)
    connector: MooncakeConnector | None = None
    sink: StageSink | None = None
    clock: Callable[[], float] = time.monotonic
    registry_error: str | None = None
    refused: dict[str, tuple[float, str]] = field(default_factory=dict)  # replica id -> (until, why)
    _owners: dict[str, RemoteWorker] = field(default_factory=dict)  # host session -> a worker
    _adding: set[str] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)  # adds and KV exports: cancelled on close
    _closing: set[asyncio.Task[None]] = field(default_factory=set)  # removed replicas: awaited on close
    _task: asyncio.Task[None] | None = None

    # -- RemoteOwners (any thread) ------------------------------------------------------------

    def release(self, owner: str, handles: list[Handle]) -> None:
        worker = self._owners.get(owner)
        if worker is not None:
            worker.client.post("release", pickle.dumps(handles, protocol=5))

    def cleanup(self, request_id: str) -> None:
        for worker in list(self._owners.values()):
            worker.client.post("cleanup", request_id.encode())

    # -- lifecycle (on the loop) --------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._watch(), name="remote-stages")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)
        for stage in self.stages.values():
            await stage.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # never let the watcher die
                log.exception("remote stages: refresh failed")

    async def refresh(self) -> None:
        for stage in self.stages.values():
            try:
                entries = await self.lister(stage.name)
            except Exception as exc:  # Redis down: keep what answers, say so, try again
                self.registry_error = f"{type(exc).__name__}: {exc}"
                return
            self.registry_error = None
            await self._reconcile(stage, {e.replica_id: e for e in entries})

    async def _reconcile(self, stage: RemoteStage, seen: dict[str, Registered]) -> None:
        now = self.clock()
        for rid, entry in seen.items():
            member = stage.members.get(rid)
            if member is not None:
                if member.entry.state == "SERVING" and entry.state == "DRAINING":
                    self._spawn(self._export(stage, member), f"remote-kv-{rid}", self._tasks)
                member.entry, member.missing_since = entry, None
                continue
            until = self.refused.get(rid, (0.0, ""))[0]
            if rid not in self._adding and now >= until:
                self._adding.add(rid)
                self._spawn(self._add(stage, entry), f"remote-add-{rid}", self._tasks)
        for rid, member in list(stage.members.items()):
            if rid in seen:
                continue
            if member.missing_since is None:
                member.missing_since = now
            if not member.replica.ready or now - member.missing_since >= self.missing_grace_s:
                log.warning("stage %s: replica %s left the registry", stage.name, rid)
                stage.detach(rid, f"host {member.worker.endpoint} left the registry (lease lapsed)")
                self._forget(member.worker)
                self._spawn(self._close_removed(stage, member), f"remote-remove-{rid}", self._closing)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str, tasks: set[asyncio.Task[None]]) -> None:
        task = asyncio.create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _close_removed(self, stage: RemoteStage, member: Member) -> None:
        """Close a replica that left the registry, off the watcher (which adopts new members)."""
        rid = member.entry.replica_id
        try:
            async with asyncio.timeout(CLOSE_WITHIN_S):
                await stage.close_member(member)
        except TimeoutError:
            log.warning("stage %s: replica %s did not close within %.0f s", stage.name, rid, CLOSE_WITHIN_S)
        except Exception:
            log.exception("stage %s: closing replica %s failed", stage.name, rid)

    async def _export(self, stage: RemoteStage, member: Member) -> None:
        """A replica turned DRAINING: have it hand its sessions' KV on (runtime/kv.py), so the
        replica that takes each session over prefills only the new tokens of its next turn."""
        try:
            moved: dict[str, tuple[Handle, int]] = await member.worker.ask("kv_export")
        except Exception as exc:
            log.warning(
                "stage %s: KV of draining %s not handed on: %s", stage.name, member.entry.replica_id, exc
            )
            return
        for key, value in moved.items():
            stage.kv_moves[key] = value
            stage.kv_moves.move_to_end(key)
        while len(stage.kv_moves) > STICKY_KEYS:
            stage.kv_moves.popitem(last=False)
        log.info(
            "stage %s: %d session KV entries of %s to move", stage.name, len(moved), member.entry.replica_id
        )

    async def _add(self, stage: RemoteStage, entry: Registered) -> None:
        try:
            if self.connector is None or self.sink is None:
                raise RuntimeError("remote stages are not bound to an orchestrator")
            endpoint, index = entry.endpoint()
            worker = RemoteWorker(self.pipeline, stage.name, endpoint, index, self.keys, self.connector)
            worker.kv_moves = stage.kv_moves
            replica = Replica(
                stage.spec,
                stage.metrics.add_replica(stage.name),
                worker,
                sink=self.sink,
                metrics=stage.metrics,
                connectors={self.connector.kind: self.connector},
                clock=self.clock,
            )
            try:
                await replica.start()
            except BaseException:
                await worker.close()
                raise
            assert worker.info is not None
            stage.add(Member(replica, worker, entry))
            self._owners = {**self._owners, worker.info.session: worker}
            self.refused.pop(entry.replica_id, None)
            log.info("stage %s: replica %s at %s joined", stage.name, entry.replica_id, entry.url)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.refused[entry.replica_id] = (self.clock() + REFUSED_RETRY_S, reason)
            log.warning(
                "stage %s: replica %s at %s not used: %s", stage.name, entry.replica_id, entry.url, reason
            )
        finally:
            self._adding.discard(entry.replica_id)

    def _forget(self, worker: RemoteWorker) -> None:
        if worker.info is not None and self._owners.get(worker.info.session) is worker:
            others = {s: w for s, w in self._owners.items() if w is not worker}
            for stage in self.stages.values():  # another replica on the same host can route
                for member in stage.members.values():
                    if member.worker.info is not None and member.worker.info.session == worker.info.session:
                        others[worker.info.session] = member.worker
            self._owners = others

    def snapshot(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """Rows for ``GET /v1/stages``."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        rows = []
        for stage in self.stages.values():
            for rid, m in stage.members.items():
                rows.append(
                    {
                        "stage": stage.name,
                        "replica_id": rid,
                        "address": m.entry.url,
                        "state": m.entry.state if m.replica.ready else "UNREACHABLE",
                        "in_flight": m.replica.load,
                        "calls": m.worker.calls,
                        "failures": m.worker.failures,
                        "lease_expires_in_s": round(max(0, m.entry.lease_until_ms - now_ms) / 1000, 3),
                        "transfer_session": m.worker.info.session if m.worker.info else None,
                    }
                )
        return rows
