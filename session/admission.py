"""Admission at session open: per-replica and per-tenant slots, atomic in Redis (Lua).

Outcomes: :class:`Admitted`, :class:`Queued` (position, estimated wait) or :class:`Rejected`
(code ``server_at_capacity``, a reason and Retry-After). :meth:`AdmissionController.acquire`
waits in the queue until admitted or until its deadline (default 10 s).

Redis layout (one hash tag ``{omni:adm}``, so the scripts stay in one Cluster slot; they name
keys they learn from the data, e.g. a dead holder's tenant set, which is legal only because of
that shared slot):

* ``leases``: zset session id → lease deadline (ms, Redis ``TIME``) of every admitted
  session. A replica renews all its holders in one call every ``holder_lease_s / 3``; every
  script first reaps lapsed leases from all sets. That is how a kill -9 gives its slots back;
* ``holders:r:<replica>`` / ``holders:t:<tenant>``: zsets of admitted session ids (the counts);
* ``holder``: hash session id → ``tenant \\t replica \\t start_ms``;
* ``queue:<replica>``: zset of waiting session ids by arrival number; ``tickets``: zset session
  id → ticket deadline (a waiter re-polls every ``poll_interval_s``; one that stops lapses);
  ``ticket``: hash session id → ``tenant key \\t tenant limit \\t replica``;
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

from session.store.aio import cancel_and_wait, wait_event
from session.store.redis_store import redis_errors

CODE_AT_CAPACITY = "server_at_capacity"
_BATCH_MAX = 256

# Shared by every script. ARGV[1] is always the key prefix ("omni:{adm}:").
_REAP_LUA = """
local P = ARGV[1]
local LEASES, HM, TICKETS, TM = P .. 'leases', P .. 'holder', P .. 'tickets', P .. 'ticket'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget_holder(sid)
  local meta = redis.call('HGET', HM, sid)
  if meta then
    local tenant, replica = string.match(meta, '^(.*)\\t(.*)\\t%d+$')
    redis.call('ZREM', P .. 'holders:t:' .. tenant, sid)
    redis.call('ZREM', P .. 'holders:r:' .. replica, sid)
    redis.call('HDEL', HM, sid)
  end
  redis.call('ZREM', LEASES, sid)
  return meta
end
local function forget_ticket(sid)
  local meta = redis.call('HGET', TM, sid)
  if meta then
    local replica = string.match(meta, '\\t([^\\t]*)$')
    redis.call('ZREM', P .. 'queue:' .. replica, sid)
    redis.call('HDEL', TM, sid)
  end
  redis.call('ZREM', TICKETS, sid)
end
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', LEASES, '-inf', now)) do forget_holder(sid) end
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', TICKETS, '-inf', now)) do forget_ticket(sid) end
"""

# KEYS: leases holder tickets ticket seq stats rh q tenant_keys...
# ARGV: prefix replica rlimit hlease tlease maxq default_hold, then one per request:
#       "sid \t tenant \t tenant_key_index \t tenant_limit \t mode(1 = may queue)"
# Returns one string, "status,a,b,reason" per request joined by ";" (cheap to parse in Python).
_DECIDE_LUA = (
    _REAP_LUA
    + """
local seqk, stats, rh, q = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local replica, rlimit = ARGV[2], tonumber(ARGV[3])
local hlease, tlease, maxq = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local hold = tonumber(redis.call('HGET', stats, 'hold_ewma_ms') or ARGV[7])
local ractive = redis.call('ZCARD', rh)
local qlen = redis.call('ZCARD', q)
local tcache = {}
local function tactive(key)
  local c = tcache[key]
  if c == nil then
    c = redis.call('ZCARD', key)
    tcache[key] = c
  end
  return c
end
local out = {}
for i = 8, #ARGV do
  local sid, tenant, tki, tlimit, mode = string.match(ARGV[i], '^([^\t]*)\t([^\t]*)\t(%d+)\t(%d+)\t(%d)$')
  local tkey = KEYS[tonumber(tki)]
  tlimit = tonumber(tlimit)
  if redis.call('ZSCORE', rh, sid) then
    out[#out + 1] = '1,0,0,'
  else
    local rank = false
    local ahead = {}
    if qlen > 0 then
      rank = redis.call('ZRANK', q, sid)
      if rank == false then ahead = redis.call('ZRANGE', q, 0, -1)
      elseif rank > 0 then ahead = redis.call('ZRANGE', q, 0, rank - 1) end
    end
    local ahead_r, per_tenant = 0, {}
    for _, other in ipairs(ahead) do
      local meta = redis.call('HGET', TM, other)
      if meta then
        local okey, olimit = string.match(meta, '^([^\t]*)\t(%d+)\t')
        olimit = tonumber(olimit)
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
      redis.call('ZADD', LEASES, now + hlease, sid)
      redis.call('ZADD', rh, now, sid)
      redis.call('ZADD', tkey, now, sid)
      redis.call('HSET', HM, sid, tenant .. '\t' .. replica .. '\t' .. now)
      ractive = ractive + 1
      tcache[tkey] = t_now + 1
      if rank ~= false then
        forget_ticket(sid)
        qlen = qlen - 1
      end
      out[#out + 1] = '1,0,0,'
    else
      local reason = r_ok and 'tenant_limit' or 'replica_full'
      local slots = r_ok and math.max(tlimit, 1) or math.max(rlimit, 1)
      if mode == '1' and (rank ~= false or qlen < maxq) then
        if rank == false then
          redis.call('ZADD', q, redis.call('INCR', seqk), sid)
          redis.call('HSET', TM, sid, tkey .. '\t' .. tlimit .. '\t' .. replica)
          rank = qlen
          qlen = qlen + 1
        end
        redis.call('ZADD', TICKETS, now + tlease, sid)
        local pos = rank + 1
        out[#out + 1] = '2,' .. pos .. ',' .. math.floor(pos * hold / slots) .. ',' .. reason
      else
        if mode == '1' then reason = 'queue_full' end
        if rank ~= false then
          forget_ticket(sid)
          qlen = qlen - 1
        end
        out[#out + 1] = '3,' .. math.floor(hold / slots) .. ',0,' .. reason
      end
    end
  end
end
return table.concat(out, ';')
"""
)

# KEYS: leases holder tickets ticket stats; ARGV: prefix sid
_RELEASE_LUA = (
    _REAP_LUA
    + """
local sid = ARGV[2]
forget_ticket(sid)
local meta = forget_holder(sid)
if not meta then return 0 end
local held = now - tonumber(string.match(meta, '\\t(%d+)$'))
local old = tonumber(redis.call('HGET', KEYS[5], 'hold_ewma_ms') or held)
redis.call('HSET', KEYS[5], 'hold_ewma_ms', math.floor(old * 0.8 + held * 0.2))
return 1
"""
)

# KEYS: leases holder tickets ticket rh; ARGV: prefix lease_ms
_RENEW_LUA = (
    _REAP_LUA
    + """
local deadline = now + tonumber(ARGV[2])
local n = 0
for _, sid in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
  if redis.call('ZADD', LEASES, 'XX', 'CH', deadline, sid) == 1 or redis.call('ZSCORE', LEASES, sid) then
    n = n + 1
  end
end
return n
"""
)

# KEYS: leases holder tickets ticket rh q [tenant_key]
# returns replica_active queued holders tickets [tenant_active]
_COUNTS_LUA = (
    _REAP_LUA
    + """
local out = {redis.call('ZCARD', KEYS[5]), redis.call('ZCARD', KEYS[6]),
             redis.call('HLEN', HM), redis.call('ZCARD', TICKETS)}
if KEYS[7] then table.insert(out, redis.call('ZCARD', KEYS[7])) end
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
class PendingAdmission:
    """One open waiting for the next batch's decision (public: the admission bench builds batches)."""

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
        self._pending: list[PendingAdmission] = []
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
        """Keys every script declares (it reaps lapsed leases and tickets first)."""
        p = self._p
        return [f"{p}leases", f"{p}holder", f"{p}tickets", f"{p}ticket"]

    @property
    def _replica_keys(self) -> list[str]:
        return [f"{self._p}holders:r:{self.replica_id}", f"{self._p}queue:{self.replica_id}"]

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
            await cancel_and_wait(task)
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
        self._pending.append(PendingAdmission(session_id, tenant, self.tenant_limit(tenant), may_queue, fut))
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

    async def _decide_batch(self, batch: list[PendingAdmission]) -> list[Decision]:
        keys = [*self._base_keys, f"{self._p}seq", f"{self._p}stats", *self._replica_keys]
        index: dict[str, int] = {}
        args: list[Any] = [
            self._p,
            self.replica_id,
            self.replica_limit,
            int(self.holder_lease_s * 1000),
            int(self.ticket_lease_s * 1000),
            self.max_queue,
            int(self.default_hold_s * 1000),
        ]
        for req in batch:
            tkey = self._tenant_key(req.tenant)
            if tkey not in index:
                keys.append(tkey)
                index[tkey] = len(keys)  # Lua KEYS are 1-based
            mode = "1" if req.may_queue else "0"
            args.append(f"{req.session_id}\t{req.tenant}\t{index[tkey]}\t{req.tenant_limit}\t{mode}")
        async with redis_errors():
            raw = await self._decide(keys=keys, args=args)
        self.round_trips += 1
        out: list[Decision] = []
        for req, encoded in zip(batch, str(raw).split(";"), strict=True):
            status, a, b, reason = encoded.split(",")
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
            await wait_event(self._freed, min(remaining, self.poll_interval_s))

    # --- release and housekeeping ---------------------------------------------------------------

    async def release(self, session_id: str) -> bool:
        """Give the slot back (close, error, grace expiry, shutdown); also leaves the queue."""
        keys = [*self._base_keys, f"{self._p}stats"]
        async with redis_errors():
            released = bool(await self._release(keys=keys, args=[self._p, session_id]))
        self.round_trips += 1
        self._freed.set()
        self._freed = asyncio.Event()
        return released

    async def leave_queue(self, session_id: str) -> None:
        p = self._p
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.zrem(f"{p}queue:{self.replica_id}", session_id)
            pipe.zrem(f"{p}tickets", session_id)
            pipe.hdel(f"{p}ticket", session_id)
            await pipe.execute()

    async def renew(self) -> int:
        """Extend the lease of every slot this replica holds (one round trip)."""
        async with redis_errors():
            keys = [*self._base_keys, self._replica_keys[0]]
            return int(await self._renew(keys=keys, args=[self._p, int(self.holder_lease_s * 1000)]))

    async def counts(self, tenant: str | None = None) -> AdmissionCounts:
        """Live counters after reaping lapsed leases and tickets."""
        keys = [*self._base_keys, *self._replica_keys]
        if tenant is not None:
            keys.append(self._tenant_key(tenant))
        async with redis_errors():
            raw = await self._counts(keys=keys, args=[self._p])
        values = [int(v) for v in raw]
        return AdmissionCounts(
            replica_active=values[0],
            queued=values[1],
            holders=values[2],
            tickets=values[3],
            tenant_active=values[4] if tenant is not None else None,
        )
