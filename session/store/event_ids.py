"""Event ids of logged server events, and how they map to stream entries.

The store owns the ``event_id`` of every client-visible server event: the session's writer
stamps ``event_<tag>_<epoch>_<seq>`` where ``tag`` is 8 characters of the session id, ``epoch``
the binding epoch of the writing replica (0 when unfenced) and ``seq`` a per-session counter
that increases by one per event. The event is stored in the session's stream under the
explicit entry id ``0-<seq>``, so resolving a client's ``last_event_id`` is arithmetic, with no
index to keep: ``XRANGE events 0-<seq> +``. The first entry must carry exactly that event id
(a different epoch at the same seq means the id was never made durable, e.g. it was lost with a
dead replica) and the following seqs must be contiguous (no gap).

Events the process keeps itself and does not write to Redis (audio deltas, see
:class:`session.store.event_log.SessionWriter`) carry ``event_<tag>_<epoch>_<seq>.<n>``: ``seq``
is the logged event they follow and ``n`` the writer's own counter of such events (+1 each).
Their place in the session's order is ``(seq, n)``, a logged event's is ``(seq, 0)``
(:attr:`EventRef.position`), so one comparison orders both kinds and a replay resolves such
an id through the logged event it follows.
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
    seq: int  # the logged event's seq; for an event kept in process, the logged one before it
    held: int = 0  # > 0: an event kept in process, the writer's n-th

    @property
    def stream_id(self) -> str:
        return f"0-{self.seq}"

    @property
    def position(self) -> tuple[int, int]:
        """Where the event is in the session's order (see the module doc)."""
        return (self.seq, self.held)

    @property
    def logged_id(self) -> str | None:
        """The id of the logged event at or before this one (``None``: before any)."""
        return format_event_id(self.tag, self.epoch, self.seq) if self.seq else None


def format_event_id(tag: str, epoch: int, seq: int) -> str:
    return f"{EVENT_PREFIX}{tag}_{epoch}_{seq}"


def format_held_event_id(tag: str, epoch: int, seq: int, held: int) -> str:
    """The id of the ``held``-th event kept in process, after the logged event ``seq``."""
    return f"{EVENT_PREFIX}{tag}_{epoch}_{seq}.{held}"


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes "²", which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def parse_event_id(event_id: str) -> EventRef | None:
    """The parts of a store-issued event id, or ``None`` if it is not one."""
    if not event_id.startswith(EVENT_PREFIX):
        return None
    tag, sep1, rest = event_id[len(EVENT_PREFIX) :].partition("_")
    epoch_s, sep2, position = rest.partition("_")
    seq_s, dot, held_s = position.partition(".")
    if not (sep1 and sep2 and tag and _digits(epoch_s) and _digits(seq_s)):
        return None
    if dot and not _digits(held_s):
        return None
    seq, held = int(seq_s), int(held_s) if dot else 0
    if (seq < 1 and not held) or (dot and held < 1):
        return None
    return EventRef(tag=tag, epoch=int(epoch_s), seq=seq, held=held)


def seq_of_stream_id(stream_id: str) -> int:
    return int(stream_id.partition("-")[2])
