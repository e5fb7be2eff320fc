"""What the world models share: a request's chunk plan, and the step that answers each control
job (:mod:`engines.world.controls`) with one chunk of frames.

Requests run one by one through the model: batched matmuls round differently with the batch
size, and a session's frames must not depend on who shared its step (batch invariance; the
step still amortizes scheduling). A model gives :meth:`ChunkedWorldEngine.chunk`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from engines.world.controls import ChunkJob, ControlState
from runtime.engine import Engine, StepInput, StepOutput
from runtime.payloads import Frames


@dataclass(slots=True, kw_only=True)
class ChunkedRequest:
    """A request's controls and how many frames it gets, chunk by chunk."""

    controls: ControlState
    chunk_frames: int
    fps: float
    num_frames: int | None  # None: until the session ends
    frames_emitted: int = 0

    def frames_left(self) -> int | None:
        return None if self.num_frames is None else self.num_frames - self.frames_emitted

    def next_chunk_frames(self) -> int:
        left = self.frames_left()
        return self.chunk_frames if left is None else min(self.chunk_frames, left)


R = TypeVar("R", bound=ChunkedRequest)


class ChunkedWorldEngine(Engine, Generic[R]):
    """A world model answering control jobs chunk by chunk (module docstring); ``load`` sets
    the model."""

    batchable = True
    _model: Any = None

    @property
    def model(self) -> Any:
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.load() must run before the first request")
        return self._model

    @abstractmethod
    def chunk(self, state: R, job: ChunkJob, count: int) -> np.ndarray:
        """The next ``count`` frames of ``state`` under ``job``: uint8 ``[count, H, W, 3]``."""

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        states: list[R] = [item.state for item in batch]
        work: list[tuple[R, ChunkJob]] = []
        for item, state in zip(batch, states, strict=True):
            state.controls.absorb(item)
            job = state.controls.next_job()
            if job is not None:
                work.append((state, job))
        chunks = self.generate(work) if work else {}
        outputs = []
        for state in states:
            out = StepOutput()
            chunk = chunks.get(id(state))
            if chunk is not None:
                out.downstream.append(Frames(frames=chunk[0], fps=state.fps, chunk_index=chunk[1]))
            left = state.frames_left()
            out.done = left is not None and left <= 0
            out.wait_for_input = not out.done and not state.controls.has_more()
            outputs.append(out)
        return outputs

    def generate(self, work: list[tuple[R, ChunkJob]]) -> dict[int, tuple[np.ndarray, int]]:
        """One chunk (frames, the job's index) per request of ``work``, by ``id`` of its state."""
        out: dict[int, tuple[np.ndarray, int]] = {}
        for state, job in work:
            count = state.next_chunk_frames()
            if count > 0:
                out[id(state)] = (self.chunk(state, job, count), job.index)
        return out
