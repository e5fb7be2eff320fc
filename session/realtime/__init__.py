"""OpenAI Realtime (GA) session core: sans-I/O, driven by `session/voice/driver.py`."""

from __future__ import annotations

from session.realtime.config import SessionConfig, TurnDetection
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import (
    CancelResponse,
    ClearAudioOutput,
    Close,
    CoreOutput,
    DetectSpeech,
    DropAhead,
    Effect,
    LiveControl,
    PlayAudio,
    PrepareTranscript,
    RespondAhead,
    StartResponse,
    TranscribeInput,
)
from session.realtime.errors import ProtocolError

__all__ = [
    "CancelResponse",
    "ClearAudioOutput",
    "Close",
    "CoreOptions",
    "CoreOutput",
    "DetectSpeech",
    "DropAhead",
    "Effect",
    "LiveControl",
    "PlayAudio",
    "PrepareTranscript",
    "ProtocolError",
    "RealtimeSessionCore",
    "RespondAhead",
    "SessionConfig",
    "StartResponse",
    "TranscribeInput",
    "TurnDetection",
]
