"""`/metrics?scope=all` under `serve --workers N`: counters and histograms summed, gauges summed
when they add up across processes, else kept per worker with a `worker` label; the result is
one valid exposition the load test's parser reads (web.server.metrics.merge_worker_metrics)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.realtime_client import RealtimeClient
from loadtest.server_metrics import Scrape
from tests.scaleout.cluster import get
from tests.scaleout.workers_parent import descendants, live_workers, start_parent, stop_everything
from web.deploy.workers import worker_label
from web.server.metrics import GAUGE_MERGE, ServerMetrics, merge_worker_metrics

# Layer: real worker processes.
pytestmark = pytest.mark.system

A = """# HELP c_total A counter.
# TYPE c_total counter
c_total 2.0
# HELP g A gauge nobody classified.
# TYPE g gauge
g 2.0
# HELP omniduplex_active_sessions Open sessions.
# TYPE omniduplex_active_sessions gauge
omniduplex_active_sessions 3.0
# HELP h A histogram.
# TYPE h histogram
h_bucket{le="1.0"} 1.0
h_bucket{le="+Inf"} 2.0
h_count 2.0
h_sum 1.5
# HELP e_total By code.
# TYPE e_total counter
"""
B = """# HELP c_total A counter.
# TYPE c_total counter
c_total 5.0
# HELP g A gauge nobody classified.
# TYPE g gauge
g 7.0
# HELP omniduplex_active_sessions Open sessions.
# TYPE omniduplex_active_sessions gauge
omniduplex_active_sessions 4.0
# HELP h A histogram.
# TYPE h histogram
h_bucket{le="1.0"} 0.0
h_bucket{le="+Inf"} 1.0
h_count 1.0
h_sum 3.0
# HELP e_total By code.
# TYPE e_total counter
e_total{code="x y}"} 1.0
"""


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Parsed with prometheus-client's own parser; each family must come out exactly once."""
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"family {fam.name} twice"
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


def test_counters_and_histograms_sum_and_unknown_gauges_stay_per_worker() -> None:
    merged = merge_worker_metrics([("0", A), ("1", B)])
    fams = families(merged)
    assert fams["c"] == [("c_total", {}, 7.0)]
    assert fams["omniduplex_active_sessions"] == [("omniduplex_active_sessions", {}, 7.0)]  # "sum"
    assert fams["g"] == [("g", {"worker": "0"}, 2.0), ("g", {"worker": "1"}, 7.0)]  # the default
    assert fams["h"] == [
        ("h_bucket", {"le": "1.0"}, 1.0),
        ("h_bucket", {"le": "+Inf"}, 3.0),
        ("h_count", {}, 3.0),
        ("h_sum", {}, 4.5),
    ]
    # A series only the second worker has stays inside its family (after its TYPE line).
    assert fams["e"] == [("e_total", {"code": "x y}"}, 1.0)]
    assert merged.index('e_total{code="x y}"} 1.0') > merged.index("# TYPE e_total counter")
    assert Scrape.parse(merged, 0.0).value("omniduplex_active_sessions") == 7.0


def test_every_gauge_the_server_exports_is_classified() -> None:
    """A new gauge needs a decision in GAUGE_MERGE (``_created`` timestamps stay per worker)."""
    m = ServerMetrics()
    m.responses.inc()
    gauges = {
        f.name
        for f in text_string_to_metric_families(m.render().decode())
        if f.type == "gauge" and not f.name.endswith("_created")
    }
    assert gauges <= set(GAUGE_MERGE), gauges - set(GAUGE_MERGE)


def test_a_real_process_text_merges_into_valid_exposition() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.responses.inc()
    b.responses.inc(2)
    b.errors.labels(code="boom").inc()
    a.loop_lag.observe(0.01)
    b.loop_lag.observe(0.5)
    merged = merge_worker_metrics([("0", a.render().decode()), ("1", b.render().decode())])
    fams = families(merged)
    assert fams["omniduplex_responses"][0] == ("omniduplex_responses_total", {}, 3.0)
    lag = {s[0]: s[2] for s in fams["omniduplex_event_loop_lag_seconds"] if "le" not in s[1]}
    assert lag == {
        "omniduplex_event_loop_lag_seconds_count": 2.0,
        "omniduplex_event_loop_lag_seconds_sum": 0.51,
    }
    starts = fams["process_start_time_seconds"]
    assert [s[1] for s in starts] == [{"worker": "0"}, {"worker": "1"}]
    assert fams["omniduplex_errors"] == [("omniduplex_errors_total", {"code": "boom"}, 1.0)]


async def test_scope_all_of_two_real_workers(tmp_path: Path) -> None:
    parent = start_parent(tmp_path, workers=2)
    children = descendants(parent)
    clients: list[RealtimeClient] = []
    try:
        workers = await live_workers(parent, 2)
        children = descendants(parent)
        # Sessions through the public port until both workers have some (the kernel spreads them).
        while len(clients) < 4 or (min([await _sessions(w.url) for w in workers]) == 0 and len(clients) < 32):
            client = await RealtimeClient.open(f"ws://127.0.0.1:{parent.port}/v1/realtime")
            await client.until("session.created")
            clients.append(client)
        assert min([await _sessions(w.url) for w in workers]) >= 1
        done = await asyncio.gather(*(c.turn("hello") for c in clients))
        assert all(d["response"]["status"] == "completed" for d in done)

        own = {worker_label(w.replica_id): (await get(w.url + "/metrics")).text for w in workers}
        merged = (await get(parent.url + "/metrics?scope=all")).text
        fams = families(merged)  # valid exposition, each family once
        one = {label: Scrape.parse(text, 0.0) for label, text in own.items()}
        all_ = Scrape.parse(merged, 0.0)  # the load test's parser reads it too
        n = float(len(clients))

        # Counters and histograms: summed (stable here: no session opens or turns meanwhile).
        for name, labels in (
            ("omniduplex_admissions_total", {"outcome": "admitted"}),
            ("omniduplex_responses_total", {}),
            ("omniduplex_time_to_first_audio_seconds_count", {}),
        ):
            parts = [_value(s, name, labels) for s in one.values()]
            assert min(parts) >= 1 and _value(all_, name, labels) == sum(parts) == n, (name, parts)
        for le, count in all_.buckets("omniduplex_time_to_first_audio_seconds"):
            assert count == sum(
                dict(s.buckets("omniduplex_time_to_first_audio_seconds"))[le] for s in one.values()
            )
        cpu = all_.value("process_cpu_seconds_total")  # scraped after the workers' own: not less
        assert cpu >= sum(s.value("process_cpu_seconds_total") for s in one.values()) > 0

        # Additive gauges: one unlabelled sum (what the load test's CPU/RSS/session sampler reads).
        assert all_.value("omniduplex_active_sessions") == n
        by_kind = all_.by_label("omniduplex_active_sessions_by_kind", "kind")
        assert by_kind == {"voice": n, "world": 0.0, "robot": 0.0, "live": 0.0}
        rss = [s.value("process_resident_memory_bytes") for s in one.values()]
        assert 0.8 * sum(rss) < all_.value("process_resident_memory_bytes") < 1.25 * sum(rss), rss
        assert all(not labels for _, labels, _ in fams["process_resident_memory_bytes"])

        # Per-process gauges: each worker's own value under its `worker` label, no sum.
        starts = {labels["worker"]: value for _, labels, value in fams["process_start_time_seconds"]}
        assert starts == {label: s.value("process_start_time_seconds") for label, s in one.items()}
        assert set(starts) == {"0", "1"}
        assert all_.value("process_start_time_seconds", default=-1.0) == -1.0  # no unlabelled one
        assert {labels["worker"] for _, labels, _ in fams["process_max_fds"]} == {"0", "1"}
    finally:
        for client in clients:
            await client.close()
        stop_everything(parent, children)


def _value(scrape: Scrape, name: str, labels: dict[str, str]) -> float:
    return scrape.samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _sessions(url: str) -> int:
    return int((await get(url + "/readyz")).json()["sessions"])
