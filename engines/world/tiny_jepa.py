"""``world.tiny_jepa``: the pretrained tiny-jepa world model (PyPI ``tiny-jepa``, MIT), chunked.

tiny-jepa is a real action-conditioned JEPA trained on OrbyWorld, a 32×32 grayscale world
with five actions (stay/up/down/left/right): an encoder (frame → 32-d latent), a predictor
(latent + action → next latent) and a decoder (latent → frame). It is pure numpy and takes
~0.03 ms per imagine+decode step, so one engine step computes a whole chunk for every request
of the batch (each request's rows on their own, so its frames do not depend on the batch).

Per request the *rolling context* is the current latent plus an OrbyWorld environment seeded
with the request's ``seed``. Every frame: the predictor rolls the latent forward with the held
action and the decoder draws it. Imagined rollouts of this model blur within a few steps, so
every ``reanchor_every`` frames the latent is pulled towards the encoding of the environment,
which steps with the same actions (``anchor_weight`` 1.0 is a hard re-encode, 0.5 a soft
pull that keeps the picture continuous). The decoded frames are dim and speckled; ``gain:
auto`` maps each frame's 70th percentile to black and its peak to white.

What comes out is the model's own picture: blurry blobs that change with the actions
(deterministically for a seed). Its 32-d latent keeps the scene only roughly: the decoded
blob follows the agent loosely (brightness centroid vs agent x correlate at about 0.3 over
seeds), and the distractor balls and the pellet mostly blur together.

Options: ``checkpoint`` (npz; default the ``orby_v1`` checkpoint inside the wheel),
``chunk_frames`` (2), ``fps`` (30), ``reanchor_every`` (1), ``anchor_weight`` (0.5),
``gain`` ("auto" or a number). Request params override ``chunk_frames``, ``fps`` and give
``seed``, ``num_frames`` and ``flow`` (see :mod:`engines.world.controls`).
Downstream: one ``Frames`` (uint8 ``[chunk_frames, 32, 32, 3]``) per chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.world.chunked import ChunkedRequest, ChunkedWorldEngine
from engines.world.controls import DIRECTIONS, ChunkJob, ControlState
from runtime.engine import EngineRequest


@dataclass(slots=True, kw_only=True)
class JepaRequest(ChunkedRequest):
    env: Any  # tiny_jepa.OrbyWorld
    latent: np.ndarray  # float32 [32]: the rolling context
    frames_since_anchor: int = 0


def _positive_int(value: Any, name: str) -> int:
    number = int(value)
    if number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


class TinyJepaEngine(ChunkedWorldEngine[JepaRequest]):
    """Chunked streaming over the pretrained tiny-jepa model (see the module docstring)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.chunk_frames = _positive_int(self.options.get("chunk_frames", 2), "chunk_frames")
        self.fps = float(self.options.get("fps", 30.0))
        self.reanchor_every = _positive_int(self.options.get("reanchor_every", 1), "reanchor_every")
        self.anchor_weight = float(self.options.get("anchor_weight", 0.5))
        if not 0.0 <= self.anchor_weight <= 1.0:
            raise ValueError(f"anchor_weight must lie in [0, 1], got {self.anchor_weight}")
        gain = self.options.get("gain", "auto")
        self.gain: float | None = None if gain == "auto" else float(gain)

    def load(self) -> None:
        import importlib.resources

        from tiny_jepa import TinyJEPA

        checkpoint = self.options.get("checkpoint")
        if checkpoint:
            self._model = TinyJEPA.load(str(checkpoint))
            return
        packaged = importlib.resources.files("tiny_jepa") / "checkpoints" / "orby_v1.npz"
        with importlib.resources.as_file(packaged) as path:
            self._model = TinyJEPA.load(str(path))

    def start(self, request: EngineRequest) -> JepaRequest:
        from tiny_jepa import OrbyWorld

        params = request.params
        env = OrbyWorld(seed=int(params.get("seed", 0)))
        num_frames = params.get("num_frames")
        return JepaRequest(
            controls=ControlState.from_params(params),
            env=env,
            latent=self.model.encode(env.render()).astype(np.float32),
            chunk_frames=_positive_int(params.get("chunk_frames", self.chunk_frames), "chunk_frames"),
            fps=float(params.get("fps", self.fps)),
            num_frames=None if num_frames is None else _positive_int(num_frames, "num_frames"),
        )

    def chunk(self, state: JepaRequest, job: ChunkJob, count: int) -> np.ndarray:
        return self._to_rgb(self._rollout(state, DIRECTIONS.index(job.direction), count))

    def _rollout(self, state: JepaRequest, action: int, count: int) -> np.ndarray:
        """``count`` frames of ``state`` under ``action``: predict, re-anchor, decode."""
        from tiny_jepa import from_patches, one_hot, to_patches

        nets = self.model.nets
        action_row = one_hot([action], len(DIRECTIONS))
        frames = []
        latent = state.latent[None]
        for _ in range(count):
            latent = nets["pred"].forward(np.concatenate([latent, action_row], axis=1)).astype(np.float32)
            state.env.step(action)
            state.frames_since_anchor += 1
            if state.frames_since_anchor >= self.reanchor_every:
                state.frames_since_anchor = 0
                observed = nets["enc"].forward(to_patches(state.env.render()[None])).astype(np.float32)
                latent = (1.0 - self.anchor_weight) * latent + self.anchor_weight * observed
            frames.append(from_patches(nets["dec"].forward(latent))[0])
        state.latent = latent[0]
        state.frames_emitted += count
        return np.stack(frames)

    def _to_rgb(self, frames: np.ndarray) -> np.ndarray:
        """[N, 32, 32] float → uint8 [N, 32, 32, 3] gray, with the configured gain."""
        if self.gain is None:
            # The decoder's picture is dim with a speckled floor: map the 70th percentile to
            # black and the peak to white, per frame.
            flat = frames.reshape(len(frames), -1)
            floor = np.percentile(flat, 70, axis=1)
            span = np.maximum(flat.max(axis=1) - floor, 0.1)
            frames = (frames - floor[:, None, None]) / span[:, None, None]
        else:
            frames = frames * self.gain
        gray = (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=-1)
