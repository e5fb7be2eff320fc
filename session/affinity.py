"""Affinity: the replica registry (leases) and the session → replica binding (epoch fencing).

Registry (hash tag ``{replicas}``): ``<prefix>:{replicas}:index`` is a zset replica id → lease
deadline (ms, Redis ``TIME``) and ``<prefix>:{replicas}:r:<id>`` a hash (id, url, capacity,
load, state, lease_until) that expires with the lease. A replica heartbeats every ~2 s
(:class:`ReplicaLease`) with a ~5 s lease, so one missed beat is tolerated and a dead replica
disappears within ~5 s. Reads reap lapsed entries.

Binding: the session's ``owner`` hash (``replica``, ``epoch``) lives beside its other keys
(same ``{sess_…}`` tag, same TTL). :meth:`SessionBinding.bind` is first-writer-wins
(``HSETNX`` semantics in Lua): epoch 1 for the first owner. :meth:`SessionBinding.takeover`
is a compare-and-set on the epoch the caller saw (it checked the owner's lease had lapsed),
so of two gateways racing to move a session exactly one wins, with epoch + 1. Every write a
replica makes to the session carries its epoch; the store's batch script rejects a stale one
atomically (:class:`session.store.errors.StaleEpoch`), so a replica that comes back after its
lease lapsed cannot write to a session that moved.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from redis.asyncio import Redis

from session.store.aio import cancel_and_wait
from session.store.keys import DEFAULT_PREFIX, session_keys
from session.store.redis_store import redis_errors

ReplicaState = Literal["SERVING", "DRAINING"]

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: index rkey; ARGV: lease_ms id url capacity load state
_HEARTBEAT_LUA = (
    _NOW
    + """
local lease = tonumber(ARGV[1])
local deadline = now + lease
redis.call('HSET', KEYS[2], 'id', ARGV[2], 'url', ARGV[3], 'capacity', ARGV[4], 'load', ARGV[5],
           'state', ARGV[6], 'lease_until', deadline)
redis.call('PEXPIRE', KEYS[2], lease)
redis.call('ZADD', KEYS[1], deadline, ARGV[2])
return deadline
"""
)

# KEYS: index; ARGV: key prefix of replica hashes
_LIVE_LUA = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h > 0 then table.insert(out, h) end
end
return out
"""
)

# KEYS: index; ARGV: id
_ALIVE_LUA = (
    _NOW
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then return 1 end
return 0
"""
)

# KEYS: owner meta; ARGV: replica default_ttl_ms
_BIND_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'replica', 'epoch')
if cur[1] then return {cur[1], tonumber(cur[2]), 0} end
redis.call('HSET', KEYS[1], 'replica', ARGV[1], 'epoch', 1)
local ttl = redis.call('PTTL', KEYS[2])
if ttl <= 0 then ttl = tonumber(ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], ttl)
return {ARGV[1], 1, 1}
"""

# KEYS: owner meta; ARGV: replica expected_epoch default_ttl_ms
_TAKEOVER_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'replica', 'epoch')
local expected = tonumber(ARGV[2])
local epoch = tonumber(cur[2] or '0')
if cur[1] and epoch ~= expected then return {cur[1], epoch, 0} end
local new = math.max(epoch, expected) + 1
redis.call('HSET', KEYS[1], 'replica', ARGV[1], 'epoch', new, 'previous', cur[1] or '')
local ttl = redis.call('PTTL', KEYS[2])
if ttl <= 0 then ttl = tonumber(ARGV[3]) end
redis.call('PEXPIRE', KEYS[1], ttl)
return {ARGV[1], new, 1}
"""


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    replica_id: str
    url: str
    capacity: int
    load: int = 0
    state: ReplicaState = "SERVING"
    lease_until_ms: int = 0

    @property
    def accepting(self) -> bool:
        return self.state == "SERVING" and self.load < self.capacity


class ReplicaRegistry:
    """Replica records under leases. Every method is one round trip."""

    def __init__(self, redis: Redis, *, lease_s: float = 5.0, prefix: str = DEFAULT_PREFIX) -> None:
        self.redis = redis
        self.lease_s = lease_s
        self._index = f"{prefix}:{{replicas}}:index"
        self._rprefix = f"{prefix}:{{replicas}}:r:"
        self._heartbeat = redis.register_script(_HEARTBEAT_LUA)
        self._live = redis.register_script(_LIVE_LUA)
        self._alive = redis.register_script(_ALIVE_LUA)

    async def heartbeat(self, info: ReplicaInfo) -> int:
        """Register or refresh; returns the new lease deadline (Redis ms)."""
        args: list[str | int] = [
            int(self.lease_s * 1000),
            info.replica_id,
            info.url,
            info.capacity,
            info.load,
            info.state,
        ]
        async with redis_errors():
            return int(await self._heartbeat(keys=[self._index, self._rprefix + info.replica_id], args=args))

    async def deregister(self, replica_id: str) -> None:
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.zrem(self._index, replica_id)
            pipe.delete(self._rprefix + replica_id)
            await pipe.execute()

    async def live_replicas(self) -> list[ReplicaInfo]:
        async with redis_errors():
            raw = await self._live(keys=[self._index], args=[self._rprefix])
        out: list[ReplicaInfo] = []
        for flat in raw:
            h = {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}
            state: ReplicaState = "DRAINING" if h.get("state") == "DRAINING" else "SERVING"
            out.append(
                ReplicaInfo(
                    replica_id=h["id"],
                    url=h.get("url", ""),
                    capacity=int(h.get("capacity", 0)),
                    load=int(h.get("load", 0)),
                    state=state,
                    lease_until_ms=int(h.get("lease_until", 0)),
                )
            )
        return out

    async def is_alive(self, replica_id: str) -> bool:
        async with redis_errors():
            return bool(await self._alive(keys=[self._index], args=[replica_id]))

    async def pick(self, rng: random.Random | None = None) -> ReplicaInfo | None:
        return pick_replica(await self.live_replicas(), rng)


def pick_replica(replicas: Sequence[ReplicaInfo], rng: random.Random | None = None) -> ReplicaInfo | None:
    """Power of two choices: two random accepting replicas, the less loaded (by load/capacity)."""
    candidates = [r for r in replicas if r.accepting]
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    a, b = (rng or random).sample(candidates, 2)
    return a if (a.load / a.capacity, a.load) <= (b.load / b.capacity, b.load) else b


class ReplicaLease:
    """Keeps one replica registered: heartbeats every ``refresh_s`` until stopped."""

    def __init__(self, registry: ReplicaRegistry, info: ReplicaInfo, *, refresh_s: float = 2.0) -> None:
        self.registry = registry
        self.info = info
        self.refresh_s = refresh_s
        self._task: asyncio.Task[None] | None = None
        self.failures = 0

    def set_load(self, load: int) -> None:
        self.info = replace(self.info, load=load)  # sent with the next heartbeat

    async def start(self) -> None:
        await self.registry.heartbeat(self.info)  # fail fast when Redis is down at start
        self._task = asyncio.create_task(self._run(), name=f"replica-lease:{self.info.replica_id}")

    async def drain(self) -> None:
        """Stop taking new sessions (pickers skip DRAINING); existing ones finish."""
        self.info = replace(self.info, state="DRAINING")
        await self.registry.heartbeat(self.info)

    async def stop(self, *, deregister: bool = True) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if deregister:
            await self.registry.deregister(self.info.replica_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.registry.heartbeat(self.info)
                self.failures = 0
            except Exception:  # a blip: the lease covers ~2 missed beats
                self.failures += 1


@dataclass(frozen=True, slots=True)
class Binding:
    replica_id: str
    epoch: int
    won: bool  # this call created or took over the binding
    previous_replica: str | None = None  # set when the session moved (failover)


class SessionBinding:
    """session → replica with an epoch. First writer wins; moves are CAS on the epoch."""

    def __init__(self, redis: Redis, *, prefix: str = DEFAULT_PREFIX, default_ttl_s: float = 600.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.default_ttl_ms = int(default_ttl_s * 1000)
        self._bind = redis.register_script(_BIND_LUA)
        self._takeover = redis.register_script(_TAKEOVER_LUA)

    def _keys(self, session_id: str) -> list[str]:
        k = session_keys(session_id, self.prefix)
        return [k.owner, k.meta]

    async def get(self, session_id: str) -> Binding | None:
        async with redis_errors():
            replica, epoch = await self.redis.hmget(self._keys(session_id)[0], ["replica", "epoch"])
        if replica is None or epoch is None:
            return None
        return Binding(str(replica), int(epoch), won=False)

    async def bind(self, session_id: str, replica_id: str) -> Binding:
        """Bind if unbound (epoch 1); otherwise return the existing owner with ``won=False``."""
        async with redis_errors():
            owner, epoch, won = await self._bind(
                keys=self._keys(session_id), args=[replica_id, self.default_ttl_ms]
            )
        return Binding(str(owner), int(epoch), won=bool(won))

    async def takeover(self, session_id: str, replica_id: str, expected_epoch: int) -> Binding:
        """Move the session to ``replica_id`` iff its epoch is still ``expected_epoch``."""
        async with redis_errors():
            owner, epoch, won = await self._takeover(
                keys=self._keys(session_id), args=[replica_id, expected_epoch, self.default_ttl_ms]
            )
        return Binding(str(owner), int(epoch), won=bool(won))

    async def claim(
        self, session_id: str, replica_id: str, is_alive: Callable[[str], Awaitable[bool]]
    ) -> Binding:
        """Bind, or take over when the current owner's lease has lapsed; else the live owner."""
        current = await self.bind(session_id, replica_id)
        if current.won or current.replica_id == replica_id or await is_alive(current.replica_id):
            return current
        moved = await self.takeover(session_id, replica_id, current.epoch)
        if moved.won:
            return replace(moved, previous_replica=current.replica_id)
        return moved
