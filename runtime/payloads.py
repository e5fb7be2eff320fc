"""Typed payloads that move between stages and out to clients.

The control plane carries only these small dataclasses; large arrays inside them move
through a connector (in-process: by reference; shared memory: copied once into a segment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Payload:
    """Base class of everything a stage can emit."""


@dataclass(slots=True)
class TextDelta(Payload):
    """A piece of generated text (client-visible when a stage emits it to the client)."""

    text: str


@dataclass(slots=True)
class TokenIds(Payload):
    ids: np.ndarray  # int64 [N]


@dataclass(slots=True)
class HiddenStates(Payload):
    tensor: Any  # torch.Tensor or np.ndarray [..., hidden]
    layer: int = -1


@dataclass(slots=True)
class Embeddings(Payload):
    tensor: Any  # torch.Tensor or np.ndarray [..., hidden]
    role: str = ""  # what the embedding stands for (e.g. "talker_prefill", "text_token", "tts_eos")


@dataclass(slots=True)
class CodecCodes(Payload):
    codes: np.ndarray  # int64 [T, num_code_groups]


@dataclass(slots=True)
class KVBlocks(Payload):
    blocks: Any
    num_tokens: int = 0


@dataclass(slots=True)
class Latents(Payload):
    tensor: Any


@dataclass(slots=True)
class AudioChunk(Payload):
    samples: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int


@dataclass(slots=True)
class Frames(Payload):
    frames: np.ndarray  # uint8 [N, H, W, 3]
    fps: float = 0.0
    chunk_index: int = 0


@dataclass(slots=True)
class Action(Payload):
    """Streaming control input (key events, robot commands)."""

    name: str
    value: Any = None
    t_ms: float | None = None


@dataclass(slots=True)
class Conditioning(Payload):
    """A prompt/conditioning update for a live request (`Orchestrator.update`)."""

    values: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class AudioInput(Payload):
    """Streaming input audio appended to a live request."""

    samples: np.ndarray  # float32 mono
    sample_rate: int
    final: bool = False


@dataclass(slots=True)
class Transcript(Payload):
    """Transcription of the user's input audio (client-visible as input transcription)."""

    text: str
    final: bool = True
