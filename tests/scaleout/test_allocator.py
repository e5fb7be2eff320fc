"""The server's glibc large-block policy (web/deploy/allocator.py): blocks of 128 KiB and more go
back to the system when freed, even after a larger block has been freed first (which, with the
allocator's own rising threshold, keeps later blocks of that size on the heap for good)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from web.deploy.allocator import MAX_THRESHOLD_BYTES, fix_mmap_threshold

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]

# 40 blocks of 1 MiB after an 8 MiB block was freed, a small object pinned above them so the
# heap's top cannot be trimmed; prints what RSS kept after they are all freed.
PROBE = """
import sys
from web.deploy.allocator import fix_mmap_threshold
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
fix_mmap_threshold(int(sys.argv[1]))
big = bytearray(8 << 20); del big
base = rss()
blocks = [bytearray(1 << 20) for _ in range(40)]
pin = [bytearray(64) for _ in range(1000)]
del blocks
print(rss() - base)
"""


def _kept_after_free(threshold: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threshold)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def test_fixed_threshold_gives_large_blocks_back_when_freed() -> None:
    rising = _kept_after_free(0)  # the allocator's own policy
    fixed = _kept_after_free(128 << 10)
    assert rising > 30 << 20, f"expected the rising threshold to keep the 40 MiB, kept {rising >> 20} MiB"
    assert fixed < 4 << 20, f"expected the fixed threshold to give the 40 MiB back, kept {fixed >> 20} MiB"


def test_out_of_range_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="mmap threshold"):
        fix_mmap_threshold(-1)
    with pytest.raises(ValueError, match="mmap threshold"):
        fix_mmap_threshold(MAX_THRESHOLD_BYTES + 1)


def test_serve_refuses_a_bad_threshold_with_a_clear_error() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "web.cli", "serve", "--malloc-mmap-threshold", "-5", "--port", "0"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "--malloc-mmap-threshold" in out.stderr and "mmap threshold must be" in out.stderr
