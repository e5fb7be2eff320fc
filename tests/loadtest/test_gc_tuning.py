"""The server's cyclic-GC settings (see `web.server.context.GC_THRESHOLDS` for the measurement)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.live_server import live_server
from web.server.context import GC_THRESHOLDS

pytestmark = pytest.mark.system


def test_server_freezes_startup_objects_and_bounds_what_a_collection_scans(tmp_path: Path) -> None:
    previous = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        with live_server(tmp_path, pipeline="null"):
            assert gc.get_threshold() == GC_THRESHOLDS
            young, middle, old = GC_THRESHOLDS
            assert young > 700  # fewer young collections than Python's default
            # a generation-1 collection scans at most young × (middle + 1) survivors: no
            # ~200 ms stop when the conversations' items pile up in it (docs/benchmarks.md)
            assert young * (middle + 1) <= 25_000
            assert young * (middle + 1) * (old + 1) >= 2_000_000  # full collections stay rare
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*previous)
