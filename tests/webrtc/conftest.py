"""A real server (voice-cascade: Silero VAD → whisper → echo → Piper) for the WebRTC tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.live_server import LiveServer, live_server
from tests.peer_faults import fast_consent  # noqa: F401  (a fixture: ICE consent lost in ~2 s)
from tests.speech_audio import SENTENCE, speak

INTERRUPTION = "Wait, stop. I have another question."
GRACE_S = 2.0
TRANSCRIBED = {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A short disconnect grace: a client peer closed without a hangup detaches its session
    # (tests/webrtc/test_resume.py), and later tests wait for the server to be empty again.
    with live_server(Path(tmp_path_factory.mktemp("srv")), disconnect_grace_s=GRACE_S) as live:
        yield live


@pytest.fixture(scope="module")
def sentence48k() -> np.ndarray:
    return speak(SENTENCE, 48_000)


@pytest.fixture(scope="module")
def interruption48k() -> np.ndarray:
    return speak(INTERRUPTION, 48_000)


def webrtc_service(server: LiveServer) -> Any:
    """The server's `WebRtcService` (read it from the test loop; its calls live on the server's)."""
    app: Any = server.server.config.app
    return app.state.webrtc


def open_peer_connections() -> list[Any]:
    """RTCPeerConnections in this process that are not closed (server and clients alike)."""
    from aiortc import RTCPeerConnection

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, RTCPeerConnection) and o.connectionState != "closed"]
