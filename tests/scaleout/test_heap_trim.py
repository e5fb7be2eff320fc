"""The server's heap trimmer (runtime/heap_trim.py): free pages that glibc keeps inside its
heaps (below live blocks, after its mmap threshold rose) go back to the system from the
trimmer's own thread while the rest of the process goes on, and only when enough is free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.heap_trim import HeapTrimmer

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]

# 40 blocks of 1 MiB after an 8 MiB block was freed (glibc's mmap threshold rose: they come from
# the heap), each followed by a live 4 KiB block, so freeing them leaves 40 holes below live
# blocks that glibc's own top-of-heap trim cannot give back. Then the trimmer runs while the main
# thread only sleeps; prints what RSS kept of the 40 MiB, and how many trims ran.
PROBE = """
import sys, time
from runtime.heap_trim import HeapTrimmer
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
big = bytearray(8 << 20); del big
base = rss()
blocks, pins = [], []
for _ in range(40):
    blocks.append(bytearray(1 << 20))
    pins.append(bytearray(4096))
del blocks
trimmer = HeapTrimmer(interval_s=0.05, min_free_bytes=int(sys.argv[1]))
assert trimmer.start()
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline and not trimmer.trims:
    time.sleep(0.05)
time.sleep(0.2)
trimmer.stop()
print(rss() - base, trimmer.trims)
"""


def _kept(min_free_bytes: int) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(min_free_bytes)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    kept, trims = out.stdout.split()
    return int(kept), int(trims)


def test_free_heap_pages_go_back_from_the_trimmers_thread() -> None:
    kept, trims = _kept(16 << 20)
    assert trims >= 1
    assert kept < 4 << 20, f"expected the 40 MiB freed below a live block back, kept {kept >> 20} MiB"


def test_nothing_is_trimmed_while_less_than_the_minimum_is_free() -> None:
    kept, trims = _kept(1 << 30)
    assert trims == 0
    assert kept > 30 << 20, f"expected the 40 MiB kept without a trim, kept {kept >> 20} MiB"


def test_a_trimmer_with_no_interval_does_not_start() -> None:
    trimmer = HeapTrimmer(interval_s=0)
    assert not trimmer.start()
    trimmer.stop()
    assert trimmer.trims == 0
