"""`bench_turns`' pipeline: `--asr-workers` sets how many Whisper runs go at once (the one
model's `num_workers`, and the live ASR's calls in flight); 1 as the earlier rounds measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loadtest.bench_turns import pipeline

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("workers", [1, 2])
def test_asr_workers_reach_both_whisper_stages(tmp_path: Path, workers: int) -> None:
    doc = yaml.safe_load(pipeline(tmp_path, transcripts=True, asr_workers=workers).read_text())
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["live_asr"]["options"]["num_workers"] == workers
    assert stages["live_asr"]["budget"]["workers"] == workers
    assert stages["asr"]["options"]["num_workers"] == workers
    assert stages["live_asr"]["options"]["cpu_threads"] == 1


def test_the_default_is_one_run_at_a_time(tmp_path: Path) -> None:
    doc = yaml.safe_load(pipeline(tmp_path, transcripts=True).read_text())
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["live_asr"]["budget"]["workers"] == 1
