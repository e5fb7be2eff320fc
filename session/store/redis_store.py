"""The session store on Redis (the only store implementation).

Per session (all keys share the hash tag ``{sess_…}``, see :mod:`session.store.keys`):

* ``meta`` hash: ``tenant``, ``state``, ``config`` (JSON), ``created_at``, ``last_active``,
  ``expires_at`` (the max-lifetime deadline), ``event_seq`` (last durable event seq),
  ``resume_token_sha256``;
* ``items`` hash (item id → item JSON) and ``order`` list (item ids in conversation order):
  the conversation, transcripts included (they live in the items' content);
* ``events`` stream: every client-visible server event except audio deltas, entry id
  ``0-<seq>``, fields ``i`` (event id) and ``e`` (event JSON), capped with ``XADD MAXLEN ~
  stream_maxlen`` and ``log_max_bytes``; every item and transcript stays for the session's
  life (see ``events_after`` → ``ReplayUnavailable``). Audio deltas
  (:data:`HELD_EVENT_TYPES`) are kept by the session's writer in its own process, for a
  resume there within the disconnect grace (``SessionWriter.replay``);
* ``owner`` hash: the replica binding and its epoch (written by ``session.affinity``).

Every key carries a PEXPIRE of ``min(idle TTL, time left to expires_at)``, refreshed by each
writer flush, so Redis itself deletes an abandoned session.

All mutations of a live session go through :meth:`SessionStore.apply_batch`: one Lua script,
one round trip, atomic, idempotent on retry and fenced by the binding epoch.
:meth:`SessionStore.apply_batches` pipelines that script for many sessions in one round trip.
The buffering policy on top of it is :class:`session.store.event_log.SessionWriter`, flushed by
one :class:`session.store.event_log.WriterHub` per process.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from session.identity import new_resume_token, new_session_id, resume_token_matches, secret_digest
from session.retention import RetentionPolicy
from session.store.errors import (
    ReplayUnavailable,
    ResumeTokenInvalid,
    SessionExists,
    SessionGone,
    SessionNotFound,
    StaleEpoch,
    StoreError,
    StoreUnavailable,
)
from session.store.event_ids import parse_event_id, session_tag, split_events
from session.store.keys import DEFAULT_PREFIX, SessionKeys, session_keys
from session.store.log_budget import WriterLimits

# (op, a, b, c): ("e", seq, event_id, event_json) | ("i", item_id, item_json, after) |
# ("d", item_id, "", "") | ("m", field, value, "") | ("t", min_seq, "", "") — ``after``: "" append,
# "^" first, else an item id; ``t`` trims the event stream below ``min_seq`` (its byte budget)
BatchOp = tuple[str, str, str, str]
MAX_OPS_PER_CALL = 1024
# Kept by the writer's process, not in the stream: at 24 kHz they are nearly all of a voice
# session's event bytes (``docs/benchmarks.md``: logging them made the embedded Redis rewrite its
# AOF every few seconds at 200 sessions, and those rewrites stalled every session's audio).
HELD_EVENT_TYPES = frozenset({"response.output_audio.delta"})


class SessionBatch(NamedTuple):
    """One session's ops for :meth:`SessionStore.apply_batches` (a writer's flush)."""

    session_id: str
    ops: Sequence[BatchOp]
    epoch: int
    expires_at: float


_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: meta events items order owner; ARGV: epoch now ttl_ms maxlen nops, then 4 per op
_APPLY_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('SESSION_GONE') end
local epoch = tonumber(ARGV[1])
if epoch > 0 then
  local cur = redis.call('HGET', KEYS[5], 'epoch')
  if (not cur) or tonumber(cur) ~= epoch then
    return redis.error_reply('STALE_EPOCH ' .. tostring(cur))
  end
end
local ttl = tonumber(ARGV[3])
if ttl <= 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  return redis.error_reply('SESSION_GONE expired')
end
local top = tonumber(redis.call('HGET', KEYS[1], 'event_seq') or '0')
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  local b = 6 + i * 4
  local op, a, x, y = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  if op == 'e' then
    local seq = tonumber(a)
    if seq > top then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '0-' .. a, 'i', x, 'e', y)
      top = seq
    end
  elseif op == 'i' then
    if redis.call('HSET', KEYS[3], a, x) == 1 then
      if y == '' then
        redis.call('RPUSH', KEYS[4], a)
      elseif y == '^' then
        redis.call('LPUSH', KEYS[4], a)
      elseif redis.call('LINSERT', KEYS[4], 'AFTER', y, a) <= 0 then
        redis.call('RPUSH', KEYS[4], a)
      end
    end
  elseif op == 'd' then
    redis.call('HDEL', KEYS[3], a)
    redis.call('LREM', KEYS[4], 0, a)
  elseif op == 'm' then
    redis.call('HSET', KEYS[1], a, x)
  elseif op == 't' then
    redis.call('XTRIM', KEYS[2], 'MINID', '0-' .. a)
  end
end
redis.call('HSET', KEYS[1], 'event_seq', top, 'last_active', ARGV[2])
for k = 1, 5 do redis.call('PEXPIRE', KEYS[k], ttl) end
return top
"""


# KEYS: meta events; ARGV: start_seq last_event_id ('' = from the first event) count
# Returns {status, events JSON array text, meta hash flat}.
_REPLAY_LUA = """
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then return {'not_found', '', meta} end
local stored = 0
for i = 1, #meta, 2 do
  if meta[i] == 'event_seq' then stored = tonumber(meta[i + 1]) end
end
local start, from_start = tonumber(ARGV[1]), ARGV[2] == ''
if (not from_start) and start > stored then return {'unknown_event_id', '', meta} end
local entries = redis.call('XRANGE', KEYS[2], '0-' .. start, '+', 'COUNT', ARGV[3])
if #entries == 0 then
  if from_start and stored == 0 then return {'ok', '[]', meta} end
  return {'trimmed', '', meta}
end
local function seq_of(id) return tonumber(string.sub(id, 3)) end
if seq_of(entries[1][1]) ~= start then return {'trimmed', '', meta} end
local i0, expected = 1, start
if not from_start then
  if entries[1][2][2] ~= ARGV[2] then return {'unknown_event_id', '', meta} end
  i0, expected = 2, start + 1
end
local parts = {}
for i = i0, #entries do
  if seq_of(entries[i][1]) ~= expected then return {'gap', '', meta} end
  parts[#parts + 1] = entries[i][2][4]
  expected = expected + 1
end
return {'ok', '[' .. table.concat(parts, ',') .. ']', meta}
"""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    tenant: str
    state: str
    config: dict[str, Any]
    created_at: float
    last_active: float
    expires_at: float
    event_seq: int  # last durable event seq (the writer continues at event_seq + 1)
    open_response: dict[str, Any] | None = None  # SessionWriter.set_open_response

    @classmethod
    def from_hash(cls, session_id: str, h: dict[str, str]) -> SessionRecord:
        return cls(
            session_id=session_id,
            tenant=h["tenant"],
            state=h.get("state", "active"),
            config=json.loads(h.get("config") or "{}"),
            created_at=float(h["created_at"]),
            last_active=float(h.get("last_active") or h["created_at"]),
            expires_at=float(h["expires_at"]),
            event_seq=int(h.get("event_seq") or 0),
            open_response=json.loads(h["response"]) if h.get("response") else None,
        )


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """Everything needed to rebuild a session (config, state, conversation with transcripts)."""

    record: SessionRecord
    items: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Resumed:
    """A resume's outcome: ``events`` to replay, or ``None`` and why (then resync from snapshot)."""

    record: SessionRecord
    events: list[dict[str, Any]] | None
    replay_unavailable: ReplayUnavailable | None


@asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Map transport failures to :class:`StoreUnavailable` (HTTP 503 at the edge)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise StoreUnavailable(f"redis unavailable: {exc}") from exc


class SessionStore:
    """Session state in Redis. Stateless itself: any number of replicas can share one Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        policy: RetentionPolicy | None = None,
        stream_maxlen: int = 4096,
        log_max_bytes: int = 4 * 1024 * 1024,
        held_event_types: frozenset[str] = HELD_EVENT_TYPES,
        held_max_bytes: int = 4 * 1024 * 1024,
        held_window_s: float = 55.0,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.policy = policy or RetentionPolicy()
        self.stream_maxlen = stream_maxlen
        # Each session's event stream also holds at most this many bytes of event JSON (its
        # writer trims the oldest entries, ``t`` ops): 4,096 events of 1.9 MB would be 8 GB.
        self.log_max_bytes = log_max_bytes
        # Events of these types are not written here: each session's writer keeps them in its
        # process (``HeldEvents``: their PCM), at most ``held_max_bytes`` and, while connected,
        # ``held_window_s`` old, and a resume on that process replays them (see ``SessionWriter``).
        self.held_event_types = held_event_types
        self.held_max_bytes = held_max_bytes
        self.held_window_s = held_window_s
        self.prefix = prefix
        self.clock = clock
        self._create = redis.register_script(_CREATE_LUA)
        self._apply = redis.register_script(_APPLY_LUA)
        self._replay_script = redis.register_script(_REPLAY_LUA)

    def keys(self, session_id: str) -> SessionKeys:
        return session_keys(session_id, self.prefix)

    @property
    def writer_limits(self) -> WriterLimits:
        """What each session's writer is bounded by (:mod:`session.store.log_budget`)."""
        return WriterLimits(
            log_max_bytes=self.log_max_bytes,
            stream_maxlen=self.stream_maxlen,
            held_event_types=self.held_event_types,
            held_max_bytes=self.held_max_bytes,
            held_window_s=self.held_window_s,
        )

    async def load_scripts(self) -> None:
        """Load the Lua scripts now, so the first flush is one round trip, not three."""
        async with redis_errors():
            for script in (self._create, self._apply, self._replay_script):
                script.sha = await self.redis.script_load(script.script)

    # --- open / read ------------------------------------------------------------------------

    async def create_session(
        self,
        tenant: str,
        config: dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
        resume_token: str | None = None,
    ) -> tuple[SessionRecord, str]:
        """A new session and its resume token (shown once; Redis keeps only its digest). The
        caller may have drawn the token already (it went out in a 101 before the record)."""
        sid = session_id or new_session_id()
        now = self.clock()
        expires_at = self.policy.lifetime_deadline(now)
        token = resume_token or new_resume_token()
        cfg = dict(config or {})
        fields = {
            "tenant": tenant,
            "state": "active",
            "config": json.dumps(cfg),
            "created_at": repr(now),
            "last_active": repr(now),
            "expires_at": repr(expires_at),
            "event_seq": "0",
            "resume_token_sha256": secret_digest(token),
        }
        args: list[str] = [str(self.policy.key_ttl_ms(now, expires_at))]
        for k, v in fields.items():
            args += [k, v]
        async with redis_errors():
            created = await self._create(keys=[self.keys(sid).meta], args=args)
        if not created:
            raise SessionExists(sid)
        record = SessionRecord(sid, tenant, "active", cfg, now, now, expires_at, 0)
        return record, token

    async def _meta(self, session_id: str) -> dict[str, str]:
        async with redis_errors():
            h = await self.redis.hgetall(self.keys(session_id).meta)
        return {str(k): str(v) for k, v in h.items()}

    async def get_session(self, tenant: str, session_id: str) -> SessionRecord:
        """The session if it exists and belongs to ``tenant``; else :class:`SessionNotFound`."""
        h = await self._meta(session_id)
        if not h or h.get("tenant") != tenant:
            raise SessionNotFound(session_id)
        return SessionRecord.from_hash(session_id, h)

    async def authorize_resume(self, tenant: str, session_id: str, token: str | None) -> SessionRecord:
        """Tenant check, then a constant-time token check (:class:`ResumeTokenInvalid` → 403)."""
        h = await self._meta(session_id)
        if not h or h.get("tenant") != tenant:
            raise SessionNotFound(session_id)
        if not resume_token_matches(token, h.get("resume_token_sha256")):
            raise ResumeTokenInvalid(session_id)
        return SessionRecord.from_hash(session_id, h)

    async def load_snapshot(self, tenant: str, session_id: str) -> SessionSnapshot:
        """Record and items in one round trip (rebuild after restart or failover)."""
        k = self.keys(session_id)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(k.meta)
            pipe.lrange(k.order, 0, -1)
            pipe.hgetall(k.items)
            meta, order, items = await pipe.execute()
        if not meta or meta.get("tenant") != tenant:
            raise SessionNotFound(session_id)
        ordered = [json.loads(items[i]) for i in order if i in items]
        return SessionSnapshot(SessionRecord.from_hash(session_id, meta), ordered)

    async def list_items(self, session_id: str) -> list[dict[str, Any]]:
        k = self.keys(session_id)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.lrange(k.order, 0, -1)
            pipe.hgetall(k.items)
            order, items = await pipe.execute()
        return [json.loads(items[i]) for i in order if i in items]

    async def _replay(
        self, session_id: str, last_event_id: str | None, limit: int | None
    ) -> tuple[dict[str, str], list[dict[str, Any]] | ReplayUnavailable]:
        """One EVALSHA: the meta hash and the events after ``last_event_id`` (or why not)."""
        ref = parse_event_id(last_event_id) if last_event_id is not None else None
        bad_id = last_event_id is not None and (ref is None or ref.tag != session_tag(session_id))
        # An event the process kept (not in the stream) resolves through the logged one before it.
        logged_id = ref.logged_id if ref is not None else None
        start_seq = ref.seq if ref is not None and ref.seq else 1
        count = (limit if limit is not None else self.stream_maxlen * 2) + 1
        k = self.keys(session_id)
        args: list[str | int] = [start_seq, logged_id or "", count]
        async with redis_errors():
            status, payload, flat = await self._replay_script(keys=[k.meta, k.events], args=args)
        meta = {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}
        if status == "not_found":
            return meta, ReplayUnavailable(session_id, last_event_id, "not_found")
        if bad_id:
            return meta, ReplayUnavailable(session_id, last_event_id, "unknown_event_id")
        if status != "ok":
            return meta, ReplayUnavailable(session_id, last_event_id, str(status))
        # Parsed element by element, each keeping its stored text to be sent as is.
        events: list[dict[str, Any]] = list(split_events(payload))
        return meta, events

    async def events_after(
        self, session_id: str, last_event_id: str | None, *, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Durable events after ``last_event_id`` in original order (one round trip).

        ``None`` replays from the session's first event. Raises :class:`SessionNotFound` or
        :class:`ReplayUnavailable` (``trimmed`` / ``unknown_event_id`` / ``gap``); the caller
        then resyncs the client from :meth:`load_snapshot`. Events still buffered in this
        process's writer are not here: use ``SessionWriter.events_after`` (flushes first).
        The script checks the first entry and contiguity and returns the events as one JSON
        array string, so the client parses one bulk reply, not two RESP items per event.
        """
        meta, result = await self._replay(session_id, last_event_id, limit)
        if not meta:
            raise SessionNotFound(session_id)
        if isinstance(result, ReplayUnavailable):
            raise result
        return result

    async def resume(
        self, tenant: str, session_id: str, token: str | None, last_event_id: str | None
    ) -> Resumed:
        """Authorize a resume and fetch what the client missed, in one round trip.

        Raises :class:`SessionNotFound` (unknown, expired, other tenant) or
        :class:`ResumeTokenInvalid`; no event leaves this method before both checks pass.
        """
        meta, result = await self._replay(session_id, last_event_id, None)
        if not meta or meta.get("tenant") != tenant:
            raise SessionNotFound(session_id)
        if not resume_token_matches(token, meta.get("resume_token_sha256")):
            raise ResumeTokenInvalid(session_id)
        record = SessionRecord.from_hash(session_id, meta)
        if isinstance(result, ReplayUnavailable):
            return Resumed(record, None, result)
        return Resumed(record, result, None)

    # --- write / end ------------------------------------------------------------------------

    def _apply_calls(
        self, session_id: str, ops: Sequence[BatchOp], epoch: int, expires_at: float, now: float
    ) -> list[tuple[list[str], list[str | int]]]:
        """The EVALSHA calls (keys, args) that apply ``ops``: one per :data:`MAX_OPS_PER_CALL`."""
        ttl_ms = self.policy.key_ttl_ms(now, expires_at)
        keys = list(self.keys(session_id).all())
        calls: list[tuple[list[str], list[str | int]]] = []
        for start in range(0, max(1, len(ops)), MAX_OPS_PER_CALL):
            chunk = ops[start : start + MAX_OPS_PER_CALL]
            args: list[str | int] = [epoch, repr(now), ttl_ms, self.stream_maxlen, len(chunk)]
            for op in chunk:
                args.extend(op)
            calls.append((keys, args))
        return calls

    @staticmethod
    def _fence_error(session_id: str, epoch: int, exc: ResponseError) -> StaleEpoch | SessionGone | None:
        """The apply script's refusals as store errors; ``None`` for any other error reply."""
        msg = str(exc)
        if msg.startswith("STALE_EPOCH"):
            current = msg.split(" ", 1)[1] if " " in msg else "None"
            return StaleEpoch(session_id, epoch, int(current) if current.isdigit() else None)
        if msg.startswith("SESSION_GONE"):
            return SessionGone(f"{session_id}: {msg}")
        return None

    async def apply_batch(
        self, session_id: str, ops: Sequence[BatchOp], *, epoch: int = 0, expires_at: float
    ) -> int:
        """Apply buffered ops atomically (fenced by ``epoch`` > 0); returns the durable event seq.

        One EVALSHA per :data:`MAX_OPS_PER_CALL` ops; refreshes every key's TTL and
        ``last_active``. Idempotent: a retried batch skips events already stored.
        """
        top = 0
        for keys, args in self._apply_calls(session_id, ops, epoch, expires_at, self.clock()):
            try:
                async with redis_errors():
                    top = int(await self._apply(keys=keys, args=args))
            except ResponseError as exc:
                fenced = self._fence_error(session_id, epoch, exc)
                if fenced is None:
                    raise
                raise fenced from exc
        return top

    async def apply_batches(self, batches: Sequence[SessionBatch]) -> list[int | StoreError]:
        """:meth:`apply_batch` for many sessions in ONE pipelined round trip (the writer hub's tick).

        Results are in the order of ``batches``: the session's durable event seq, or the
        error for that session alone: :class:`StaleEpoch` / :class:`SessionGone` (fatal for
        its writer), or :class:`StoreUnavailable` for any other error reply (OOM, READONLY,
        BUSY...: the ops stay queued and are retried). Other sessions in the call are
        unaffected: each EVALSHA is atomic on its own and the pipeline is not a transaction.
        A transport failure raises :class:`StoreUnavailable` for the whole call; every batch
        is then safe to retry (the script is idempotent).

        Scripts are called by SHA without redis-py's per-pipeline ``SCRIPT EXISTS`` (which
        would double the round trips): a NOSCRIPT reply (Redis restarted or flushed its
        scripts) loads the script and re-runs just the calls that bounced, in their order.
        When a session needs several chunks their order matters (events are skipped below
        the stored seq), so such a pipeline starts with a ``SCRIPT LOAD``: a NOSCRIPT can
        then only come from a flush in mid-pipeline, which bounces a suffix of the chunks.
        """
        if not batches:
            return []
        now = self.clock()
        per_batch = [self._apply_calls(b.session_id, b.ops, b.epoch, b.expires_at, now) for b in batches]
        calls = [call for batch_calls in per_batch for call in batch_calls]
        async with redis_errors():
            replies = await self._evalsha_pipeline(calls, load_first=len(calls) > len(batches))
            bounced = [j for j, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if bounced:
                self._apply.sha = await self.redis.script_load(self._apply.script)
                again = await self._evalsha_pipeline([calls[j] for j in bounced], load_first=False)
                for j, reply in zip(bounced, again, strict=True):
                    replies[j] = reply
        results: list[int | StoreError] = []
        first = 0
        for b, batch_calls in zip(batches, per_batch, strict=True):
            result: int | StoreError = 0
            for reply in replies[first : first + len(batch_calls)]:
                if isinstance(reply, ResponseError):  # the session's first failing chunk says why
                    result = self._fence_error(b.session_id, b.epoch, reply) or StoreUnavailable(
                        f"{b.session_id}: {reply}"
                    )
                    break
                result = int(reply)
            first += len(batch_calls)
            results.append(result)
        return results

    async def _evalsha_pipeline(
        self, calls: Sequence[tuple[list[str], list[str | int]]], *, load_first: bool
    ) -> list[Any]:
        """One round trip: every call as an EVALSHA of the apply script; error replies in place."""
        pipe = self.redis.pipeline(transaction=False)
        if load_first:
            pipe.script_load(self._apply.script)
        for keys, args in calls:
            pipe.evalsha(self._apply.sha, len(keys), *keys, *args)
        replies = list(await pipe.execute(raise_on_error=False))
        return replies[1:] if load_first else replies

    async def touch(self, session_id: str, *, epoch: int = 0, expires_at: float) -> int:
        return await self.apply_batch(session_id, (), epoch=epoch, expires_at=expires_at)

    async def delete_session(self, session_id: str) -> bool:
        """Remove every key of the session (end, expiry, DELETE /v1/sessions/{id})."""
        async with redis_errors():
            return bool(await self.redis.delete(*self.keys(session_id).all()))

    async def ttl_ms(self, session_id: str) -> int:
        """Remaining PTTL of the session's meta key (-2 gone, -1 no TTL)."""
        async with redis_errors():
            return int(await self.redis.pttl(self.keys(session_id).meta))
