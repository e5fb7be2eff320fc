"""Where stage hosts register (``omniduplex stage``) and servers find them (``--remote-stage``).

The registry the replicas and gateways share (:mod:`session.affinity`: leases, heartbeats), one
index per pipeline stage, so a gateway never mistakes a stage host for a session replica.
"""

from __future__ import annotations

from redis.asyncio import Redis

from runtime.remote.stages import Lister, Registered
from session.affinity import ReplicaRegistry
from session.store.keys import DEFAULT_PREFIX


def stage_registry(redis: Redis, pipeline: str, stage: str, *, lease_s: float = 5.0) -> ReplicaRegistry:
    """The registry of one pipeline stage's replicas (an index of its own)."""
    return ReplicaRegistry(redis, lease_s=lease_s, prefix=f"{DEFAULT_PREFIX}:stage:{pipeline}:{stage}")


def registry_lister(redis: Redis, pipeline: str) -> Lister:
    """What :class:`~runtime.remote.stages.RemoteStages` polls: a stage's live replicas."""
    registries: dict[str, ReplicaRegistry] = {}

    async def live(stage: str) -> list[Registered]:
        registry = registries.get(stage)
        if registry is None:
            registry = registries[stage] = stage_registry(redis, pipeline, stage)
        replicas = await registry.live_replicas()
        return [Registered(r.replica_id, r.url, r.state, r.load, r.lease_until_ms) for r in replicas]

    return live
