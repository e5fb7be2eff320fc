"""Admission at session open: per-replica and per-tenant slots, atomic in Redis (Lua).

Outcomes: :class:`Admitted`, :class:`Queued` (position, estimated wait) or :class:`Rejected`
(code ``server_at_capacity``, a reason and Retry-After). :meth:`AdmissionController.acquire`
waits in the queue until admitted or until its deadline (default 10 s).

Redis layout (one hash tag ``{omni:adm}``, so the scripts stay in one Cluster slot; they name
tenant keys they read from the queue, which is legal only because of that shared slot):

* ``holders:r:<replica>`` / ``holders:t:<tenant>``: zsets of admitted session ids, scored by
  their lease deadline (ms, Redis ``TIME``). The replica renews all its holders in one call
  every ``holder_lease_s / 3``; the holders of a dead replica lapse and are reaped by the
  next script that touches those keys. That is how a kill -9 gives its slots back;
* ``holder``: hash session id → ``tenant \\t replica \\t start_ms``;
* ``queue:<replica>`` (zset by arrival number), ``tickets:<replica>`` (zset by ticket lease
  deadline: a waiter re-polls every ``poll_interval_s`` and lapses when it stops) and
  ``ticket`` (hash session id → ``tenant key \\t tenant limit``);
* ``stats``: EWMA of how long sessions hold a slot (for the estimated wait).

Fairness: FIFO per replica queue, but a ticket whose tenant is at its limit does not block
the tickets behind it (no head-of-line blocking across tenants).

Latency: concurrent :meth:`try_admit` calls are coalesced (group commit): the first one goes
out alone, the ones that arrive while it is in flight go out together as one EVALSHA. Each
decision is still atomic and in arrival order; 200 opens at once cost a handful of round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from session.store.redis_store import redis_errors

CODE_AT_CAPACITY = "server_at_capacity"
_BATCH_MAX = 256

_REAP_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function reap_holders(key, hm, now)
  local dead = redis.call('ZRANGEBYSCORE', key, '-inf', now)
  for _, sid in ipairs(dead) do redis.call('HDEL', hm, sid) end
  if #dead > 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', now) end
end
local function reap_tickets(q, tk, tm, now)
  local dead = redis.call('ZRANGEBYSCORE', tk, '-inf', now)
  for _, sid in ipairs(dead) do
    redis.call('ZREM', q, sid)
    redis.call('HDEL', tm, sid)
  end
  if #dead > 0 then redis.call('ZREMRANGEBYSCORE', tk, '-inf', now) end
end
"""

# KEYS: rh q tk hm tm seq stats tenant_keys...
# ARGV: replica rlimit hlease tlease maxq default_hold n, then 5 per request:
#       sid tenant tenant_key_index tenant_limit mode(1 = may queue)
_DECIDE_LUA = (
    _REAP_LUA
    + """
local now = now_ms()
local rh, q, tk, hm, tm, seqk, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local replica, rlimit = ARGV[1], tonumber(ARGV[2])
local hlease, tlease, maxq = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local hold = tonumber(redis.call('HGET', stats, 'hold_ewma_ms') or ARGV[6])
reap_holders(rh, hm, now)
reap_tickets(q, tk, tm, now)
local ractive = redis.call('ZCARD', rh)
local tcache = {}
local function tactive(key)
  local c = tcache[key]
  if c == nil then
    reap_holders(key, hm, now)
    c = redis.call('ZCARD', key)
    tcache[key] = c
  end
  return c
end
local function drop_ticket(sid)
  redis.call('ZREM', q, sid)
  redis.call('ZREM', tk, sid)
  redis.call('HDEL', tm, sid)
end
local out = {}
local n = tonumber(ARGV[7])
for i = 0, n - 1 do
  local b = 8 + i * 5
  local sid, tenant, tkey = ARGV[b], ARGV[b + 1], KEYS[tonumber(ARGV[b + 2])]
  local tlimit, mode = tonumber(ARGV[b + 3]), ARGV[b + 4]
  if redis.call('ZSCORE', rh, sid) then
    table.insert(out, 1); table.insert(out, 0); table.insert(out, 0); table.insert(out, '')
  else
    local rank = redis.call('ZRANK', q, sid)
    local ahead = {}
    if rank == false then ahead = redis.call('ZRANGE', q, 0, -1)
    elseif rank > 0 then ahead = redis.call('ZRANGE', q, 0, rank - 1) end
    local ahead_r, per_tenant = 0, {}
    for _, other in ipairs(ahead) do
      local meta = redis.call('HGET', tm, other)
      if meta then
        local sep = string.find(meta, '\\t', 1, true)
        local okey, olimit = string.sub(meta, 1, sep - 1), tonumber(string.sub(meta, sep + 1))
        local seen = per_tenant[okey] or 0
        if tactive(okey) + seen < olimit then
          ahead_r = ahead_r + 1
          per_tenant[okey] = seen + 1
        end
      end
    end
    local t_now = tactive(tkey)
    local r_ok = ractive + ahead_r < rlimit
    local t_ok = t_now + (per_tenant[tkey] or 0) < tlimit
    if r_ok and t_ok then
      local deadline = now + hlease
      redis.call('ZADD', rh, deadline, sid)
      redis.call('ZADD', tkey, deadline, sid)
      redis.call('HSET', hm, sid, tenant .. '\\t' .. replica .. '\\t' .. now)
      ractive = ractive + 1
      tcache[tkey] = t_now + 1
      if rank ~= false then drop_ticket(sid) end
      table.insert(out, 1); table.insert(out, 0); table.insert(out, 0); table.insert(out, '')
    else
      local reason = r_ok and 'tenant_limit' or 'replica_full'
      local slots = r_ok and math.max(tlimit, 1) or math.max(rlimit, 1)
      if mode == '1' and (rank ~= false or redis.call('ZCARD', q) < maxq) then
        if rank == false then
          redis.call('ZADD', q, redis.call('INCR', seqk), sid)
          redis.call('HSET', tm, sid, tkey .. '\\t' .. tlimit)
          rank = redis.call('ZCARD', q) - 1
        end
        redis.call('ZADD', tk, now + tlease, sid)
        local pos = rank + 1
        table.insert(out, 2); table.insert(out, pos)
        table.insert(out, math.floor(pos * hold / slots)); table.insert(out, reason)
      else
        if mode == '1' then reason = 'queue_full' end
        if rank ~= false then drop_ticket(sid) end
        table.insert(out, 3); table.insert(out, math.floor(hold / slots)); table.insert(out, 0)
        table.insert(out, reason)
      end
    end
  end
end
return out
"""
)

# KEYS: hm stats q tk tm; ARGV: prefix sid
_RELEASE_LUA = (
    _REAP_LUA
    + """
local now = now_ms()
local hm, stats, q, tk, tm = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prefix, sid = ARGV[1], ARGV[2]
redis.call('ZREM', q, sid); redis.call('ZREM', tk, sid); redis.call('HDEL', tm, sid)
local meta = redis.call('HGET', hm, sid)
if not meta then return 0 end
local tenant, replica, start = string.match(meta, '^(.*)\\t(.*)\\t(%d+)$')
redis.call('ZREM', prefix .. 'holders:t:' .. tenant, sid)
redis.call('ZREM', prefix .. 'holders:r:' .. replica, sid)
redis.call('HDEL', hm, sid)
local held = now - tonumber(start)
local old = tonumber(redis.call('HGET', stats, 'hold_ewma_ms') or held)
redis.call('HSET', stats, 'hold_ewma_ms', math.floor(old * 0.8 + held * 0.2))
return 1
"""
)

# KEYS: rh hm; ARGV: prefix lease_ms
_RENEW_LUA = (
    _REAP_LUA
    + """
local now = now_ms()
local rh, hm = KEYS[1], KEYS[2]
local deadline = now + tonumber(ARGV[2])
reap_holders(rh, hm, now)
local n = 0
for _, sid in ipairs(redis.call('ZRANGE', rh, 0, -1)) do
  local meta = redis.call('HGET', hm, sid)
  if meta then
    local tenant = string.match(meta, '^(.*)\\t.*\\t%d+$')
    redis.call('ZADD', rh, 'XX', deadline, sid)
    redis.call('ZADD', ARGV[1] .. 'holders:t:' .. tenant, 'XX', deadline, sid)
    n = n + 1
  else
    redis.call('ZREM', rh, sid)
  end
end
return n
"""
)

# KEYS: rh q tk hm tm [tenant_key]; returns replica_active queued holders tickets [tenant_active]
_COUNTS_LUA = (
    _REAP_LUA
    + """
local now = now_ms()
reap_holders(KEYS[1], KEYS[4], now)
reap_tickets(KEYS[2], KEYS[3], KEYS[5], now)
local out = {redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2]),
             redis.call('HLEN', KEYS[4]), redis.call('HLEN', KEYS[5])}
if KEYS[6] then
  reap_holders(KEYS[6], KEYS[4], now)
  table.insert(out, redis.call('ZCARD', KEYS[6]))
end
return out
"""
)


@dataclass(frozen=True, slots=True)
class Admitted:
    session_id: str


@dataclass(frozen=True, slots=True)
class Queued:
    session_id: str
    position: int  # 1 = next
    estimated_wait_ms: int
    reason: str  # replica_full | tenant_limit


@dataclass(frozen=True, slots=True)
class Rejected:
    session_id: str
    reason: str  # replica_full | tenant_limit | queue_full | queue_timeout | draining
    retry_after_s: int
    code: str = CODE_AT_CAPACITY


Decision = Admitted | Queued | Rejected


@dataclass(frozen=True, slots=True)
class AdmissionCounts:
    replica_active: int
    queued: int
    holders: int  # all replicas
    tickets: int  # all replicas
    tenant_active: int | None = None


@dataclass(slots=True)
class _Request:
    session_id: str
    tenant: str
    tenant_limit: int
    may_queue: bool
    future: asyncio.Future[Decision]


class AdmissionController:
    """Session-open admission for one replica. Owns its lease-renewal and batching tasks."""

    def __init__(
        self,
        redis: Redis,
        *,
        replica_id: str,
        replica_limit: int,
        tenant_limit: int | Callable[[str], int] = 100,
        holder_lease_s: float = 6.0,
        ticket_lease_s: float = 2.0,
        max_queue: int = 64,
        poll_interval_s: float = 0.1,
        default_hold_s: float = 60.0,
        prefix: str = "omni",
    ) -> None:
        if "\t" in replica_id:
            raise ValueError("replica id must not contain tabs")
        self.redis = redis
        self.replica_id = replica_id
        self.replica_limit = replica_limit
        self._tenant_limit = tenant_limit
        self.holder_lease_s = holder_lease_s
        self.ticket_lease_s = ticket_lease_s
        self.max_queue = max_queue
        self.poll_interval_s = poll_interval_s
        self.default_hold_s = default_hold_s
        self.draining = False
        self._p = f"{prefix}:{{adm}}:"
        self._decide = redis.register_script(_DECIDE_LUA)
        self._release = redis.register_script(_RELEASE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._counts = redis.register_script(_COUNTS_LUA)
        self._pending: list[_Request] = []
        self._orphans: list[str] = []
        self._drainer: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._freed = asyncio.Event()
        self.round_trips = 0

    # --- keys ---------------------------------------------------------------------------------

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._p}holders:t:{tenant}"

    @property
    def _base_keys(self) -> list[str]:
        r, p = self.replica_id, self._p
        return [f"{p}holders:r:{r}", f"{p}queue:{r}", f"{p}tickets:{r}", f"{p}holder", f"{p}ticket"]

    def tenant_limit(self, tenant: str) -> int:
        limit = self._tenant_limit
        return limit(tenant) if callable(limit) else limit

    # --- lifecycle ------------------------------------------------------------------------------

    async def load_scripts(self) -> None:
        async with redis_errors():
            for script in (self._decide, self._release, self._renew, self._counts):
                script.sha = await self.redis.script_load(script.script)

    async def start(self) -> None:
        """Start renewing this replica's holder leases (every lease / 3)."""
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_loop(), name=f"admission-renew:{self.replica_id}")

    async def close(self) -> None:
        """Stop renewing (held slots then lapse unless released); cancel undecided requests."""
        for task in (self._renewer, self._drainer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._renewer = self._drainer = None
        for req in self._pending:
            req.future.cancel()
        self._pending.clear()

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.holder_lease_s / 3)
            try:
                await self.renew()
            except Exception:  # keep renewing through a Redis blip; leases cover 3 periods
                continue

    # --- decisions ----------------------------------------------------------------------------

    async def try_admit(self, session_id: str, tenant: str, *, may_queue: bool = True) -> Decision:
        """One atomic decision (coalesced with concurrent ones into one round trip)."""
        if "\t" in tenant:
            raise ValueError("tenant must not contain tabs")
        if self.draining:
            return Rejected(session_id, "draining", retry_after_s=1)
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(session_id, tenant, self.tenant_limit(tenant), may_queue, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name=f"admission-batch:{self.replica_id}")
        return await fut

    async def _drain(self) -> None:
        while self._pending or self._orphans:
            batch, self._pending = self._pending[:_BATCH_MAX], self._pending[_BATCH_MAX:]
            orphans, self._orphans = self._orphans, []
            for sid in orphans:  # admitted for a caller that had gone: give the slot back
                with contextlib.suppress(Exception):
                    await self.release(sid)
            if not batch:
                continue
            try:
                decisions = await self._decide_batch(batch)
            except Exception as exc:
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, decision in zip(batch, decisions, strict=True):
                if not req.future.done():
                    req.future.set_result(decision)
                elif isinstance(decision, Admitted):
                    self._orphans.append(req.session_id)

    async def _decide_batch(self, batch: list[_Request]) -> list[Decision]:
        keys = [*self._base_keys, f"{self._p}seq", f"{self._p}stats"]
        index: dict[str, int] = {}
        args: list[Any] = [
            self.replica_id,
            self.replica_limit,
            int(self.holder_lease_s * 1000),
            int(self.ticket_lease_s * 1000),
            self.max_queue,
            int(self.default_hold_s * 1000),
            len(batch),
        ]
        for req in batch:
            tkey = self._tenant_key(req.tenant)
            if tkey not in index:
                keys.append(tkey)
                index[tkey] = len(keys)  # Lua KEYS are 1-based
            args += [req.session_id, req.tenant, index[tkey], req.tenant_limit, "1" if req.may_queue else "0"]
        async with redis_errors():
            raw = await self._decide(keys=keys, args=args)
        self.round_trips += 1
        out: list[Decision] = []
        for i, req in enumerate(batch):
            status, a, b, reason = raw[4 * i : 4 * i + 4]
            if int(status) == 1:
                out.append(Admitted(req.session_id))
            elif int(status) == 2:
                out.append(Queued(req.session_id, int(a), int(b), str(reason)))
            else:
                retry = max(1, min(60, math.ceil(int(a) / 1000)))
                out.append(Rejected(req.session_id, str(reason), retry))
        return out

    async def acquire(
        self,
        session_id: str,
        tenant: str,
        *,
        deadline_s: float = 10.0,
        on_queued: Callable[[Queued], Awaitable[None]] | None = None,
    ) -> Admitted | Rejected:
        """Admit now, or wait in the queue (reporting through ``on_queued``) until the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        last: tuple[int, int] | None = None
        last_report = 0.0
        while True:
            decision = await self.try_admit(session_id, tenant, may_queue=True)
            if not isinstance(decision, Queued):
                return decision
            now = loop.time()
            shown = (decision.position, decision.estimated_wait_ms)
            if on_queued is not None and (shown != last or now - last_report >= 1.0):
                last, last_report = shown, now
                await on_queued(decision)
            remaining = deadline - loop.time()
            if remaining <= 0:
                await self.leave_queue(session_id)
                retry = max(1, min(60, math.ceil(decision.estimated_wait_ms / 1000)))
                return Rejected(session_id, "queue_timeout", retry)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), min(remaining, self.poll_interval_s))

    # --- release and housekeeping ---------------------------------------------------------------

    async def release(self, session_id: str) -> bool:
        """Give the slot back (close, error, grace expiry, shutdown); also leaves the queue."""
        r, p = self.replica_id, self._p
        keys = [f"{p}holder", f"{p}stats", f"{p}queue:{r}", f"{p}tickets:{r}", f"{p}ticket"]
        async with redis_errors():
            released = bool(await self._release(keys=keys, args=[self._p, session_id]))
        self.round_trips += 1
        self._freed.set()
        self._freed = asyncio.Event()
        return released

    async def leave_queue(self, session_id: str) -> None:
        r, p = self.replica_id, self._p
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.zrem(f"{p}queue:{r}", session_id)
            pipe.zrem(f"{p}tickets:{r}", session_id)
            pipe.hdel(f"{p}ticket", session_id)
            await pipe.execute()

    async def renew(self) -> int:
        """Extend the lease of every slot this replica holds (one round trip)."""
        async with redis_errors():
            keys = [self._base_keys[0], f"{self._p}holder"]
            return int(await self._renew(keys=keys, args=[self._p, int(self.holder_lease_s * 1000)]))

    async def counts(self, tenant: str | None = None) -> AdmissionCounts:
        """Live counters after reaping lapsed leases and tickets."""
        keys = self._base_keys + ([self._tenant_key(tenant)] if tenant is not None else [])
        async with redis_errors():
            raw = await self._counts(keys=keys, args=[])
        values = [int(v) for v in raw]
        return AdmissionCounts(
            replica_active=values[0],
            queued=values[1],
            holders=values[2],
            tickets=values[3],
            tenant_active=values[4] if tenant is not None else None,
        )
