"""``world.tiny_video_random``: a text-conditioned causal video generator with tiny RANDOM weights.

Its frames are noise: the weights are random (seeded), nothing was trained. It exists so that
prompt updates and actions travel the exact path a real causal video model's would, on a
machine with no GPU and no model hub:

    prompt --(UTF-8 bytes → byte embedding → mean pool → projection)--> conditioning vector
    rolling context: the latents of the last ``context_frames`` frames
    causal transformer over [conditioning, context...] → next latent (+ seeded noise)
    decoder: latent → 8×8×3 → ×4 nearest → 32×32 RGB

One step generates one chunk of ``chunk_frames`` frames autoregressively for every request of
the batch (request by request: batch-invariant output); the prompt (and held key, as an action
embedding) in force when the chunk was demanded conditions the whole chunk (see
:mod:`engines.world.controls`), so an update changes the output from the next chunk on and
never earlier. Deterministic for a ``seed``.

Options: ``chunk_frames`` (2), ``fps`` (30), ``context_frames`` (8), ``dim`` (64),
``layers`` (2), ``weight_seed`` (0), ``noise`` (0.3), ``num_threads`` (1: torch's intra-op
threads, process-wide, as the tiny Qwen3-Omni engine sets them; with two threads a 9×64 matmul
took tens of ms on a busy 2-core machine, waiting on the thread pool). Request params:
``prompt``, ``seed``, ``chunk_frames``, ``fps``, ``num_frames``, ``flow``.
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

SIZE = 32
_LATENT_SIDE = 8
_MAX_PROMPT_BYTES = 512


@dataclass(slots=True, kw_only=True)
class VideoRequest(ChunkedRequest):
    generator: Any  # torch.Generator: this request's noise
    context: Any  # torch.Tensor [context_frames, dim]: the rolling latent context
    prompt: str | None = None  # prompt of the cached conditioning vector
    conditioning: Any = None  # torch.Tensor [dim]


def _build_model(dim: int, layers: int, context: int, seed: int) -> Any:
    import torch
    from torch import nn

    class CausalVideoModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.byte_embedding = nn.Embedding(256, dim)
            self.text_projection = nn.Linear(dim, dim)
            self.action_embedding = nn.Embedding(len(DIRECTIONS), dim)
            self.position = nn.Parameter(torch.randn(context + 1, dim) * 0.1)
            layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=dim * 2, batch_first=True)
            self.backbone = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
            self.head = nn.Linear(dim, dim)
            self.decoder = nn.Linear(dim, 3 * _LATENT_SIDE * _LATENT_SIDE)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context + 1))

        def encode_prompt(self, prompt: str) -> torch.Tensor:
            data = prompt.encode("utf-8")[:_MAX_PROMPT_BYTES] or b"\0"
            tokens = torch.tensor(list(data), dtype=torch.long)
            return torch.tanh(self.text_projection(self.byte_embedding(tokens).mean(dim=0)))

        def next_latent(self, cond: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            """cond [B, dim], context [B, T, dim] → predicted next latent [B, dim]."""
            seq = torch.cat([cond[:, None, :], context], dim=1) + self.position
            hidden = self.backbone(seq, mask=self.mask, is_causal=True)
            return torch.tanh(self.head(hidden[:, -1]))

        def decode(self, latent: torch.Tensor) -> torch.Tensor:
            """latent [B, dim] → uint8 frames [B, 32, 32, 3]."""
            img = torch.sigmoid(self.decoder(latent) * 3.0).view(-1, 3, _LATENT_SIDE, _LATENT_SIDE)
            img = torch.nn.functional.interpolate(img, scale_factor=SIZE // _LATENT_SIDE, mode="nearest")
            return (img.permute(0, 2, 3, 1) * 255.0 + 0.5).to(torch.uint8)

    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the global RNG
        torch.manual_seed(seed)
        return CausalVideoModel().eval()


class TinyVideoRandomEngine(ChunkedWorldEngine[VideoRequest]):
    """A tiny random-weight causal video model (its frames are noise; see the module docstring)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.chunk_frames = int(self.options.get("chunk_frames", 2))
        self.fps = float(self.options.get("fps", 30.0))
        self.context_frames = int(self.options.get("context_frames", 8))
        self.dim = int(self.options.get("dim", 64))
        self.layers = int(self.options.get("layers", 2))
        self.weight_seed = int(self.options.get("weight_seed", 0))
        self.noise = float(self.options.get("noise", 0.3))
        self.num_threads = int(self.options.get("num_threads", 1))

    def load(self) -> None:
        import torch

        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        self._model = _build_model(self.dim, self.layers, self.context_frames, self.weight_seed)

    def start(self, request: EngineRequest) -> VideoRequest:
        import torch

        params = request.params
        generator = torch.Generator().manual_seed(int(params.get("seed", 0)))
        context = torch.randn(self.context_frames, self.dim, generator=generator) * 0.5
        num_frames = params.get("num_frames")
        chunk_frames = int(params.get("chunk_frames", self.chunk_frames))
        if chunk_frames <= 0 or (num_frames is not None and int(num_frames) <= 0):
            raise ValueError("chunk_frames and num_frames must be positive")
        return VideoRequest(
            controls=ControlState.from_params(params),
            generator=generator,
            context=context,
            chunk_frames=chunk_frames,
            fps=float(params.get("fps", self.fps)),
            num_frames=None if num_frames is None else int(num_frames),
        )

    def generate(self, work: list[tuple[VideoRequest, ChunkJob]]) -> dict[int, tuple[np.ndarray, int]]:
        import torch

        with torch.inference_mode():
            return super().generate(work)

    def chunk(self, state: VideoRequest, job: ChunkJob, count: int) -> np.ndarray:
        import torch

        model = self.model
        if state.conditioning is None or state.prompt != job.prompt:
            state.conditioning = model.encode_prompt(job.prompt)
            state.prompt = job.prompt
        action = torch.tensor([DIRECTIONS.index(job.direction)])
        cond = state.conditioning[None] + model.action_embedding(action)
        frames = []
        for _ in range(count):
            latent = model.next_latent(cond, state.context[None])
            latent = latent + self.noise * torch.randn(1, self.dim, generator=state.generator)
            frames.append(model.decode(latent)[0])
            state.context = torch.cat([state.context[1:], latent], dim=0)
        state.frames_emitted += count
        return torch.stack(frames).numpy()
