"""The bounds a session writer keeps: what its store allows (:class:`WriterLimits`, typed, set by
the store) and the event stream's byte budget (:class:`LogBudget`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WriterLimits:
    """A store's bounds for each session's writer (0: none): the stream's bytes and entries,
    the event types kept in process instead of logged, and their byte and age bounds."""

    log_max_bytes: int = 0
    stream_maxlen: int = 0
    held_event_types: frozenset[str] = frozenset()
    held_max_bytes: int = 0
    held_window_s: float = 0.0


class LogBudget:
    """The stream holds at most ``max_bytes`` of events: past it, the oldest are trimmed (a
    resume from before them gets the snapshot, ``trimmed``). Entries a previous process wrote
    (a restored session) are not counted; the first trim (``MINID``) removes them with the rest,
    and until then they are bounded by that process's own budget."""

    __slots__ = ("first", "max_bytes", "maxlen", "nbytes", "sizes")

    def __init__(self, max_bytes: int, maxlen: int) -> None:
        self.max_bytes = max_bytes
        self.maxlen = maxlen  # the stream's MAXLEN: entries past it are gone already
        # Bytes of each event in the stream, oldest first, from seq ``first`` on (seqs are
        # contiguous). Plain ints, not (seq, size) tuples: a tuple per event was the largest
        # source of young GC-tracked objects, i.e. of the collections that stop the loop.
        self.sizes: deque[int] = deque()
        self.first = 0
        self.nbytes = 0

    def add(self, seq: int, size: int) -> int:
        """Count event ``seq`` of ``size`` bytes; the seq to trim the stream to (0: none)."""
        sizes = self.sizes
        if not sizes:
            self.first = seq
        sizes.append(size)
        self.nbytes += size
        while self.maxlen and len(sizes) > self.maxlen:  # gone by MAXLEN already
            self.nbytes -= sizes.popleft()
            self.first += 1
        trim_to = 0
        while self.max_bytes and self.nbytes > self.max_bytes and len(sizes) > 1:
            self.nbytes -= sizes.popleft()
            self.first += 1
            trim_to = self.first
        return trim_to
