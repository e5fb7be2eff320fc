"""loadtest.bench_qwen's figures over several waves per level (no model: the summary alone)."""

from __future__ import annotations

import pytest

from loadtest.bench_qwen import RequestTiming, parse_args, summarize, summarize_waves, wave_count

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
    # The command line: the defaults give 3 waves at every level for async_chunk.
    args = parse_args(["--concurrency", "1", "4", "8", "16", "--out", "F.json"])
    assert [wave_count(args, n, "async") for n in (1, 4, 8, 16)] == [3, 3, 3, 3]
    assert [wave_count(args, n, "full") for n in (1, 4, 8, 16)] == [3, 1, 1, 1]
    args = parse_args(["--waves", "1", "--c1-reps", "2"])  # the old bench's single wave above c1
    assert [wave_count(args, n, "async") for n in (1, 8)] == [2, 1]


@pytest.mark.parametrize("flag", ["--waves", "--c1-reps", "--floor-reps"])
def test_zero_waves_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([flag, "0"])
    assert "must be at least 1" in capsys.readouterr().err
