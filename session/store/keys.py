"""Redis key names.

Every key of one session carries the hash tag ``{sess_…}`` so that Redis Cluster puts them in
one slot and the Lua scripts that touch several of them stay legal. Cross-session structures
use their own fixed tags: admission ``{omni:adm}``, the replica registry ``{omni:replicas}``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "omni"


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """The keys of one session."""

    meta: str  # hash: tenant, state, config JSON, created_at, last_active, expires_at, event_seq, ...
    events: str  # stream of client-visible server events, entry id 0-<seq>
    items: str  # hash: item_id -> item JSON
    order: str  # list: item ids in conversation order
    owner: str  # hash: replica, epoch (the binding, see session.affinity)

    def all(self) -> tuple[str, str, str, str, str]:
        return (self.meta, self.events, self.items, self.order, self.owner)


def session_keys(session_id: str, prefix: str = DEFAULT_PREFIX) -> SessionKeys:
    if "{" in session_id or "}" in session_id:
        raise ValueError(f"session id must not contain braces: {session_id!r}")
    base = f"{prefix}:{{{session_id}}}"
    return SessionKeys(
        meta=f"{base}:meta",
        events=f"{base}:events",
        items=f"{base}:items",
        order=f"{base}:order",
        owner=f"{base}:owner",
    )
