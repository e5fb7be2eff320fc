"""Event ids of logged server events, and how they map to stream entries.

The store owns the ``event_id`` of every client-visible server event: the session's writer
stamps ``event_<tag>_<epoch>_<seq>`` where ``tag`` is 8 characters of the session id, ``epoch``
the binding epoch of the writing replica (0 when unfenced) and ``seq`` a per-session counter
that increases by one per event. The event is stored in the session's stream under the
explicit entry id ``0-<seq>``, so resolving a client's ``last_event_id`` is arithmetic, with no
index to keep: ``XRANGE events 0-<seq> +``. The first entry must carry exactly that event id
(a different epoch at the same seq means the id was never made durable, e.g. it was lost with a
dead replica) and the following seqs must be contiguous (no gap).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from session import json_text

EVENT_PREFIX = "event_"


def event_text(event: dict[str, Any]) -> str:
    """The compact JSON text of a server event: the logged text of a `StampedEvent` (no second
    serialization), else a fresh one."""
    wire = event.wire if isinstance(event, StampedEvent) else None
    return wire or json_text.dumps(event)


class StampedEvent(dict[str, Any]):
    """A logged server event and its compact JSON text (``wire``), the one the log stored, so
    a transport sends it without serializing the event a second time (``None``: not known)."""

    __slots__ = ("wire",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wire: str | None = None


def split_events(array_text: str) -> list[StampedEvent]:
    """Parse a JSON array of event objects, keeping each element's own text as its ``wire``."""
    decoder = json.JSONDecoder()
    out: list[StampedEvent] = []
    i, end = array_text.index("[") + 1, len(array_text)
    while i < end:
        c = array_text[i]
        if c in ", \n\t\r":
            i += 1
            continue
        if c == "]":
            break
        obj, j = decoder.raw_decode(array_text, i)
        event = StampedEvent(obj)
        event.wire = array_text[i:j]
        out.append(event)
        i = j
    return out


def session_tag(session_id: str) -> str:
    body = session_id.split("_", 1)[-1]
    return body[:8]


@dataclass(frozen=True, slots=True)
class EventRef:
    tag: str
    epoch: int
    seq: int

    @property
    def stream_id(self) -> str:
        return f"0-{self.seq}"


def format_event_id(tag: str, epoch: int, seq: int) -> str:
    return f"{EVENT_PREFIX}{tag}_{epoch}_{seq}"


def parse_event_id(event_id: str) -> EventRef | None:
    """The parts of a store-issued event id, or ``None`` if it is not one."""
    if not event_id.startswith(EVENT_PREFIX):
        return None
    tag, sep1, rest = event_id[len(EVENT_PREFIX) :].partition("_")
    epoch_s, sep2, seq_s = rest.partition("_")
    if not (sep1 and sep2 and tag and epoch_s.isdigit() and seq_s.isdigit()):
        return None
    seq = int(seq_s)
    if seq < 1:
        return None
    return EventRef(tag=tag, epoch=int(epoch_s), seq=seq)


def seq_of_stream_id(stream_id: str) -> int:
    return int(stream_id.partition("-")[2])
