"""World sessions in `omniduplex_active_sessions`: the unlabelled total (what the load generator
and dashboards read) counts voice and world sessions; `..._by_kind{kind}` splits them."""

from __future__ import annotations

import pytest

from loadtest.server_metrics import Scrape, server_summary
from web.server.metrics import ServerMetrics

pytestmark = pytest.mark.unit


def scrape(metrics: ServerMetrics, at: float) -> Scrape:
    return Scrape.parse(metrics.render().decode(), at)


def test_active_sessions_count_voice_and_world() -> None:
    metrics = ServerMetrics()
    voice: list[object] = [object(), object()]
    worlds = [0]
    metrics.bind_sessions(lambda: voice)
    metrics.bind_worlds(lambda: worlds[0])

    first = scrape(metrics, 0.0)
    assert first.value("omniduplex_active_sessions") == 2
    by_kind = first.by_label("omniduplex_active_sessions_by_kind", "kind")
    assert by_kind == {"voice": 2, "world": 0, "robot": 0, "live": 0}
    assert metrics.session_counts() == {"voice": 2, "world": 0, "robot": 0, "live": 0}

    worlds[0] = 3
    voice.pop()
    metrics.bind_live(lambda: 2)  # GPT-Live sessions count in the total too
    second = scrape(metrics, 1.0)
    assert second.value("omniduplex_active_sessions") == 6  # read at scrape time
    assert second.value("omniduplex_active_sessions_by_kind", kind="live") == 2
    assert second.value("omniduplex_active_sessions_by_kind", kind="world") == 3
    assert second.value("omniduplex_active_sessions_by_kind", kind="voice") == 1

    summary = server_summary([first, second], 0.0)
    assert summary["peak_active_sessions"] == 6
    assert summary["peak_active_sessions_by_kind"] == {"voice": 2, "world": 3, "robot": 0, "live": 2}
    # the per-session CPU cost integrates the total: a world-only level is no longer empty
    worlds_only = ServerMetrics()
    worlds_only.bind_worlds(lambda: 5)
    level = server_summary([scrape(worlds_only, 0.0), scrape(worlds_only, 1.0)], 0.0)
    assert level["peak_active_sessions"] == 5 and level["cpu_ms_per_session_s"] is not None


def test_unbound_metrics_count_no_session() -> None:
    metrics = ServerMetrics()
    text = metrics.render().decode()
    assert "omniduplex_active_sessions 0.0" in text  # the unlabelled line readers grep for
    assert metrics.session_counts() == {"voice": 0, "world": 0, "robot": 0, "live": 0}
