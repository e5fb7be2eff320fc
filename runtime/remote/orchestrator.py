"""An orchestrator whose named stages run on stage hosts only (``serve --remote-stage``).

Every edge that touches a remote stage carries ``mooncake`` handles (the other edges keep their
connector); the server's own transfer engine owns what its local stages put on those edges and
pulls what remote stages hand to local ones. Everything else (admission, edges, flow control,
client progress) is the plain :class:`~runtime.orchestrator.Orchestrator`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from runtime.connector_registry import make_connectors
from runtime.connectors import Connector
from runtime.engine import Engine
from runtime.orchestrator import Orchestrator
from runtime.remote.auth import CurveKeys
from runtime.remote.connector import MooncakeConnector
from runtime.remote.stages import Lister, RemoteStage, RemoteStages
from runtime.remote.transfer import TransferEndpoint
from runtime.spec import PipelineSpec, StageSpec
from runtime.stage import Stage

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
        health["remote"] = {"registry_error": self.remote.registry_error, "replicas": self.remote.snapshot()}
        return health
