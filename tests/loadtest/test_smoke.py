"""The load generator end to end: a short run against a live server on the null pipeline.

Fails if the tool breaks: it must measure turns (with a time to first audio each), see no
errors, sample the server's `/metrics`, and write its JSON, Markdown and plots.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from loadtest.__main__ import main
from loadtest.server_metrics import Scrape
from tests.live_server import live_server
from tests.timing import slack

pytestmark = pytest.mark.system


@pytest.mark.timing
def test_loadtest_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with live_server(tmp_path / "data", pipeline="null", vad=False, max_sessions=16) as live:
        code = main(
            [
                "run", "--url", live.http_url, "--sessions", "4", "--ramp", "0.5", "--duration", "2",
                "--speech", "tone", "--speech-ms", "600", "--turn-detection", "manual", "--pause", "0.2",
                "--barge-in", "0.5", "--barge-in-after-ms", "300",
                "--no-progress", "--name", "smoke", "--out", str(out), "--slo", "errors==0,underruns==0",
            ]
        )  # fmt: skip
        metrics = Scrape.parse(httpx.get(f"{live.http_url}/metrics", timeout=10).text, 0.0)
    assert code == 0
    results = json.loads((out / "smoke.json").read_text())
    [level] = results["levels"]
    turns = level["turns"]
    assert len(turns) >= 4
    assert all(t["ttfa_ms"] is not None and 150 < t["ttfa_ms"] < slack(2000) for t in turns)
    assert level["summary"]["errors"] == 0 and level["summary"]["admissions"] == {"admitted": 4}
    assert {t["status"] for t in turns} <= {"completed", "cancelled"}
    assert all(t["barge_in_stop_ms"] is not None for t in turns if t["barge_in"])
    assert level["server"]["available"] and level["server"]["peak_rss_mb"] > 0
    assert (out / "smoke.md").read_text().startswith("# Load test: smoke")
    assert (out / "smoke-ttfa-cdf.png").stat().st_size > 1000
    # The server's own view of the same turns.
    assert metrics.value("omniduplex_time_to_first_audio_seconds_count") >= len(turns)
    assert metrics.value("omniduplex_admissions_total", outcome="admitted") == 4
    assert metrics.value("omniduplex_stage_step_seconds_count", stage="respond") > 0
    assert metrics.value("process_resident_memory_bytes") > 0
