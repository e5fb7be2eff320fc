"""A tiny π0-shaped policy with RANDOM weights: observation → action chunk by flow matching.

Its actions are random: the weights are seeded noise, nothing was trained. It exists so that
robot observations and action chunks travel the exact path a real π0 checkpoint's would
(openpi's wire, the session layer, batching in the runtime) on a machine with no GPU and no
model hub. The architecture keeps π0's shape at toy size:

    images  --(conv patch embedding, per-camera + position embeddings)--> image tokens
    prompt  --(UTF-8 bytes → byte embedding + positions)-----------------> prompt tokens
    state   --(linear)--> one state token;  previous chunk --(linear)--> one context token
    prefix = [image tokens, prompt tokens, state, previous chunk]: bidirectional attention,
             encoded ONCE per inference; its keys/values are cached per layer (π0's prefix KV)
    suffix = the action chunk x_t [horizon, action_dim] + the flow time t (sinusoidal → MLP):
             attends to the cached prefix and to itself; a linear head gives the velocity v
    x_1 ~ N(0, I) (seeded per session and inference);  x_{t+dt} = x_t + dt · v  for
    ``num_steps`` Euler steps from t = 1 to t = 0  →  actions [horizon, action_dim]

The previous action chunk is part of the prefix (a crude stand-in for real-time chunking's
guidance), so a session's context changes its next chunk: that is what retention must keep.
Several robots' observations run as one batch (prompt tokens padded and masked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

MAX_PROMPT_BYTES = 256


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Sizes of the tiny policy; what the server's metadata frame advertises comes from here."""

    image_keys: tuple[str, ...] = ("observation/image", "observation/wrist_image")
    state_key: str = "observation/state"
    prompt_key: str = "prompt"
    image_size: int = 64  # square RGB images, uint8 [H, W, 3]
    patch: int = 16
    state_dim: int = 8
    action_dim: int = 7
    horizon: int = 50
    dim: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 2
    max_prompt_tokens: int = 48
    num_steps: int = 5  # flow-matching Euler steps
    weight_seed: int = 0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PolicyConfig:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in options.items() if k in known}
        if "image_keys" in values:
            values["image_keys"] = tuple(values["image_keys"])
        config = cls(**values)
        if config.image_size % config.patch:
            raise ValueError(f"image_size {config.image_size} is not a multiple of patch {config.patch}")
        if config.dim % config.heads:
            raise ValueError(f"dim {config.dim} is not a multiple of heads {config.heads}")
        if min(config.state_dim, config.action_dim, config.horizon, config.num_steps) <= 0:
            raise ValueError("state_dim, action_dim, horizon and num_steps must be positive")
        return config

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass(slots=True)
class PolicyInput:
    """One robot's observation as the model takes it (already validated by the session)."""

    images: list[np.ndarray]  # per image key, uint8 [H, W, 3]
    state: np.ndarray  # float32 [state_dim]
    prompt: str
    previous: np.ndarray | None  # float32 [horizon, action_dim]: the chunk sent before
    noise_seed: int  # seeds x_1: the same seed and inputs give the same chunk
    prompt_tokens: Any = field(default=None)  # cached torch.Tensor of the prompt's bytes


def prompt_tokens(prompt: str, limit: int) -> Any:
    import torch

    data = prompt.encode("utf-8")[:limit] or b"\0"
    return torch.tensor(list(data), dtype=torch.long)


def build_model(config: PolicyConfig) -> Any:
    """The tiny π0-shaped network with seeded random weights (the global RNG is left alone)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    dim, heads = config.dim, config.heads

    class Block(nn.Module):
        """Pre-norm attention + MLP. Prefix tokens attend among themselves; suffix tokens attend
        to the cached prefix keys/values and to each other (π0's prefix-LM attention)."""

        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            hidden = config.mlp_ratio * dim
            self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

        def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            return q, k, v

        def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
            b, _, n, _ = attended.shape
            x = x + self.proj(attended.transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.norm2(x))

        def prefix(
            self, x: torch.Tensor, mask: torch.Tensor
        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            q, k, v = self._split(x)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
            return self._finish(x, attended), (k, v)

        def suffix(
            self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
        ) -> torch.Tensor:
            q, k, v = self._split(x)
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
            full = torch.cat([mask, mask.new_ones(mask.shape[0], x.shape[1])], dim=1)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=full[:, None, None, :])
            return self._finish(x, attended)

    class Pi0Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cams = len(config.image_keys)
            self.patch_embed = nn.Conv2d(3, dim, config.patch, stride=config.patch)
            self.camera = nn.Parameter(torch.randn(cams, 1, dim) * 0.02)
            self.image_position = nn.Parameter(torch.randn(config.patches, dim) * 0.02)
            self.byte_embedding = nn.Embedding(256, dim)
            self.prompt_position = nn.Parameter(torch.randn(config.max_prompt_tokens, dim) * 0.02)
            self.state_proj = nn.Linear(config.state_dim, dim)
            self.previous_proj = nn.Linear(config.horizon * config.action_dim, dim)
            self.action_in = nn.Linear(config.action_dim, dim)
            self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
            self.action_position = nn.Parameter(torch.randn(config.horizon, dim) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(config.layers))
            self.norm = nn.LayerNorm(dim)
            self.action_out = nn.Linear(dim, config.action_dim)

        def encode_prefix(
            self,
            images: torch.Tensor,
            prompts: torch.Tensor,
            prompt_mask: torch.Tensor,
            state: torch.Tensor,
            previous: torch.Tensor,
        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
            """images [B, cams, 3, H, W] in [-1, 1], prompts [B, P] bytes, prompt_mask [B, P],
            state [B, state_dim], previous [B, horizon*action_dim] → per-layer (k, v), mask."""
            b, cams = images.shape[:2]
            patches = self.patch_embed(images.flatten(0, 1)).flatten(2).transpose(1, 2)  # [B*cams, N, dim]
            patches = patches.view(b, cams, -1, dim) + self.camera + self.image_position
            tokens = [
                patches.reshape(b, -1, dim),
                self.byte_embedding(prompts) + self.prompt_position[: prompts.shape[1]],
                self.state_proj(state)[:, None],
                self.previous_proj(previous)[:, None],
            ]
            x = torch.cat(tokens, dim=1)
            ones = prompt_mask.new_ones(b, patches.shape[1] * patches.shape[2])
            mask = torch.cat([ones, prompt_mask, prompt_mask.new_ones(b, 2)], dim=1)
            cache = []
            for block in self.blocks:
                x, kv = cast(Block, block).prefix(x, mask)
                cache.append(kv)
            return cache, mask

        def velocity(
            self,
            x_t: torch.Tensor,
            t: float,
            cache: list[tuple[torch.Tensor, torch.Tensor]],
            mask: torch.Tensor,
        ) -> torch.Tensor:
            half = dim // 2
            freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)
            angle = t * 1000.0 * freqs
            time = self.time_mlp(torch.cat([angle.sin(), angle.cos()]))
            h = self.action_in(x_t) + self.action_position + time
            for block, kv in zip(self.blocks, cache, strict=True):
                h = cast(Block, block).suffix(h, kv, mask)
            return self.action_out(self.norm(h))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.weight_seed)
        return Pi0Tiny().eval()


def infer_chunks(model: Any, config: PolicyConfig, batch: list[PolicyInput]) -> list[np.ndarray]:
    """One action chunk per input, float32 [horizon, action_dim], all of the batch in one pass
    (prefix encoded once, then ``num_steps`` Euler steps of the action expert)."""
    import torch

    with torch.inference_mode():
        images = torch.from_numpy(np.stack([np.stack(item.images) for item in batch]))  # [B, cams, H, W, 3]
        images = images.permute(0, 1, 4, 2, 3).float().div_(127.5).sub_(1.0)
        tokens = []
        for item in batch:
            if item.prompt_tokens is None:
                item.prompt_tokens = prompt_tokens(
                    item.prompt, min(config.max_prompt_tokens, MAX_PROMPT_BYTES)
                )
            tokens.append(item.prompt_tokens)
        longest = max(len(t) for t in tokens)
        prompts = torch.zeros(len(batch), longest, dtype=torch.long)
        prompt_mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for row, t in enumerate(tokens):
            prompts[row, : len(t)] = t
            prompt_mask[row, : len(t)] = True
        state = torch.from_numpy(np.stack([item.state for item in batch]).astype(np.float32))
        size = config.horizon * config.action_dim
        previous = torch.from_numpy(
            np.stack(
                [
                    np.zeros(size, np.float32) if item.previous is None else item.previous.reshape(size)
                    for item in batch
                ]
            ).astype(np.float32)
        )
        cache, mask = model.encode_prefix(images, prompts, prompt_mask, state, previous)
        noise = [
            torch.randn(
                config.horizon, config.action_dim, generator=torch.Generator().manual_seed(item.noise_seed)
            )
            for item in batch
        ]
        x = torch.stack(noise)
        dt = -1.0 / config.num_steps
        t = 1.0
        for _ in range(config.num_steps):
            x = x + dt * model.velocity(x, t, cache, mask)
            t += dt
        return [row.numpy().astype(np.float32) for row in x]
