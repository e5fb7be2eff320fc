"""OpenAI Realtime (GA) session core: sans-I/O, driven by `session/voice/driver.py` (what it
asks the driver to do: :mod:`session.realtime.effects`)."""

from __future__ import annotations

from session.realtime.config import SessionConfig, TurnDetection
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.errors import ProtocolError

__all__ = [
    "CoreOptions",
    "ProtocolError",
    "RealtimeSessionCore",
    "SessionConfig",
    "TurnDetection",
]
