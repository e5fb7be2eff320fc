"""Edge policies, pure: which items go downstream when, with which context.

Both collectors work on opaque items (connector handles in the runtime, ints in tests) and
say, per chunk, which items nothing will reference after that chunk has been consumed
(``release``), so the connector data behind them can be freed early.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from runtime.spec import ChunkPolicy

T = TypeVar("T")


@dataclass(slots=True)
class Chunk(Generic[T]):
    items: list[T]
    context: list[T] = field(default_factory=list)
    finished: bool = False
    index: int = 0
    release: list[T] = field(default_factory=list)  # unreferenced once this chunk is consumed


class _Collector(ABC, Generic[T]):
    """What both modes share: the items not handed on yet, and no input once finished."""

    def __init__(self) -> None:
        self._pending: list[T] = []
        self._finished = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    def push(self, item: T) -> list[Chunk[T]]:
        return self.extend([item])

    def extend(self, items: list[T]) -> list[Chunk[T]]:
        self._check_open()
        self._pending.extend(items)
        return self._ready()

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("edge already finished")

    @abstractmethod
    def _ready(self) -> list[Chunk[T]]:
        """The chunks the pending items make now (taken out of them)."""


class AsyncChunker(_Collector[T]):
    """async_chunk: ``first`` items, then every ``steady`` items, with ``left_context`` before."""

    def __init__(self, policy: ChunkPolicy) -> None:
        super().__init__()
        self.policy = policy
        self._tail: deque[T] = deque()
        self._index = 0

    def _ready(self) -> list[Chunk[T]]:
        chunks: list[Chunk[T]] = []
        while True:
            size = self.policy.first if self._index == 0 else self.policy.steady
            if len(self._pending) < size:
                return chunks
            taken, self._pending = self._pending[:size], self._pending[size:]
            chunks.append(self._emit(taken, finished=False))

    def finish(self) -> Chunk[T]:
        """The remainder (possibly empty) with ``finished=True``; releases everything."""
        self._check_open()
        taken, self._pending = self._pending, []
        chunk = self._emit(taken, finished=True)
        self._finished = True
        return chunk

    def _emit(self, items: list[T], *, finished: bool) -> Chunk[T]:
        context = list(self._tail)
        release: list[T] = []
        if finished:
            release = [*context, *items]
            self._tail.clear()
        else:
            self._tail.extend(items)
            while len(self._tail) > self.policy.left_context:
                release.append(self._tail.popleft())
        chunk = Chunk(items, context, finished, self._index, release)
        self._index += 1
        return chunk


class FullCollector(_Collector[T]):
    """full: nothing until upstream is done, then one finished chunk with every item."""

    def _ready(self) -> list[Chunk[T]]:
        return []

    def finish(self) -> Chunk[T]:
        self._check_open()
        self._finished = True
        items, self._pending = self._pending, []
        return Chunk(items, [], True, 0, list(items))


def make_collector(mode: str, policy: ChunkPolicy) -> AsyncChunker[T] | FullCollector[T]:
    if mode == "async_chunk":
        return AsyncChunker(policy)
    if mode == "full":
        return FullCollector()
    raise ValueError(f"unknown edge mode {mode!r}")


class EdgeGate(Generic[T]):
    """One request's switch on a gated edge (``EdgeSpec.gated``): closed at admission. While it
    is closed, what the upstream stage hands the edge goes nowhere (``admit`` returns nothing
    and names the items to release at once): the downstream stage is neither given the items
    nor stepped for them. The request's owner opens and closes it (``Orchestrator.open_edge``);
    items already handed over stay where they are."""

    def __init__(self) -> None:
        self.open = False
        self.dropped = 0  # items not handed over while closed

    def admit(self, items: list[T]) -> tuple[list[T], list[T]]:
        """(items to hand over, items to release now)."""
        if self.open:
            return items, []
        self.dropped += len(items)
        return [], items
