"""glibc's large-block policy for the server process: blocks of 128 KiB and more always mmapped.

Why: glibc's mmap threshold starts at 128 KiB and, by default, rises to the size of every
mmapped block that is freed (up to 32 MiB), and the trim threshold with it. After one large
transient object (a 1.9 MB frame parsed, a response echoing megabytes of history, a replayed
log) every later block of that size comes from the heap, and freeing it returns nothing to the
system: the process keeps its high-water mark. An abusive session can so leave tens of MB of RSS
behind that no budget counts (docs/benchmarks.md, issue 33: a lone slow fuzzer at 92-109 MB of
server + Redis RSS with the dynamic threshold, 51-57 MB with it fixed). Fixing the threshold
(``mallopt(M_MMAP_THRESHOLD)``, which also stops the trim threshold from moving) gives such
blocks back when they are freed. The cost is an mmap/munmap and the page faults per large block,
and models that run in the process pay it on every step: qwen3-omni-tiny at 8 requests ran
~30-50 % slower (RTF 0.48-0.54 -> 0.63-0.78), so ``serve`` leaves it off unless
``--malloc-mmap-threshold`` asks (a server whose stages run in worker processes or on stage
hosts loses nothing by it). Measured in docs/benchmarks.md (issue 33).

``MALLOC_MMAP_THRESHOLD_`` in the environment wins (glibc applied it at start); another libc,
or ``threshold_bytes == 0``, leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
DEFAULT_THRESHOLD_BYTES = 128 << 10
MAX_THRESHOLD_BYTES = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)


def fix_mmap_threshold(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes``; True when it was set here."""
    if not 0 <= threshold_bytes <= MAX_THRESHOLD_BYTES:
        raise ValueError(
            f"mmap threshold must be 1..{MAX_THRESHOLD_BYTES} bytes (0: leave it), got {threshold_bytes}"
        )
    if threshold_bytes == 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold_bytes) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold_bytes)
        return False
    return True
