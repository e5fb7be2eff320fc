"""Where the gateway sends a request: a replica for a new session, the owner for a resume.

Every decision reads the registry and the binding from Redis (the gateway keeps nothing of its
own, so any number of gateways agree). ``StoreUnavailable`` propagates: Redis unreachable is a
503 at the edge, never a guess.

* New session: power of two choices over the live ``SERVING`` replicas with room
  (:func:`session.affinity.pick_replica`); the replica binds the session to itself when it
  creates it (first writer wins, epoch 1).
* Resume (``?session_id=``): the bound owner while its lease is live, even if it drains (its
  sessions finish there). If the owner's lease lapsed: a live replica picked as for a new
  session; that replica's ``claim`` takes the binding over (epoch + 1) and rebuilds the
  session from Redis. An owner whose lease is still live but that cannot be reached (killed a
  moment ago) is waited for: :meth:`Router.wait_lapse` polls its lease until it lapses.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from session.affinity import ReplicaInfo, ReplicaRegistry, SessionBinding, pick_replica

RouteKind = Literal["new", "owner", "failover", "unbound"]


class NoReplicaAvailable(Exception):
    """No live replica can take the request (HTTP 503 + Retry-After; WebSocket close 1013)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Route:
    replica: ReplicaInfo
    kind: RouteKind
    owner: str | None = None  # the bound owner (for "failover": the replica whose lease lapsed)
    epoch: int | None = None  # the binding epoch read when routing


class Router:
    def __init__(
        self,
        registry: ReplicaRegistry,
        binding: SessionBinding,
        *,
        rng: random.Random | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.registry = registry
        self.binding = binding
        self.rng = rng or random.Random()
        self.poll_s = poll_s

    async def new_session(self, exclude: Collection[str] = ()) -> ReplicaInfo:
        live = await self.registry.live_replicas()
        choice = pick_replica([r for r in live if r.replica_id not in exclude], self.rng)
        if choice is None:
            raise NoReplicaAvailable(_why_none(live, exclude))
        return choice

    async def any_replica(self, exclude: Collection[str] = ()) -> ReplicaInfo:
        """For requests any replica can answer (REST): an accepting one, else any live one."""
        live = [r for r in await self.registry.live_replicas() if r.replica_id not in exclude]
        choice = pick_replica(live, self.rng) or (self.rng.choice(live) if live else None)
        if choice is None:
            raise NoReplicaAvailable("no live replica")
        return choice

    async def session(self, session_id: str, exclude: Collection[str] = ()) -> Route:
        """The replica for a request about an existing session (resume, REST)."""
        bound = await self.binding.get(session_id)
        live = await self.registry.live_replicas()
        if bound is None:
            # Unknown here (never bound, expired, or a standalone replica's): any replica
            # answers it, and answers session_not_found when it does not exist.
            choice = pick_replica([r for r in live if r.replica_id not in exclude], self.rng)
            if choice is None:
                raise NoReplicaAvailable(_why_none(live, exclude))
            return Route(choice, "unbound")
        owner = next((r for r in live if r.replica_id == bound.replica_id), None)
        if owner is not None and owner.replica_id not in exclude:
            return Route(owner, "owner", bound.replica_id, bound.epoch)
        candidates = [r for r in live if r.replica_id not in exclude and r.replica_id != bound.replica_id]
        choice = pick_replica(candidates, self.rng)
        if choice is None:
            raise NoReplicaAvailable(_why_none(live, exclude))
        return Route(choice, "failover", bound.replica_id, bound.epoch)

    async def wait_lapse(self, replica_id: str, timeout_s: float) -> bool:
        """Poll the lease of ``replica_id`` until it lapses (True) or ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while await self.registry.is_alive(replica_id):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.poll_s)
        return True


def _why_none(live: Collection[ReplicaInfo], exclude: Collection[str]) -> str:
    if not live:
        return "no live replica is registered"
    serving = [r for r in live if r.state == "SERVING"]
    if not serving:
        return "every live replica is draining"
    if all(r.replica_id in exclude for r in serving):
        return "no reachable replica accepted the session"
    return "every live replica is at capacity"
