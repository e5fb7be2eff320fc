"""Which world models a video session may start, and the limits on what a client may ask."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from session.world.keys import normalize_key

MOVE_KEYS = frozenset(
    normalize_key(k) for k in ("W", "A", "S", "D", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight")
)


@dataclass(frozen=True, slots=True)
class WorldModel:
    name: str  # what clients put in session.start.model
    pipeline: str  # runtime pipeline name or YAML path
    keys: frozenset[str] = MOVE_KEYS  # normalized keys the model acts on; empty: no actions
    prompts: bool = True  # takes prompt updates
    chunk_frames: int | None = None  # frames per chunk; None: about target_chunk_ms of video


DEFAULT_MODELS: Mapping[str, WorldModel] = {
    # the pretrained tiny-jepa: actions only (it has no text conditioning)
    "tiny-jepa": WorldModel("tiny-jepa", "world-tiny-jepa", prompts=False),
    # random weights, noise frames: exercises prompt updates (and takes the same keys)
    "tiny-video-random": WorldModel("tiny-video-random", "world-tiny-video-random"),
}


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_width: int = 1024
    max_height: int = 1024
    default_width: int = 256
    default_height: int = 256
    max_fps: float = 60.0
    default_fps: float = 30.0
    max_num_frames: int = 10_000_000
    max_chunk_frames: int = 32
    # Default chunk length. An action waits for the next chunk boundary, so shorter chunks mean
    # snappier control; each chunk costs a pipeline round trip and a WebSocket message pair.
    target_chunk_ms: float = 70.0
    max_prompt_chars: int = 4000
    max_actions: int = 64  # per session.interaction
    max_message_bytes: int = 64 * 1024  # one client text frame
    max_applied_ids: int = 64  # event ids listed per session.interaction.applied
    stall_timeout_s: float = 10.0  # a send blocked this long ends the session
    close_grace_s: float = 2.0  # time to get the error and close frame out after a stall
    formats: tuple[str, ...] = ("jpeg", "m4s")


@dataclass(frozen=True, slots=True)
class VideoConfig:
    models: Mapping[str, WorldModel] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    limits: VideoLimits = field(default_factory=VideoLimits)
