"""The model's side of a GPT-Live session's timeline: one continuous output stream.

GPT-Live's output audio is continuous: the model's speech as it comes, and silence while it is
quiet. :class:`OutputStream` keeps the stream's position on the session's timeline (the input
audio's clock): the model's audio advances it; while the model is quiet, every input append
adds silence up to ``SILENCE_LAG_MS`` behind the input (so speech the model starts meanwhile
does not land on silence already sent), and a client's own gate finds the model's turns in the
stream. The model's transcript is placed in the stream (``start_ms`` / ``end_ms``).
"""

from __future__ import annotations

from typing import Final

import numpy as np

from media.audio import b64encode_audio, float32_to_pcm16
from session.live import events as ev
from session.live.effects import Effect, Emit

RATE: Final = ev.SAMPLE_RATE
SILENCE_LAG_MS: Final = 200
FRAME_MS: Final = 80  # a model frame: the span a text piece is given until its audio comes


class OutputStream:
    """Where the output stream stands, and the events that extend it (module docstring)."""

    def __init__(self) -> None:
        self.ms = 0  # the stream's end on the session timeline
        self.speaking = False
        self.audio_ms = 0  # of the model's own audio
        self.stretches = 0

    def fill(self, input_ms: int) -> list[Effect]:
        """Silence up to ``SILENCE_LAG_MS`` behind the input, while the model is quiet."""
        gap = input_ms - SILENCE_LAG_MS - self.ms
        if self.speaking or gap < 20:
            return []
        self.ms += gap
        return [Emit(ev.audio_delta(_silence(gap * RATE // 1000)))]

    def started(self) -> None:
        self.speaking = True
        self.stretches += 1

    def stopped(self) -> None:
        self.speaking = False

    def text(self, text: str) -> list[Effect]:
        return [Emit(ev.transcript_delta("output", text, self.ms, self.ms + FRAME_MS))] if text else []

    def audio(self, samples: np.ndarray, rate: int) -> list[Effect]:
        if not samples.size:
            return []
        ms = samples.size * 1000 // rate
        self.ms += ms
        self.audio_ms += ms
        return [Emit(ev.audio_delta(b64encode_audio(float32_to_pcm16(samples))))]


_SILENCE: dict[int, str] = {}


def _silence(samples: int) -> str:
    """Base64 PCM16 silence (the few lengths a session uses, encoded once)."""
    text = _SILENCE.get(samples)
    if text is None:
        text = b64encode_audio(bytes(2 * samples))
        if len(_SILENCE) < 64:
            _SILENCE[samples] = text
    return text
