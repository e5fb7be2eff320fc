"""loadtest.qwen_timeline's recording and path arithmetic (no model: a fake clock and records)."""

from __future__ import annotations

import pytest

from loadtest.qwen_timeline import PathCall, StepRecord, WaveTimeline, compare, median_path, parse_args
from runtime.metrics import MetricsHook, RuntimeMetrics
from tests.timing import FakeClock

pytestmark = pytest.mark.unit


def test_a_step_starts_its_step_time_before_it_is_observed() -> None:
    clock = FakeClock()
    timeline = WaveTimeline(clock=clock)
    timeline.on_step("thinker", 0, 8, 0.004)  # before begin(): belongs to no wave
    timeline.begin()
    clock.now += 0.010
    timeline.on_step("thinker", 0, 8, 0.008)
    clock.now += 0.030
    timeline.on_step("talker", 0, 8, 0.029)
    assert [(s.stage, s.rows) for s in timeline.steps] == [("thinker", 8), ("talker", 8)]
    assert [s.start_ms for s in timeline.steps] == pytest.approx([2.0, 11.0])
    assert [s.end_ms for s in timeline.steps] == pytest.approx([10.0, 40.0])
    assert timeline.steps[1].duration_ms == pytest.approx(29.0)
    assert [s.stage for s in timeline.until(11.5)] == ["thinker", "talker"]
    # a step that started at the last first audio is not on the path
    assert [s.stage for s in timeline.until(11.0)] == ["thinker"]
    timeline.begin()
    assert timeline.steps == []


def test_the_timeline_is_a_metrics_hook_that_sees_every_stage_step() -> None:
    clock = FakeClock()
    timeline = WaveTimeline(clock=clock)
    hook: MetricsHook = timeline
    metrics = RuntimeMetrics()
    metrics.add_stage("code2wav", 1)
    metrics.add_hook(hook)
    timeline.begin()
    clock.now += 0.020
    metrics.step("code2wav", 0, 4, 0.015)
    metrics.request("code2wav", 1.0, "completed")
    metrics.queue("code2wav", 0, 3, 4)
    assert [(s.stage, s.rows) for s in timeline.steps] == [("code2wav", 4)]
    assert [(s.start_ms, s.end_ms) for s in timeline.steps] == [pytest.approx((5.0, 20.0))]


def _wave(*calls: tuple[str, int, float, float]) -> list[StepRecord]:
    return [StepRecord(stage, rows, start, end) for stage, rows, start, end in calls]


def test_the_median_path_takes_each_calls_median_gap_and_duration() -> None:
    waves = [
        _wave(("thinker", 8, 3.0, 11.0), ("talker", 8, 12.0, 46.0), ("code2wav", 4, 47.0, 67.0)),
        _wave(("thinker", 8, 4.0, 13.0), ("talker", 8, 13.5, 43.5), ("code2wav", 4, 44.0, 66.0)),
        _wave(("thinker", 8, 2.0, 9.0), ("talker", 8, 10.0, 40.0)),  # shorter: the path ends with it
    ]
    assert median_path(waves) == [
        PathCall("thinker", 8, gap_ms=3.0, duration_ms=8.0),
        PathCall("talker", 8, gap_ms=1.0, duration_ms=30.0),
    ]
    assert median_path([]) == []


def test_the_path_ends_where_the_waves_took_different_calls() -> None:
    waves = [
        _wave(("thinker", 1, 1.0, 4.0), ("talker", 1, 4.5, 31.0)),
        _wave(("thinker", 1, 1.0, 4.0), ("thinker", 1, 4.5, 7.0)),
    ]
    assert median_path(waves) == [PathCall("thinker", 1, gap_ms=1.0, duration_ms=3.0)]


def test_compare_sets_the_levels_paths_side_by_side_with_totals() -> None:
    lines = compare(
        {
            8: [PathCall("thinker", 8, 3.5, 8.5), PathCall("code2wav", 4, 0.5, 20.0)],
            1: [PathCall("thinker", 1, 1.2, 3.9)],
        }
    )
    assert lines[0] == "| call | c1: stage rows, gap + ms | c8: stage rows, gap + ms |"
    assert lines[2] == "| 0 | thinker 1, 1.2 + 3.9 | thinker 8, 3.5 + 8.5 |"
    assert lines[3] == "| 1 |  | code2wav 4, 0.5 + 20.0 |"
    assert lines[4] == "| total | gaps 1.2 + calls 3.9 = 5.1 | gaps 4.0 + calls 28.5 = 32.5 |"


def test_the_command_line_refuses_empty_levels_and_waves() -> None:
    assert parse_args([]).levels == [1, 8]
    with pytest.raises(SystemExit):
        parse_args(["--waves", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--levels", "0", "8"])
