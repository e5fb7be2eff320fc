"""Retention: idle TTL, maximum lifetime, disconnect grace.

Two halves:

* pure logic (:class:`RetentionPolicy`, :class:`RetentionTimer`) with the clock passed in, so
  tests run on virtual time. The process uses it to decide when to cancel an in-flight
  response (grace over), when to say ``session_expired`` (lifetime over) and when to drop an
  idle session;
* the Redis side: every key of a session carries a PEXPIRE of
  ``min(idle TTL, time left to the lifetime deadline)``, refreshed by each flush of the
  session's writer (see ``session.store.event_log``). So Redis deletes an abandoned session on
  its own, even when no process is left to do it; :func:`expire_session` deletes one now.

Times are wall-clock seconds (``time.time``) because they are persisted and compared across
processes; deadlines are computed by the caller's clock, never read inside here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

# A session's keys expire with its lifetime (or idle TTL), so a TTL refresh may find them gone
# a moment before the host's own check ends the session: a record gone this close to the
# session's expiry is that expiry (session_expired), not a lost session.
EXPIRY_SLACK_S = 0.5


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    idle_ttl_s: float = 600.0
    max_lifetime_s: float = 3600.0
    disconnect_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.idle_ttl_s, self.max_lifetime_s) <= 0 or self.disconnect_grace_s < 0:
            raise ValueError(f"bad retention policy: {self}")

    def lifetime_deadline(self, created_at: float) -> float:
        return created_at + self.max_lifetime_s

    def key_ttl_ms(self, now: float, expires_at: float) -> int:
        """PEXPIRE for a session's keys after activity at ``now``; ``<= 0`` means delete now."""
        return int(min(self.idle_ttl_s, expires_at - now) * 1000)


class Verdict(enum.Enum):
    ACTIVE = "active"  # connected (or detached within grace) and within every limit
    DETACHED = "detached"  # socket gone, still within the disconnect grace
    GRACE_EXPIRED = "grace_expired"  # socket gone past the grace: cancel in-flight work, keep resumable
    IDLE_EXPIRED = "idle_expired"  # no activity for the idle TTL: delete
    LIFETIME_EXPIRED = "lifetime_expired"  # past max lifetime: session_expired, delete

    @property
    def terminal(self) -> bool:
        return self in (Verdict.IDLE_EXPIRED, Verdict.LIFETIME_EXPIRED)


class RetentionTimer:
    """The retention state of one session in this process. No I/O, no clock of its own."""

    def __init__(
        self, policy: RetentionPolicy, *, created_at: float, now: float, expires_at: float | None = None
    ) -> None:
        self.policy = policy
        self.created_at = created_at
        self.expires_at = policy.lifetime_deadline(created_at) if expires_at is None else expires_at
        self.last_active = now
        self.disconnected_at: float | None = None

    @property
    def connected(self) -> bool:
        return self.disconnected_at is None

    def on_activity(self, now: float) -> None:
        self.last_active = max(self.last_active, now)

    def on_disconnect(self, now: float) -> None:
        self.on_activity(now)
        if self.disconnected_at is None:
            self.disconnected_at = now

    def on_reconnect(self, now: float) -> None:
        self.on_activity(now)
        self.disconnected_at = None

    def check(self, now: float) -> Verdict:
        """The verdict at ``now``; idempotent (the caller acts on changes)."""
        if now >= self.expires_at:
            return Verdict.LIFETIME_EXPIRED
        if now - self.last_active >= self.policy.idle_ttl_s:
            return Verdict.IDLE_EXPIRED
        if self.disconnected_at is not None:
            if now - self.disconnected_at >= self.policy.disconnect_grace_s:
                return Verdict.GRACE_EXPIRED
            return Verdict.DETACHED
        return Verdict.ACTIVE

    def next_deadline(self, now: float) -> float:
        """When :meth:`check` may next change its answer (for the driver's single timer)."""
        candidates = [self.expires_at, self.last_active + self.policy.idle_ttl_s]
        if self.disconnected_at is not None:
            grace_end = self.disconnected_at + self.policy.disconnect_grace_s
            if grace_end > now:
                candidates.append(grace_end)
        return max(now, min(candidates))

    def key_ttl_ms(self, now: float) -> int:
        return self.policy.key_ttl_ms(now, self.expires_at)


class SessionDeleter(Protocol):
    """A store that deletes a session's keys (:class:`session.store.SessionStore`)."""

    async def delete_session(self, session_id: str) -> bool: ...


async def expire_session(store: SessionDeleter, session_id: str) -> bool:
    """Delete every key of a session now (expired or ended). True if anything was deleted."""
    return await store.delete_session(session_id)
