"""Events a session's writer keeps in this process for a resume here (audio deltas), compactly.

An audio delta is ~2.7 KB of JSON of which ~2.6 KB is the base64 of its PCM. Kept as that
text, 200 sessions held ~290 MB (docs/benchmarks.md). :class:`HeldEvents` keeps the decoded
bytes instead (3/4 of the base64) and the JSON around them once per run of alike events (a
:class:`_Shape`: the same response, item and indices; the event id's position is the only
part that changes from one delta to the next, and it is rebuilt from the event's place).
:meth:`HeldEvents.merge` rebuilds each event's text for a replay; it equals, byte for byte,
the text that was sent: a shape is cut from the event's own text at hold time, and an event
whose delta is not canonical base64 (or whose text cannot be cut so) is kept as its text.

Bounds, oldest out first: ``max_bytes`` of what is held (the payloads plus each shape's text
once, see :attr:`HeldEvents.nbytes`), and while the session is connected none older than
``window_s``; once detached (:meth:`HeldEvents.set_detached`), none made more than
``window_s`` before it went. Sans-I/O, synchronous.
"""

from __future__ import annotations

import binascii
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import pybase64

from session import json_text
from session.store.event_ids import StampedEvent, format_held_event_id


class _Shape(NamedTuple):
    """An event's text less its payload and its position: ``head + A + mid + B + tail``,
    where (A, B) is (payload, position) when ``payload_first``, else (position, payload)."""

    head: str
    mid: str
    tail: str
    payload_first: bool

    @property
    def nbytes(self) -> int:
        return len(self.head) + len(self.mid) + len(self.tail)

    def text(self, payload: str, position: str) -> str:
        if self.payload_first:
            return f"{self.head}{payload}{self.mid}{position}{self.tail}"
        return f"{self.head}{position}{self.mid}{payload}{self.tail}"


_DELTA_KEY = '"delta":"'
_ID_KEY = '"event_id":"'


def _cut(wire: str, delta: str, event_id: str, position: str) -> _Shape | None:
    """The shape of ``wire`` around its ``delta`` value and the ``position`` that ends its
    event id, or None when either is not where its key is. Exact by construction: the two
    spans hold ``delta`` and ``position``, and the shape is the text around them."""
    d = wire.rfind(_DELTA_KEY)  # the last key in the core's events: found at once
    e = wire.find(_ID_KEY)
    if d < 0 or e < 0:
        return None
    d_start = d + len(_DELTA_KEY)
    d_end = d_start + len(delta)
    p_end = e + len(_ID_KEY) + len(event_id)
    p_start = p_end - len(position)
    if not (
        wire.startswith(delta, d_start)
        and wire.startswith(f'{event_id}"', p_end - len(event_id))
        and wire.startswith('"', d_end)
    ):
        return None  # a key inside another value, or escaped text: keep the text itself
    if d_end <= p_start:
        return _Shape(wire[:d_start], wire[d_end:p_start], wire[p_end:], True)
    if p_end <= d_start:
        return _Shape(wire[:p_start], wire[p_end:d_start], wire[d_end:], False)
    return None


def _pcm(delta: Any) -> bytes | None:
    """The bytes of a canonical base64 ``delta`` (one that re-encodes to itself), else None."""
    if not isinstance(delta, str) or not delta or not delta.isascii():
        return None
    try:
        data = pybase64.b64decode(delta, validate=True)
    except (binascii.Error, ValueError):
        return None
    return data if pybase64.b64encode(data) == delta.encode("ascii") else None


class HeldEvents:
    """The held events of one writer, oldest first, with their positions ``(seq, n)``: ``seq``
    the logged event each follows, ``n`` this object's own counter (contiguous from
    :attr:`first`). Parallel deques, no tuple per event (see the writer's ``_log_sizes``)."""

    def __init__(
        self, *, max_bytes: int = 0, window_s: float = 0.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_bytes = max_bytes
        self._window_s = window_s
        self._clock = clock
        self._payloads: deque[bytes | str] = deque()  # PCM bytes, or the whole text (no shape)
        self._shapes: deque[_Shape | None] = deque()
        self._seqs: deque[int] = deque()
        self._times: deque[float] = deque()
        self._last_shape: _Shape | None = None
        self.first = 1  # n of the oldest kept
        self.next = 1  # n of the next one
        self.nbytes = 0
        self.dropped = 0  # how many left past a bound
        self.dropped_position = (0, 0)  # the position of the newest one dropped
        self._detached_at: float | None = None

    def __len__(self) -> int:
        return len(self._payloads)

    def set_detached(self, detached: bool) -> None:
        """Detached: the age bound counts from now until attached again (see the module doc)."""
        if not detached:
            self._detached_at = None
        elif self._detached_at is None:
            self._detached_at = self._clock()

    def hold(self, event: Mapping[str, Any], *, tag: str, epoch: int, seq: int) -> StampedEvent:
        """Stamp ``event`` as the next held event after the logged ``seq``, keep it, return it
        (with its text, to send)."""
        n = self.next
        self.next += 1
        stamped = StampedEvent(event)
        event_id = format_held_event_id(tag, epoch, seq, n)
        stamped["event_id"] = event_id
        stamped.wire = wire = json_text.dumps(stamped)
        payload: bytes | str = wire
        pcm = _pcm(stamped.get("delta"))
        shape = None if pcm is None else _cut(wire, str(stamped["delta"]), event_id, f"{seq}.{n}")
        if pcm is not None and shape is not None:
            payload = pcm
            if shape == self._last_shape:
                shape = self._last_shape  # one object (and one count) for the run
            else:
                self._last_shape = shape
                self.nbytes += shape.nbytes
        else:  # kept as its text; a run of one shape is contiguous (see _bound)
            self._last_shape = None
        if not self._payloads:
            self.first = n
        self._payloads.append(payload)
        self._shapes.append(shape)
        self._seqs.append(seq)
        now = self._clock()
        self._times.append(now)
        self.nbytes += len(payload)
        self._bound(now)
        return stamped

    def _bound(self, now: float) -> None:
        oldest = (now if self._detached_at is None else self._detached_at) - self._window_s
        times = self._times
        while len(times) > 1 and (
            (self._max_bytes and self.nbytes > self._max_bytes) or (self._window_s and times[0] < oldest)
        ):
            shape = self._shapes.popleft()
            self.nbytes -= len(self._payloads.popleft())
            if shape is not None and (not self._shapes or self._shapes[0] is not shape):
                self.nbytes -= shape.nbytes  # its last event left
                if shape is self._last_shape:
                    self._last_shape = None
            times.popleft()
            self.dropped_position = (self._seqs.popleft(), self.first)
            self.first += 1
            self.dropped += 1

    def merge(
        self,
        logged: list[dict[str, Any]],
        after: tuple[int, int],
        through: int,
        logged_seq: Callable[[Mapping[str, Any]], int],
    ) -> list[dict[str, Any]]:
        """``logged`` (the logged events after ``after``, in order) with the held events after
        ``after`` put in place, those following a logged seq up to ``through`` (a later one's
        reach the client live)."""
        events: list[dict[str, Any]] = []
        i = 0
        n = self.first
        for payload, shape, seq in zip(self._payloads, self._shapes, self._seqs, strict=True):
            if seq > through:
                break
            if (seq, n) > after:
                while i < len(logged) and logged_seq(logged[i]) <= seq:
                    events.append(logged[i])
                    i += 1
                events.append(_rebuilt(payload, shape, seq, n))
            n += 1
        events.extend(logged[i:])
        return events


def _rebuilt(payload: bytes | str, shape: _Shape | None, seq: int, n: int) -> StampedEvent:
    if shape is None:
        assert isinstance(payload, str)
        wire = payload
    else:
        assert isinstance(payload, bytes)
        wire = shape.text(pybase64.b64encode(payload).decode("ascii"), f"{seq}.{n}")
    event = StampedEvent(json_text.loads(wire))
    event.wire = wire
    return event
