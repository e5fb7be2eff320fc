"""`conversation.item.retrieved` is logged as a reference to its item, and a replay rebuilds it.

A retrieve costs the client a few bytes and the server a copy of the whole item (up to the
2 MiB frame limit, audio included). Logged in full, each reply was copied into the session's
Redis stream: 40 retrieves of a 1.9 MB item grew the server and Redis by ~110 MB each before
the log's byte bound trimmed them (docs/benchmarks.md). So the session's log keeps
``{"type": "conversation.item.retrieved", "event_id": ..., "item_ref": "<item id>"}`` instead
(:func:`logged_form`, given to the writer's ``append``), and a resume's replay turns each such
reference back into the event, one at a time as the link sends it (:func:`rebuilt`): the
item as the session's conversation has it *then* (a change since, e.g. a truncate or audio
past the retention, shows; a restored session's items have no audio), under the same
``event_id``; an item deleted since is replayed as the ``error`` a retrieve of it gets now
(``item_not_found``), in the same place. The client that reads sees the event sent live as
before; nothing a retrieve returns is kept after it is sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from session.realtime.core import RealtimeSessionCore
from session.realtime.errors import ProtocolError
from session.store.event_ids import StampedEvent

RETRIEVED = "conversation.item.retrieved"
REF_KEY = "item_ref"


def logged_form(event: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the log keeps of ``event`` when not the event itself (None: the event)."""
    if event.get("type") != RETRIEVED:
        return None
    item = event.get("item")
    item_id = item.get("id") if isinstance(item, Mapping) else None
    return {"type": RETRIEVED, REF_KEY: str(item_id)}


def is_reference(event: Mapping[str, Any]) -> bool:
    return event.get("type") == RETRIEVED and REF_KEY in event and "item" not in event


def rebuilt(events: Iterable[dict[str, Any]], core: RealtimeSessionCore) -> Iterator[dict[str, Any]]:
    """``events`` with each retrieve reference made the event again from ``core``'s
    conversation, lazily: one rebuilt item in memory at a time while a link sends them."""
    for event in events:
        yield _rebuild(event, core) if is_reference(event) else event


def _rebuild(ref: Mapping[str, Any], core: RealtimeSessionCore) -> dict[str, Any]:
    item_id = str(ref[REF_KEY])
    event_id = ref.get("event_id")
    try:
        item = core.conversation.get(item_id)
    except ProtocolError as err:  # deleted since: what a retrieve of it answers now
        error = {"type": err.type, "code": err.code, "message": err.message, "param": err.param}
        return StampedEvent({"type": "error", "event_id": event_id, "error": {**error, "event_id": None}})
    wire = item.to_wire(with_audio=True, input_format=core.config.input_format)
    return StampedEvent({"type": RETRIEVED, "event_id": event_id, "item": wire})
