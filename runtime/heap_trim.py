"""Free heap pages given back to the system while the server runs: glibc's ``malloc_trim(0)``
from a daemon thread, when its arenas hold at least ``min_free_bytes`` free.

Why: glibc gives freed memory back only from the top of each arena's heap (and mmapped blocks,
which after the first large free are only those over a threshold that rises to 32 MiB). Memory
freed below a live block stays resident: after a session that sent megabyte frames, got
megabyte replies and went away, the process keeps its high-water mark (issue 33: a lone slow
fuzzer left ~30 MB of free heap resident, ``mallinfo2().fordblks``, that no budget counts).
``malloc_trim(0)`` walks every arena and releases the whole free pages inside the heaps too
(``MADV_DONTNEED``), so the resident size follows what is live.

Unlike a fixed mmap threshold (web/deploy/allocator.py), which costs an mmap, a munmap and the
page faults on every large block (in-process models ran 30-50 % slower with it), this costs one
pass over the arenas per ``interval_s`` at most, and only while that much is free: a model that
frees and reallocates its per-step tensors faults their pages in again at most once per
interval. It runs in its own thread (``malloc_trim`` and ``mallinfo2`` are C calls that release
the GIL), never on the event loop; it does hold each arena's lock while it trims that arena.
Measured in docs/benchmarks.md (issue 33): not slower for qwen3-omni-tiny at 8 requests, but at
200 null-pipeline sessions the event loop waited on the main arena's lock during the trims (loop
lag p99 33 ms against 8, 205 playout underruns against 0), so ``serve`` leaves it off unless
``--malloc-trim-interval-s`` asks. Another libc: nothing to do, :meth:`HeapTrimmer.start`
says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_MIN_FREE_BYTES = 16 << 20


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


@dataclass
class HeapTrimmer:
    """Every ``interval_s``: if glibc's arenas hold ``min_free_bytes`` or more free (or always,
    where ``mallinfo2`` is missing), ``malloc_trim(0)``. ``trims`` and ``free_seen_bytes`` count
    what it did (the free bytes it found before each trim)."""

    interval_s: float = DEFAULT_INTERVAL_S
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES
    trims: int = 0
    free_seen_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _libc: ctypes.CDLL | None = field(default_factory=_glibc, repr=False)

    def free_bytes(self) -> int | None:
        """Bytes free inside glibc's arenas now (None: no ``mallinfo2`` here)."""
        libc = self._libc
        if libc is None or not hasattr(libc, "mallinfo2"):
            return None
        mallinfo2 = libc.mallinfo2
        mallinfo2.restype = _MallInfo2
        return int(mallinfo2().fordblks)

    def check(self) -> bool:
        """One pass: trim if enough is free; True when it trimmed."""
        if self._libc is None:
            return False
        free = self.free_bytes()
        if free is not None and free < self.min_free_bytes:
            return False
        self._libc.malloc_trim(0)
        self.trims += 1
        self.free_seen_bytes += free or 0
        return True

    def start(self) -> bool:
        """Start the thread; False (nothing started) without glibc or with ``interval_s <= 0``."""
        if self._libc is None or self.interval_s <= 0 or self._thread is not None:
            return False
        self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let the thread die silently with the heap growing
                log.exception("malloc_trim failed; heap trimming stops")
                return
