"""loadtest.bench_qwen's figures over several waves per level (no model: the summary alone)."""

from __future__ import annotations

import pytest

from loadtest.bench_qwen import RequestTiming, parse_args, schedule, summarize, summarize_waves, wave_count

pytestmark = pytest.mark.unit


def _wave(*ttfa: float) -> list[RequestTiming]:
    return [RequestTiming(ttfa_ms=t, total_ms=t + 1000.0, audio_s=2.0) for t in ttfa]


def test_the_median_is_the_median_of_the_waves_medians() -> None:
    # Two steady waves (groups at 100 and 120 ms: median 110) and one slow wave (median 210):
    # the level's median is the steady waves', where pooling all 24 requests would give 120.
    steady = _wave(*[100.0] * 4, *[120.0] * 4)
    slow = _wave(*[200.0] * 4, *[220.0] * 4)
    row = summarize_waves([slow, steady, steady])
    assert row["ttfa_ms_wave_medians"] == [210.0, 110.0, 110.0]
    assert row["ttfa_ms_median"] == 110.0
    assert row["ttfa_ms_max"] == 220.0  # over every request of every wave
    assert len(row["requests"]) == 24
    assert row["rtf_max"] == pytest.approx((220.0 + 1000.0) / 1e3 / 2.0)


def test_one_request_per_wave_is_the_median_of_all_as_before() -> None:
    row = summarize_waves([_wave(90.0), _wave(150.0), _wave(80.0)])
    assert row["ttfa_ms_median"] == 90.0
    assert row["ttfa_ms_wave_medians"] == [90.0, 150.0, 80.0]
    pooled = summarize([*_wave(90.0), *_wave(150.0), *_wave(80.0)])
    assert {k: v for k, v in row.items() if k != "ttfa_ms_wave_medians"} == pooled


def test_a_single_wave_gives_its_own_median() -> None:
    row = summarize_waves([_wave(100.0, 100.0, 130.0, 130.0)])
    assert row["ttfa_ms_median"] == 115.0
    assert row["ttfa_ms_wave_medians"] == [115.0]


def test_an_empty_wave_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        summarize_waves([_wave(100.0), []])
    with pytest.raises(ValueError, match="at least one request"):
        summarize_waves([])


def test_waves_per_level_and_mode() -> None:
    # The command line: the defaults give 5 waves at every level for async_chunk.
    args = parse_args(["--concurrency", "1", "4", "8", "16", "--out", "F.json"])
    assert [wave_count(args, n, "async") for n in (1, 4, 8, 16)] == [5, 5, 5, 5]
    assert [wave_count(args, n, "full") for n in (1, 4, 8, 16)] == [5, 1, 1, 1]
    assert args.floor_reps == 5
    args = parse_args(["--waves", "1", "--c1-reps", "2"])  # the old bench's single wave above c1
    assert [wave_count(args, n, "async") for n in (1, 8)] == [2, 1]


@pytest.mark.parametrize("flag", ["--waves", "--c1-reps", "--floor-reps"])
def test_zero_waves_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([flag, "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_levels_and_floor_are_sampled_in_rounds_over_the_same_time() -> None:
    # The command line: 5 rounds, each one async wave of every level (forward, then
    # backward, ...) and one of the 5 floor samples, right before the round's c1 wave (last in
    # a backward round); the full waves after.
    args = parse_args(["--concurrency", "1", "4", "8", "16", "--out", "F.json"])
    steps = schedule(args)
    floor = (0, "floor")
    forward = [floor, (1, "async"), (4, "async"), (8, "async"), (16, "async")]
    backward = [(16, "async"), (8, "async"), (4, "async"), floor, (1, "async")]
    assert steps[:25] == forward + backward + forward + backward + forward
    assert steps[25:] == [(1, "full")] * 5 + [(4, "full"), (8, "full"), (16, "full")]
    for level in (1, 4, 8, 16):
        assert steps.count((level, "async")) == wave_count(args, level, "async")
        assert steps.count((level, "full")) == wave_count(args, level, "full")
    assert steps.count(floor) == args.floor_reps


def test_floor_samples_spread_over_rounds_next_to_the_c1_wave() -> None:
    # 3 rounds, 5 samples: 2, 2, 1 (ceil spread), each group before the c1 wave.
    args = parse_args(["--concurrency", "1", "8", "--c1-reps", "3", "--waves", "3", "--floor-reps", "5"])
    floor = (0, "floor")
    assert [s for s in schedule(args) if s[1] != "full"] == [
        floor,
        floor,
        (1, "async"),
        (8, "async"),
        (8, "async"),
        floor,
        floor,
        (1, "async"),
        floor,
        (1, "async"),
        (8, "async"),
    ]


def test_levels_with_fewer_waves_drop_out_of_the_later_rounds() -> None:
    args = parse_args(["--concurrency", "1", "8", "--c1-reps", "1", "--waves", "3", "--floor-reps", "1"])
    assert [s for s in schedule(args) if s[1] != "full"] == [
        (0, "floor"),
        (1, "async"),
        (8, "async"),
        (8, "async"),
        (8, "async"),
    ]


def test_a_round_without_a_c1_wave_takes_its_floor_samples_first() -> None:
    args = parse_args(["--concurrency", "1", "8", "--c1-reps", "1", "--waves", "3", "--floor-reps", "3"])
    floor = (0, "floor")
    assert [s for s in schedule(args) if s[1] != "full"] == [
        floor,
        (1, "async"),
        (8, "async"),
        floor,
        (8, "async"),
        floor,
        (8, "async"),
    ]
