"""``python -m loadtest run --scenario live``, one short level against a real server running the
scenario's streaming copy of duplex-tiny: every model frame is matched to the input frame it was
stepped on, the model keeps up with two real-time sessions, and the report renders."""

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
    assert latency["n"] >= 2 * 25  # ~37 model frames a session in 3 s; the busy host may miss a few
    assert 0 < latency["p50"] < 1000
    assert level["realtime_ratio"] is not None and level["realtime_ratio"] > 0.8
    table = render_live({"name": "t", "command": "c", "live": {"levels": [level]}})
    assert "| 2 |" in table
