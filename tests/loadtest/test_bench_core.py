"""loadtest/bench_core measures what it names: appends scored by the VAD, and response audio."""

from __future__ import annotations

import pytest

from loadtest.bench_core import append_us, response_audio_us

pytestmark = pytest.mark.unit


def test_both_hot_paths_are_timed_per_call() -> None:
    assert append_us(sessions=2, appends=5) > 0
    assert response_audio_us(sessions=1, responses=2, chunks=3) > 0
