"""An orchestrator whose named stages run on stage hosts only (``serve --remote-stage``).

Every edge that touches a remote stage carries ``mooncake`` handles (the other edges keep their
connector); the server's own transfer engine owns what its local stages put on those edges and
pulls what remote stages hand to local ones. Everything else (admission, edges, flow control,
client progress) is the plain :class:`~runtime.orchestrator.Orchestrator`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from runtime.connector_registry import make_connectors
from runtime.connectors import Connector
from runtime.engine import Engine
from runtime.orchestrator import Orchestrator, RequestRun
from runtime.payloads import Conditioning, Payload
from runtime.progress import AdmissionError, FinalStatus, RequestHandle, RequestStatus
from runtime.remote.auth import CurveKeys
from runtime.remote.connector import MooncakeConnector
from runtime.remote.rerun import RERUN_SUFFIX, Reruns
from runtime.remote.stages import Lister, RemoteStage, RemoteStages
from runtime.remote.transfer import TransferEndpoint
from runtime.spec import PipelineSpec, StageSpec
from runtime.stage import Stage

log = logging.getLogger(__name__)

KIND = MooncakeConnector.kind


def with_remote_stages(spec: PipelineSpec, remote: Iterable[str]) -> PipelineSpec:
    """``spec`` with every edge touching a ``remote`` stage on the mooncake connector.

    ``mooncake`` is not a kind a YAML may name (it needs this server's transfer engine and the
    registry, which only ``serve --remote-stage`` sets up), so the edges are copied without
    validation."""
    names = set(remote)
    unknown = sorted(names - {s.name for s in spec.stages})
    if unknown:
        raise ValueError(f"pipeline {spec.name!r} has no stage {', '.join(map(repr, unknown))}")
    for stage in spec.stages:
        if stage.name in names and stage.budget.worker == "process":
            raise ValueError(f"stage {stage.name!r} is remote: its budget.worker must be thread")
    edges = tuple(
        e.model_copy(update={"connector": KIND}) if {e.source, e.target} & names else e for e in spec.edges
    )
    return spec.model_copy(update={"edges": edges})


class RemoteOrchestrator(Orchestrator):
    def __init__(
        self,
        spec: PipelineSpec,
        *,
        remote: Iterable[str],
        lister: Lister,
        keys: CurveKeys | None,
        transfer_host: str = "127.0.0.1",
        pool_bytes: int = 256 << 20,
        **kwargs: Any,
    ) -> None:
        self.remote_names = frozenset(remote)
        super().__init__(with_remote_stages(spec, self.remote_names), **kwargs)
        self.remote = RemoteStages(self.spec.name, lister, keys)
        self._transfer_host = transfer_host
        self._pool_bytes = pool_bytes
        self.reruns = Reruns()

    def _make_connectors(self, kinds: Collection[str]) -> dict[str, Connector]:
        connectors = make_connectors(set(kinds) - {KIND})
        connector = MooncakeConnector(
            TransferEndpoint(self._transfer_host, self._pool_bytes), owners=self.remote
        )
        connectors[KIND] = connector
        self.remote.connector = connector
        self.remote.sink = self
        return connectors

    def _build_stage(self, stage: StageSpec, engine_cls: type[Engine]) -> Stage:
        if stage.name not in self.remote_names:
            return super()._build_stage(stage, engine_cls)
        remote = RemoteStage(stage, self.metrics)
        self.remote.stages[stage.name] = remote
        return remote

    async def start(self) -> None:
        await super().start()
        await self.remote.start()

    async def close(self) -> None:
        await self.remote.close()
        await super().close()

    def health(self) -> dict[str, Any]:
        health = super().health()
        health["remote"] = {
            "registry_error": self.remote.registry_error,
            "replicas": self.remote.snapshot(),
            "reruns": dict(self.reruns.counts),
        }
        return health

    # -- re-running a request whose remote stage lost its host (runtime/remote/rerun.py) -------

    async def submit(self, params: Mapping[str, Any], **kwargs: Any) -> RequestHandle:
        handle = await super().submit(params, **kwargs)
        self.reruns.submitted(handle.request_id, params, kwargs.get("session_key"))
        return handle

    async def append_input(self, request_id: str, payload: Payload) -> bool:
        request_id = self.reruns.current(request_id)
        self.reruns.streamed(request_id)
        return await super().append_input(request_id, payload)

    async def update(self, request_id: str, update: Conditioning) -> bool:
        request_id = self.reruns.current(request_id)
        self.reruns.streamed(request_id)
        return await super().update(request_id, update)

    def open_edge(self, request_id: str, source: str, target: str, open_: bool = True) -> bool:
        request_id = self.reruns.current(request_id)
        self.reruns.streamed(request_id)  # a gate's state is not replayed by a re-run
        return super().open_edge(request_id, source, target, open_)

    async def cancel(self, request_id: str) -> bool:
        return await super().cancel(self.reruns.current(request_id))

    def _wake(self, request_id: str) -> None:
        super()._wake(self.reruns.current(request_id))

    def on_failed(self, stage: str, request_id: str, error: str) -> None:
        run = self._runs.get(request_id)
        if run is None or not self._rerun(run, stage, error):
            super().on_failed(stage, request_id, error)

    def _finalize(self, run: RequestRun, status: FinalStatus, error: str | None) -> None:
        self.reruns.ended(run.handle.request_id, run.request_id)
        super()._finalize(run, status, error)

    def _rerun(self, run: RequestRun, stage: str, error: str) -> bool:
        origin = self.reruns.candidate(run.request_id, stage, error, run.first_client_at is not None)
        remote = self.remote.stages.get(stage)
        if origin is None or remote is None or not remote.serves_elsewhere(run.replicas.get(stage)):
            return False
        self._detach(run, "failed")
        new_id = run.handle.request_id + RERUN_SUFFIX
        try:
            self._open_run(run.spec, new_id, origin.params, origin.session_key, run.entry, run.handle)
        except AdmissionError as exc:  # no room on the other replicas after all: fail as before
            log.warning("request %s: not re-run (%s); failing it", run.handle.request_id, exc)
            self.reruns.ended(run.handle.request_id, run.request_id)
            run.handle._close(RequestStatus("failed", error, run.timings, run.request_id))
            return True
        self.reruns.moved(run.handle.request_id, run.request_id, new_id, stage)
        log.warning(
            "request %s: stage %s lost its host before anything reached the client; running it again "
            "on another replica (%s)",
            run.handle.request_id,
            stage,
            error,
        )
        return True
