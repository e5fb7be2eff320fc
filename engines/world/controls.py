"""Per-request control input of a chunked world model: held keys, prompt, chunk demand.

A world model generates one chunk per step. What conditions that chunk (the held direction,
the prompt) is fixed when the chunk is *demanded*, not when it is computed, so the caller can
say exactly which chunk an interaction lands on:

* ``Action("keydown" | "keyup", key)`` updates the held-key state (last key pressed wins);
* ``Conditioning({"prompt": ...})`` (as an update or as an input) replaces the prompt;
* ``Action("demand", n)`` asks for ``n`` more chunks, each snapshotting the state *as of that
  input*. Inputs are read in order, so ``keydown, demand, keyup`` gives one chunk with the
  key held (a tap shorter than a chunk still moves the world by one chunk).

With ``flow="free"`` (the default when the request has a finite ``num_frames``) the model
runs without demand until ``num_frames``; with ``flow="demand"`` (what a streaming session
uses) it waits for demand, so generation follows playback instead of racing ahead of it.
Updates of a step are applied before that step's inputs: a caller that keeps at most one
chunk demanded and sends updates right before the next demand gets exact chunk boundaries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.engine import StepInput
from runtime.payloads import Action, Conditioning

DIRECTIONS = ("stay", "up", "down", "left", "right")  # tiny-jepa's action indices 0..4
DEMAND = "demand"

_KEY_DIRECTIONS = {
    "W": "up",
    "ARROWUP": "up",
    "S": "down",
    "ARROWDOWN": "down",
    "A": "left",
    "ARROWLEFT": "left",
    "D": "right",
    "ARROWRIGHT": "right",
}
#: Longest key name accepted; longer strings are not keys.
_MAX_KEY_LEN = 32


def normalize_key(key: object) -> str | None:
    """``KeyboardEvent.key``/``.code`` or a letter → ``W``, ``ARROWUP``, ...; None if not a key."""
    if not isinstance(key, str) or not key or len(key) > _MAX_KEY_LEN:
        return None
    name = key.strip().upper()
    if len(name) == 4 and name.startswith("KEY"):  # KeyboardEvent.code: "KeyW"
        name = name[3:]
    return name or None


def key_direction(key: object) -> str | None:
    """The direction a key drives (W/A/S/D and arrows), None for any other key."""
    name = normalize_key(key)
    return _KEY_DIRECTIONS.get(name) if name else None


@dataclass(slots=True)
class ChunkJob:
    """One demanded chunk and the conditioning it was demanded with."""

    index: int
    direction: str
    prompt: str
    values: dict[str, Any]


@dataclass(slots=True)
class ControlState:
    """Held keys, the current prompt and demanded chunks of one request."""

    prompt: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    free_running: bool = False
    held: list[str] = field(default_factory=list)  # normalized keys that drive a direction, press order
    jobs: deque[ChunkJob] = field(default_factory=deque)
    next_index: int = 0  # chunk index of the next demanded/generated chunk

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ControlState:
        flow = params.get("flow") or ("free" if params.get("num_frames") else "demand")
        if flow not in ("free", "demand"):
            raise ValueError(f"flow must be 'free' or 'demand', got {flow!r}")
        return cls(prompt=str(params.get("prompt") or ""), free_running=flow == "free")

    def direction(self) -> str:
        return _KEY_DIRECTIONS[self.held[-1]] if self.held else "stay"

    def absorb(self, step: StepInput) -> None:
        """Apply a step's updates, then its inputs in order (see the module docstring)."""
        for update in step.updates:
            self._condition(update)
        for item in step.inputs:
            if isinstance(item, Conditioning):
                self._condition(item)
            elif isinstance(item, Action):
                self._act(item)

    def next_job(self) -> ChunkJob | None:
        """The chunk to generate now, or None when the request waits for demand."""
        if self.jobs:
            return self.jobs.popleft()
        if self.free_running:
            return self._snapshot()
        return None

    def has_more(self) -> bool:
        return bool(self.jobs) or self.free_running

    def _condition(self, update: Conditioning) -> None:
        values = dict(update.values)
        prompt = values.pop("prompt", None)
        if prompt is not None:
            self.prompt = str(prompt)
        self.values.update(values)

    def _act(self, action: Action) -> None:
        if action.name == DEMAND:
            count = int(action.value or 1)
            for _ in range(max(count, 0)):
                self.jobs.append(self._snapshot())
            return
        key = normalize_key(action.value)
        if key not in _KEY_DIRECTIONS:
            return  # keys this model has no use for
        if key in self.held:
            self.held.remove(key)
        if action.name == "keydown":
            self.held.append(key)

    def _snapshot(self) -> ChunkJob:
        job = ChunkJob(self.next_index, self.direction(), self.prompt, dict(self.values))
        self.next_index += 1
        return job
