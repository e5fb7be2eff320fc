"""SLO objectives of world levels, read from what the runner really puts in a level: the
summary built by ``level_summary`` over ``WorldSessionResult``s (``summary["world"]``)."""

from __future__ import annotations

import pytest

from loadtest.runner import level_summary
from loadtest.slo import METRICS, WORLD_METRICS, evaluate, parse_slo
from loadtest.world import WARMUP_S, Action, WorldSessionResult, WorldStats

pytestmark = pytest.mark.unit

FPS = 15.0


def world_result(index: int, *, late_ms: float = 0.0, action_ms: float = 70.0) -> WorldSessionResult:
    """A session that received 60 one-frame chunks on time after the warm-up (chunks 10, 20,
    ..., 50 arrive ``late_ms`` late, the next ones catch up) and sent two key presses, one
    applied."""
    stats = WorldStats(fps_requested=FPS, started_at=0.0)
    t = WARMUP_S
    late_s = late_ms / 1000
    for i in range(60):
        t += 1 / FPS + (late_s if i and i % 10 == 0 else 0.0) - (late_s if i > 1 and i % 10 == 1 else 0.0)
        stats.chunk_at.append(t)
        stats.chunk_frames.append(1)
    applied = Action(sent_at=2.0, queued_at=2.01, applies_at=30, applied_at=2.05, applied_chunk=30)
    applied.frame_at = 2.0 + action_ms / 1000
    applied.server_ms = 20.0
    stats.actions = {"a": applied, "b": Action(sent_at=3.0)}  # "b": never applied
    return WorldSessionResult(index=index, admission="admitted", world=stats)


def world_level(*results: WorldSessionResult) -> dict[str, object]:
    return {"summary": level_summary(list(results)), "server": {"rss_growth_mb": 3.0}}


def test_world_objectives_pass_on_a_smooth_level() -> None:
    level = world_level(world_result(0), world_result(1, action_ms=90.0))
    slo = parse_slo(
        "fps_min>=14, fps_p50>=14, action_latency_p95_ms<=100, frame_jitter_p99_ms<=35,"
        "frame_jitter_abs_p99_ms<=35, late_chunks==0, errors==0, refused==0, world_frames>=100"
    )
    verdicts = evaluate(slo, level)
    assert all(v.ok for v in verdicts), [v.to_json() for v in verdicts]
    actual = {v.objective.metric: v.actual for v in verdicts}
    assert actual["fps_min"] == pytest.approx(FPS)
    assert actual["action_latency_p95_ms"] == pytest.approx(89.0)  # p95 of 70 and 90
    assert actual["world_frames"] == 120


def test_world_objectives_fail_on_a_late_chunk_slow_actions_and_errors() -> None:
    slow = world_result(1, late_ms=50.0, action_ms=250.0)
    slow.errors = {"stalled": 1}
    level = world_level(world_result(0), slow)
    verdicts = evaluate(
        parse_slo(
            "action_latency_p95_ms<=100, frame_jitter_p99_ms<=35, late_chunks==0, errors==0,"
            "actions_unapplied==0, server_action_latency_p95_ms<=25"
        ),
        level,
    )
    got = {v.objective.metric: (v.ok, v.actual) for v in verdicts}
    assert got["action_latency_p95_ms"][0] is False and got["action_latency_p95_ms"][1] > 200
    assert got["frame_jitter_p99_ms"][0] is False  # chunks 50 ms late, over a 35 ms budget
    assert got["late_chunks"] == (False, 5.0)  # > half a period (33 ms) late
    assert got["errors"] == (False, 1.0)
    assert got["actions_unapplied"] == (False, 2.0)  # one of two per session
    assert got["server_action_latency_p95_ms"] == (True, 20.0)


def test_fps_below_target_fails() -> None:
    stalled = world_result(0)
    stalled.world.chunk_at = [t * 2 for t in stalled.world.chunk_at]  # every chunk takes twice as long
    [verdict] = evaluate(parse_slo("fps_min>=14"), world_level(stalled))
    assert verdict.ok is False and verdict.actual == pytest.approx(FPS / 2, rel=0.05)


def test_world_metrics_fail_when_not_measured() -> None:
    """A world objective on a voice level, or a world level whose sessions got no chunk, fails
    with no value: an objective that cannot be checked is not met."""
    voice = {"summary": level_summary([]), "server": {}}
    silent = world_level(WorldSessionResult(index=0, admission="admitted", world=WorldStats(FPS)))
    for level in (voice, silent):
        verdicts = evaluate(
            parse_slo("fps_min>=14, action_latency_p95_ms<=100, frame_jitter_p99_ms<=35"), level
        )
        assert [(v.ok, v.actual) for v in verdicts] == [(False, None)] * 3


def test_every_world_metric_is_an_slo_metric_and_parses() -> None:
    assert set(WORLD_METRICS) <= set(METRICS)
    level = world_level(world_result(0))
    for name in WORLD_METRICS:
        [verdict] = evaluate(parse_slo(f"{name}>=0"), level)
        assert verdict.actual is not None, name
    with pytest.raises(ValueError, match="fps_min"):  # the error lists the metrics
        parse_slo("fps>=14")
