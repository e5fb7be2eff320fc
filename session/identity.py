"""Identity: session ids, API keys → tenants, resume tokens, ephemeral client secrets.

Pure helpers plus one Redis-backed class (:class:`EphemeralKeys`). Secrets are never stored in
clear: Redis holds the SHA-256 of a resume token or an ephemeral key, and comparisons use
:func:`hmac.compare_digest`. This module imports nothing from ``session.store`` (the store
imports it), so there is no import cycle.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import string
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

_ALPHABET = string.ascii_letters + string.digits
SESSION_PREFIX = "sess_"
EPHEMERAL_PREFIX = "ek_"
RESUME_PREFIX = "rt_"
API_KEYS_ENV = "OMNIDUPLEX_API_KEYS"
API_KEY_SUBPROTOCOL = "openai-insecure-api-key."
RESUME_SUBPROTOCOL = "omni-resume-token."
RESUME_HEADER = "x-omni-resume-token"


def _random(n: int) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def new_session_id() -> str:
    """``sess_`` + 24 alphanumerics (~143 bits); no braces, so it is a valid hash tag."""
    return SESSION_PREFIX + _random(24)


def is_session_id(value: str) -> bool:
    body = value[len(SESSION_PREFIX) :]
    return value.startswith(SESSION_PREFIX) and 8 <= len(body) <= 64 and all(c in _ALPHABET for c in body)


def secret_digest(secret: str) -> str:
    """What Redis stores instead of a secret (resume token, ephemeral key)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_resume_token() -> str:
    return RESUME_PREFIX + secrets.token_urlsafe(32)


def resume_token_matches(token: str | None, stored_digest: str | None) -> bool:
    """Constant-time check of a presented token against the stored digest."""
    if not token or not stored_digest:
        # Still do one comparison so a missing token costs the same as a wrong one.
        hmac.compare_digest("0" * 64, "1" * 64)
        return False
    return hmac.compare_digest(secret_digest(token), stored_digest)


# --- API keys -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiKeyMap:
    """API key → tenant. Keys are held by digest, so lookups do not compare secrets directly."""

    _by_digest: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: Mapping[str, str]) -> ApiKeyMap:
        for key, tenant in pairs.items():
            if not key or not tenant:
                raise ValueError("API keys and tenants must be non-empty")
        return cls({secret_digest(k): t for k, t in pairs.items()})

    @classmethod
    def parse(cls, spec: str) -> ApiKeyMap:
        """``"key1:tenantA,key2:tenantB"`` (whitespace around items is ignored)."""
        pairs: dict[str, str] = {}
        for raw in spec.split(","):
            item = raw.strip()
            if not item:
                continue
            key, sep, tenant = item.rpartition(":")
            if not sep or not key or not tenant:
                raise ValueError(f"bad API key entry (want key:tenant): {item[:4]}…")
            pairs[key] = tenant
        return cls.from_pairs(pairs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApiKeyMap:
        env = os.environ if environ is None else environ
        return cls.parse(env.get(API_KEYS_ENV, ""))

    def tenant_for(self, api_key: str | None) -> str | None:
        if not api_key:
            return None
        return self._by_digest.get(secret_digest(api_key))

    def __len__(self) -> int:
        return len(self._by_digest)


def api_key_from_request(authorization: str | None, subprotocols: Iterable[str] = ()) -> str | None:
    """The key from ``Authorization: Bearer <key>`` or the ``openai-insecure-api-key.<key>`` subprotocol."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    for proto in subprotocols:
        if proto.startswith(API_KEY_SUBPROTOCOL) and len(proto) > len(API_KEY_SUBPROTOCOL):
            return proto[len(API_KEY_SUBPROTOCOL) :]
    return None


def resume_token_from_request(header: str | None, subprotocols: Iterable[str] = ()) -> str | None:
    """The token from ``X-Omni-Resume-Token`` or the ``omni-resume-token.<token>`` subprotocol."""
    if header and header.strip():
        return header.strip()
    for proto in subprotocols:
        if proto.startswith(RESUME_SUBPROTOCOL) and len(proto) > len(RESUME_SUBPROTOCOL):
            return proto[len(RESUME_SUBPROTOCOL) :]
    return None


# --- ephemeral client secrets ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientSecret:
    """What ``POST /v1/realtime/client_secrets`` returns: the value is shown once."""

    value: str
    expires_at: float
    session_config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EphemeralGrant:
    """What a presented ephemeral key resolves to."""

    tenant: str
    session_config: dict[str, Any]
    expires_at: float


class EphemeralKeys:
    """``ek_…`` secrets in Redis under ``<prefix>:ek:<sha256>`` with their own TTL.

    The stored session config is the scope of the key: a session opened with it starts from
    that config (the web layer must not let the client widen it, e.g. change the model).
    """

    def __init__(self, redis: Redis, *, prefix: str = "omni", clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._prefix = prefix
        self._clock = clock

    def _key(self, value: str) -> str:
        return f"{self._prefix}:ek:{secret_digest(value)}"

    async def create(
        self, tenant: str, session_config: Mapping[str, Any] | None = None, *, ttl_s: float = 600.0
    ) -> ClientSecret:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        value = EPHEMERAL_PREFIX + secrets.token_urlsafe(32)
        expires_at = self._clock() + ttl_s
        config = dict(session_config or {})
        doc = json.dumps({"tenant": tenant, "session_config": config, "expires_at": expires_at})
        await self._redis.set(self._key(value), doc, px=max(1, int(ttl_s * 1000)))
        return ClientSecret(value=value, expires_at=expires_at, session_config=config)

    async def resolve(self, value: str | None, *, consume: bool = False) -> EphemeralGrant | None:
        """The grant for a live key, or ``None`` (unknown, expired, not an ``ek_`` key).

        ``consume=True`` makes the key single-use (GETDEL).
        """
        if not value or not value.startswith(EPHEMERAL_PREFIX):
            return None
        key = self._key(value)
        raw = await (self._redis.getdel(key) if consume else self._redis.get(key))
        if raw is None:
            return None
        doc = json.loads(raw)
        return EphemeralGrant(
            tenant=str(doc["tenant"]),
            session_config=dict(doc.get("session_config") or {}),
            expires_at=float(doc["expires_at"]),
        )

    async def revoke(self, value: str) -> bool:
        return bool(await self._redis.delete(self._key(value)))

    # An ``ek_`` key is scoped to the sessions it opened (and their resumes), as OpenAI's
    # client secrets are: a browser holding one cannot GET or DELETE the tenant's other
    # sessions. The set lives as long as the key can authenticate.

    def _sessions_key(self, digest: str) -> str:
        return f"{self._prefix}:ek:{digest}:sessions"

    async def bind_session(self, principal: Principal, session_id: str) -> None:
        """Record that ``principal`` (authenticated by an ``ek_`` key) opened ``session_id``."""
        if principal.ephemeral_key is None:
            return
        key = self._sessions_key(principal.ephemeral_key)
        expires_ms = max(int(principal.ephemeral_expires_at * 1000), int(self._clock() * 1000) + 1)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.sadd(key, session_id)
            pipe.pexpireat(key, expires_ms)
            await pipe.execute()

    async def may_access(self, principal: Principal, session_id: str) -> bool:
        """Whether ``principal`` may see or end ``session_id``: any session of its tenant for an
        API key; for an ``ek_`` key only the sessions it opened."""
        if principal.ephemeral_key is None:
            return True
        return bool(await self._redis.sismember(self._sessions_key(principal.ephemeral_key), session_id))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant, and the scoped config when authenticated by an ephemeral key
    (then also that key's digest and expiry: it is scoped to the sessions it opens)."""

    tenant: str
    scoped_config: dict[str, Any] | None = None
    ephemeral_key: str | None = None
    ephemeral_expires_at: float = 0.0


async def authenticate(
    api_key: str | None, api_keys: ApiKeyMap, ephemeral: EphemeralKeys | None
) -> Principal | None:
    """An API key or a live ephemeral key → :class:`Principal`; ``None`` means 401."""
    tenant = api_keys.tenant_for(api_key)
    if tenant is not None:
        return Principal(tenant)
    if ephemeral is not None and api_key and api_key.startswith(EPHEMERAL_PREFIX):
        grant = await ephemeral.resolve(api_key)
        if grant is not None:
            return Principal(grant.tenant, grant.session_config, secret_digest(api_key), grant.expires_at)
    return None
