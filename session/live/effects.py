"""What a GPT-Live session core asks its driver to do (session/live/core.py, module docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from session.live.events import StartConfig


@dataclass(slots=True)
class Emit:
    """A server event for the client."""

    event: dict[str, Any]


@dataclass(slots=True)
class Begin:
    """The session started: open the live request on the pipeline."""

    config: StartConfig


@dataclass(slots=True)
class Feed:
    """Input audio for the model (float32 mono at 24 kHz)."""

    samples: np.ndarray


@dataclass(slots=True)
class Condition:
    """Text for the model as conditioning, in order with the audio."""

    values: dict[str, Any]


@dataclass(slots=True)
class RunDelegation:
    """A ``responses`` delegation for the pipeline's text model."""

    delegation_id: str
    task: str
    items: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Close:
    """Send what is queued, then close the connection; the session is over."""

    code: int
    reason: str


Effect = Emit | Begin | Feed | Condition | RunDelegation | Close
