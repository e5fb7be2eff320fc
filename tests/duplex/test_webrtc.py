"""duplex-tiny over a WebRTC call with a real aiortc client peer (loopback): microphone audio on
the track reaches the model's live request (48 kHz → 24 kHz, once), the model's speech comes
back on the server's track, and the `oai-events` channel carries its responses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadtest.webrtc_client import RealtimeCallClient
from tests.live_server import LiveServer, live_server
from tests.session.realtime_harness import assert_valid_server_event

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(
        Path(tmp_path_factory.mktemp("srv")), pipeline="duplex-tiny", vad=False, disconnect_grace_s=0.5
    ) as live:
        yield live


async def test_model_speech_plays_on_the_track(server: LiveServer) -> None:
    mic = (np.random.default_rng(3).standard_normal(48_000 * 5) * 0.1).astype(np.float32)
    async with RealtimeCallClient(server.http_url) as client:
        client.say("mic", mic, 48_000)
        started_at, started = await client.wait_event("output_audio_buffer.started", timeout_s=30)
        _, done = await client.wait_event("response.done", timeout_s=30)
        assert started["response_id"] == done["response"]["id"]
        assert done["response"]["status"] in ("completed", "incomplete")
        await client.wait_event("output_audio_buffer.stopped", timeout_s=30)
        heard = client.heard_audio(since=started_at)
        assert heard.size and float(np.sqrt(np.mean(heard**2))) > 0.02  # the model's (noise) audio
        types = [e["type"] for _, e in client.events]
        assert "response.output_audio.delta" not in types  # audio went on the track
        assert "input_audio_buffer.committed" in types  # the mic audio became a user item
        assert "input_audio_buffer.speech_started" not in types  # no VAD
        for _, event in client.events:
            assert_valid_server_event(event)
    stage = server.ctx.orchestrator.metrics.snapshot()["stages"]["duplex"]
    assert stage["steps"] > 10
