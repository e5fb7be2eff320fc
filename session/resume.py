"""The resume protocol's own events and ids (our extensions; stock clients ignore `omni.*`).

Connection events (`omni.session.resumable`, `omni.session.resumed`, `omni.session.snapshot`,
`omni.admission.queued`) belong to one connection, not to the session: they are not logged
and never replayed. Their `event_id` is the id of the logged event before them plus
``:omni:<random>``, so a client that resumes from the last id it saw (whatever its type)
resumes from that logged event (:func:`logged_event_id`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from session.realtime.ids import random_id
from session.store.event_ids import parse_event_id

OMNI_MARK = ":omni:"


def connection_event(type: str, after: str | None, **fields: Any) -> dict[str, Any]:
    """A connection event placed after the logged event `after` (None: before any)."""
    event_id = f"{after}{OMNI_MARK}{secrets.token_hex(4)}" if after else random_id("event")
    return {"type": type, "event_id": event_id, **fields}


def logged_event_id(event_id: str | None) -> str | None:
    """The logged event a client's `last_event_id` stands for (see module doc)."""
    if not event_id:
        return None
    return event_id.split(OMNI_MARK, 1)[0]


def event_position(event_id: str | None) -> tuple[int, int]:
    """Where a session event id is in the session's order (``EventRef.position``); (0, 0)
    for anything else."""
    ref = parse_event_id(event_id) if event_id else None
    return ref.position if ref is not None else (0, 0)


def replayed_through(position: tuple[int, int]) -> Callable[[dict[str, Any]], bool]:
    """A `TransportLink.release(skip=...)` predicate: events the replay already carried."""

    def skip(event: dict[str, Any]) -> bool:
        return event_position(str(event.get("event_id", ""))) <= position

    return skip
