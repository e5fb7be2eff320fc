"""`omniduplex serve` flags reach the session core's options."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.capabilities import PipelineCapabilities
from session.realtime.config import SessionConfig
from web.cli import build_parser
from web.server.session_factory import CoreFactory, build_store
from web.settings import ServerSettings

pytestmark = pytest.mark.unit


def test_audio_retention_flag_reaches_core_options() -> None:
    args = build_parser().parse_args(["serve", "--audio-retention-s", "2.5"])
    settings = ServerSettings.from_args(args)
    assert settings.audio_retention_s == 2.5
    options = CoreFactory(settings, PipelineCapabilities()).core_options(SessionConfig(), "sess_x")
    assert options.audio_retention_s == 2.5


def test_audio_retention_default_is_ten_seconds() -> None:
    settings = ServerSettings.from_args(build_parser().parse_args(["serve"]))
    assert settings.audio_retention_s == 10.0


def test_audio_replay_bounds_reach_the_store() -> None:
    """Audio deltas held for a resume: the byte flag, and a window of the time a dead connection
    can go unnoticed (ping interval + ping timeout + send timeout)."""
    args = build_parser().parse_args(
        [
            "serve",
            "--audio-replay-max-bytes",
            "123456",
            "--ws-ping-interval-s",
            "5",
            "--ws-send-timeout-s",
            "3",
        ]
    )
    settings = ServerSettings.from_args(args)
    store = build_store(SimpleNamespace(register_script=lambda script: script), settings)
    assert store.held_max_bytes == 123456
    assert store.held_window_s == 5 + settings.ws_ping_timeout_s + 3
    assert store.held_event_types == {"response.output_audio.delta"}
    default = build_store(SimpleNamespace(register_script=lambda script: script), ServerSettings())
    assert default.held_max_bytes == 4 * 1024 * 1024 and default.held_window_s == 55.0
