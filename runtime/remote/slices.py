"""A byte-bounded allocator over one registered buffer (sans-I/O, thread-safe).

First fit over a free list kept sorted by offset; a freed slice merges with its neighbours.
Offsets are aligned to 64 bytes. Every payload a connector holds lives in one slice, so the
pool's size is the bound on what a host keeps for others.
"""

from __future__ import annotations

import bisect
import threading

ALIGN = 64


class PoolFull(MemoryError):
    """No free run of the asked size (the pool is bounded by bytes)."""


class SlicePool:
    def __init__(self, size: int) -> None:
        if size < ALIGN:
            raise ValueError(f"pool size {size} is below {ALIGN} bytes")
        self.size = size - size % ALIGN
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), by offset
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def slices(self) -> int:
        with self._lock:
            return len(self._used)

    def alloc(self, nbytes: int) -> int:
        """The offset of a fresh slice of at least ``nbytes``; :class:`PoolFull` when none fits."""
        length = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + length, free - length)
                    self._used[offset] = length
                    return offset
            used = sum(self._used.values())
        raise PoolFull(f"pool of {self.size} B has no {length} B free run ({used} B in use)")

    def free(self, offset: int) -> bool:
        """Return a slice; False when ``offset`` is not an allocated slice."""
        with self._lock:
            length = self._used.pop(offset, None)
            if length is None:
                return False
            i = bisect.bisect_left(self._free, (offset, 0))
            start, end = offset, offset + length
            if i < len(self._free) and self._free[i][0] == end:  # merge with the next run
                end += self._free[i][1]
                del self._free[i]
            if i > 0 and sum(self._free[i - 1]) == start:  # and with the previous one
                start = self._free[i - 1][0]
                del self._free[i - 1]
                i -= 1
            self._free.insert(i, (start, end - start))
            return True
