"""``python -m loadtest run --scenario live``, one short level against a real server running the
scenario's streaming copy of duplex-tiny: model frames are matched to the input frames they were
stepped on and timed, the real-time ratio is measured, and the report renders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.live import render_live, run_level, streaming_pipeline
from loadtest.server_process import Target
from tests.live_server import LiveServer, live_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    pipeline = streaming_pipeline(Path(tmp_path_factory.mktemp("pipeline")))
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline=str(pipeline), vad=False) as live:
        yield live


async def test_a_live_level_measures_frame_latency(streaming: LiveServer) -> None:
    level = await run_level(Target(streaming.http_url), 2, 0.2, 3.0, 1000.0, 1, None)
    assert level["error_count"] == 0, level["errors"]
    latency = level["frame_latency_ms"]
    # ~37 model frames a session in 3 s, each matched to its input frame; on a busy host the
    # model may fall behind (its late frames are cut by the close), so the bounds are loose
    assert latency["n"] >= 20
    assert 0 < latency["p50"] < 5000
    assert level["realtime_ratio"] is not None and 0.5 < level["realtime_ratio"] <= 1.05
    table = render_live({"name": "t", "command": "c", "live": {"levels": [level]}})
    assert "| 2 |" in table
