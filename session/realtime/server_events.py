"""Server events: the outbox that collects them (and stamps their `event_id`s unless a session
log does), and builders for the bigger payloads.

Every event built here validates strictly against the `openai` SDK's `RealtimeServerEvent`
(the tests check it); events typed `omni.*` are our extensions.
"""

from __future__ import annotations

import math
from typing import Any

from session.realtime.effects import CoreOutput, Effect
from session.realtime.errors import ProtocolError, clip
from session.realtime.ids import IdFactory


class Outbox:
    """Collects the events and effects of one call into the core.

    ``stamp``: give each event a fresh ``event_id``. False when a session log stamps each event
    as it logs it (its ids are what resume counts on): the event then carries ``None`` there
    until the log fills it in, which keeps the key where clients expect it.
    """

    def __init__(self, new_id: IdFactory, *, stamp: bool = True) -> None:
        self._new_id = new_id
        self._stamp = stamp
        self._out = CoreOutput()

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, "event_id": self._new_id("event") if self._stamp else None, **fields}
        self._out.events.append(event)
        return event

    def effect(self, effect: Effect) -> None:
        self._out.effects.append(effect)

    def error(self, err: ProtocolError, event_id: str | None = None) -> dict[str, Any]:
        echoed = event_id if event_id is not None else err.event_id
        return self.event(
            "error",
            error={
                "type": err.type,
                "code": err.code,
                "message": err.message,
                "param": err.param,
                "event_id": None if echoed is None else clip(echoed),
            },
        )

    def drain(self) -> CoreOutput:
        out, self._out = self._out, CoreOutput()
        return out


def estimate_text_tokens(text: str) -> int:
    return math.ceil(len(text) / 4) if text else 0


def usage(
    *,
    input_text_chars: int = 0,
    input_audio_s: float = 0.0,
    output_text: str = "",
    output_audio_s: float = 0.0,
    reported: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`response.usage`. Pipelines do not count tokens yet, so this estimates: text ≈ 4 chars
    per token, input audio 10 tokens/s, output audio 20 tokens/s (OpenAI's published rates).
    Counts a driver reports (`input_tokens`, `output_tokens`, ...) override the estimates."""
    in_text = math.ceil(input_text_chars / 4)  # as estimate_text_tokens
    in_audio = round(input_audio_s * 10)
    out_text = estimate_text_tokens(output_text)
    out_audio = round(output_audio_s * 20)
    result: dict[str, Any] = {
        "total_tokens": in_text + in_audio + out_text + out_audio,
        "input_tokens": in_text + in_audio,
        "output_tokens": out_text + out_audio,
        "input_token_details": {
            "text_tokens": in_text,
            "audio_tokens": in_audio,
            "image_tokens": 0,
            "cached_tokens": 0,
            "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
        },
        "output_token_details": {"text_tokens": out_text, "audio_tokens": out_audio},
    }
    if reported:
        for key in ("input_tokens", "output_tokens"):
            if isinstance(reported.get(key), int):
                result[key] = reported[key]
        result["total_tokens"] = result["input_tokens"] + result["output_tokens"]
    return result
