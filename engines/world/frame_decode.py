"""``world.frame_decode``: upscales a world model's frames to the size the client asked for.

Takes the ``Frames`` chunks arriving on its edge and emits client-visible ``Frames`` of
``width``×``height`` (request params; defaults from the options) with the chunk's
``chunk_index`` and ``fps`` kept. ``upscale`` is ``nearest`` (crisp pixels; numpy gather)
or ``bilinear`` (torch). Batchable: every chunk of the batch that shares a source size,
target size and mode is resized in one call.

Options: ``width`` (256), ``height`` (256), ``upscale`` ("nearest"), ``max_side`` (2048).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import Frames

MODES = ("nearest", "bilinear")


@dataclass(slots=True, frozen=True)
class DecodeTarget:
    width: int
    height: int
    mode: str


@lru_cache(maxsize=64)
def _nearest_index(src: int, dst: int) -> np.ndarray:
    """Source row/column for every destination row/column (pixel centres, like PIL's NEAREST)."""
    centres = (np.arange(dst) + 0.5) * src / dst
    return np.minimum(centres.astype(np.int64), src - 1)


def resize_frames(frames: np.ndarray, target: DecodeTarget) -> np.ndarray:
    """uint8 [N, h, w, 3] → uint8 [N, height, width, 3]."""
    _, h, w, _ = frames.shape
    if (h, w) == (target.height, target.width):
        return frames
    if target.mode == "nearest":
        rows = _nearest_index(h, target.height)
        cols = _nearest_index(w, target.width)
        return np.take(np.take(frames, rows, axis=1), cols, axis=2)  # faster than fancy indexing
    import torch

    with torch.inference_mode():
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
        y = torch.nn.functional.interpolate(
            x, size=(target.height, target.width), mode="bilinear", align_corners=False
        )
        return y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


class FrameDecodeEngine(Engine):
    """Upscale stage between a world model and the client (see the module docstring)."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.width = int(self.options.get("width", 256))
        self.height = int(self.options.get("height", 256))
        self.mode = str(self.options.get("upscale", "nearest"))
        self.max_side = int(self.options.get("max_side", 2048))

    def start(self, request: EngineRequest) -> DecodeTarget:
        params = request.params
        target = DecodeTarget(
            width=int(params.get("width") or self.width),
            height=int(params.get("height") or self.height),
            mode=str(params.get("upscale") or self.mode),
        )
        if target.mode not in MODES:
            raise ValueError(f"upscale must be one of {MODES}, got {target.mode!r}")
        for side in (target.width, target.height):
            if not 1 <= side <= self.max_side:
                raise ValueError(f"width and height must lie in 1..{self.max_side}, got {side}")
        return target

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        pending: list[tuple[int, Frames]] = [
            (row, item)
            for row, step in enumerate(batch)
            for chunk in step.chunks
            for item in chunk.items
            if isinstance(item, Frames)
        ]
        groups: dict[tuple[tuple[int, ...], DecodeTarget], list[int]] = {}
        for at, (row, item) in enumerate(pending):
            groups.setdefault((item.frames.shape, batch[row].state), []).append(at)
        resized: list[np.ndarray] = [np.empty(0, np.uint8)] * len(pending)
        for (_, target), members in groups.items():
            out = resize_frames(np.concatenate([pending[at][1].frames for at in members]), target)
            offset = 0
            for at in members:
                count = len(pending[at][1].frames)
                resized[at] = out[offset : offset + count]
                offset += count
        outputs = [StepOutput() for _ in batch]
        for (row, item), frames in zip(pending, resized, strict=True):
            outputs[row].client.append(Frames(frames=frames, fps=item.fps, chunk_index=item.chunk_index))
        for output, step in zip(outputs, batch, strict=True):
            output.done = step.upstream_finished
            output.wait_for_input = not output.done
        return outputs
