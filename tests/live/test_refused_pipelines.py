"""A pipeline that does not take its own turns (here ``null``, a turn-based echo) refuses
GPT-Live sessions before the upgrade with a clear error (400 ``live_sessions_unsupported``,
naming the pipeline and the Realtime protocol to use instead), and opens nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.live_server import LiveServer, live_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def turn_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline="null") as live:
        yield live


async def test_a_turn_based_pipeline_refuses_live_sessions(turn_server: LiveServer) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(f"{turn_server.ws_url}/v1/live/sessions")
    response = refused.value.response
    assert response.status_code == 400
    error = json.loads(response.body)["error"]
    assert error["code"] == "live_sessions_unsupported"
    assert "'null'" in error["message"] and "/v1/realtime" in error["message"]
    assert turn_server.ctx.metrics.session_counts()["live"] == 0
