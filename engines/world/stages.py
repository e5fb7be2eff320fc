"""Engines of the world pipelines, by entry-point name (``omniduplex.engines``):

* ``world.tiny_jepa`` → :class:`TinyJepaEngine`: the pretrained tiny-jepa world model, chunked;
* ``world.tiny_video_random`` → :class:`TinyVideoRandomEngine`: a random-weight, text-conditioned
  causal video model (noise frames; it exercises the prompt-update path);
* ``world.frame_decode`` → :class:`FrameDecodeEngine`: upscales frames for the client.

A real world model (a causal diffusion model on a GPU) fits the same contract: ``start`` builds
its rolling context (KV cache / latent history) for the request, ``step`` consumes the
demand/key/prompt inputs with :class:`~engines.world.controls.ControlState` and denoises one
chunk for the batch, emitting ``Frames`` (or ``Latents`` for a separate VAE-decode stage).
"""

from __future__ import annotations

from engines.world.frame_decode import FrameDecodeEngine
from engines.world.tiny_jepa import TinyJepaEngine
from engines.world.tiny_video_random import TinyVideoRandomEngine

__all__ = ["FrameDecodeEngine", "TinyJepaEngine", "TinyVideoRandomEngine"]
