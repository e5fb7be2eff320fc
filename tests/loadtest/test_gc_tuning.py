"""The server's cyclic-GC settings (see `web.context.GC_THRESHOLDS` for the measurement)."""

from __future__ import annotations

import gc
from pathlib import Path

from tests.live_server import live_server
from web.context import GC_THRESHOLDS


def test_server_freezes_startup_objects_and_raises_the_young_gc_threshold(tmp_path: Path) -> None:
    previous = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        with live_server(tmp_path, pipeline="null"):
            assert gc.get_threshold() == GC_THRESHOLDS
            assert GC_THRESHOLDS[0] >= 10_000
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*previous)
