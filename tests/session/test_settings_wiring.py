"""`omniduplex serve` flags reach the session core's options."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from runtime.capabilities import PipelineCapabilities
from session.realtime.config import SessionConfig
from web.cli import build_parser
from web.session_factory import core_options
from web.settings import ServerSettings


def test_audio_retention_flag_reaches_core_options() -> None:
    args = build_parser().parse_args(["serve", "--audio-retention-s", "2.5"])
    settings = ServerSettings.from_args(args)
    assert settings.audio_retention_s == 2.5
    ctx: Any = SimpleNamespace(
        settings=settings, pipeline_transcribes_input=False, capabilities=PipelineCapabilities()
    )
    options = core_options(ctx, SessionConfig(), "sess_x")
    assert options.audio_retention_s == 2.5


def test_audio_retention_default_is_ten_seconds() -> None:
    settings = ServerSettings.from_args(build_parser().parse_args(["serve"]))
    assert settings.audio_retention_s == 10.0
