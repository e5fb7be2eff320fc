"""`bench_turns`' pipeline: `--asr-workers` sets how many Whisper runs go at once (the one
model's `num_workers`, and the live ASR's calls in flight); 1 as the earlier rounds measured.
`--asr-threads` sets CTranslate2's threads a run (1 by default; voice-cascade has 0, i.e.
min(4, cores)), `--lane-nice` the live ASR's `background_nice` (the engine's own by default)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from loadtest.bench_turns import _score_all, pipeline
from loadtest.turn_set import RATE, Clip

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
    assert "background_nice" not in stages["live_asr"]["options"]  # the engine's default


@pytest.mark.parametrize("threads", [1, 2])
def test_asr_threads_reach_both_whisper_stages(tmp_path: Path, threads: int) -> None:
    doc = yaml.safe_load(pipeline(tmp_path, transcripts=True, asr_threads=threads).read_text())
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["live_asr"]["options"]["cpu_threads"] == threads
    assert stages["asr"]["options"]["cpu_threads"] == threads


def test_lane_nice_reaches_the_live_asr_only(tmp_path: Path) -> None:
    doc = yaml.safe_load(pipeline(tmp_path, transcripts=True, lane_nice=5).read_text())
    stages = {s["name"]: s for s in doc["stages"]}
    assert stages["live_asr"]["options"]["background_nice"] == 5
    assert "background_nice" not in stages["asr"]["options"]


def test_a_finished_clip_is_timed_to_its_response_and_to_the_responses_first_audio() -> None:
    """End of speech -> `response.created` and -> the first `response.output_audio.delta` of a
    clip answered once (the clip's events matched to it by `audio_end_ms`)."""
    clip = Clip("s00-finished", "Hello there.", "joe", np.zeros(2 * RATE, np.float32))
    t_end = 100.0
    log = [
        (100.2, {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 2000 + 400}),
        (100.3, {"type": "response.created"}),
        (100.5, {"type": "response.output_audio.delta"}),
        (100.6, {"type": "response.output_audio.delta"}),
    ]
    (result,) = _score_all("semantic_auto", [(clip, 400, t_end)], log)
    assert result.answered_once
    assert result.latency_ms == pytest.approx(300.0)
    assert result.first_audio_ms == pytest.approx(500.0)
