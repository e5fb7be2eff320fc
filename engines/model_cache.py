"""One loaded model per process and key: engines share weights across the stages that use them.

Loading a model takes seconds and hundreds of megabytes; every stage of a pipeline that names
the same configuration gets the same object. The lock is held while loading so two stages
starting together load once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ModelCache(Generic[K, V]):
    """Process-wide models by key, each loaded by the first caller that asks for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[K, V] = {}

    def get(self, key: K, load: Callable[[], V]) -> V:
        """The model stored under ``key``; ``load()`` builds it when there is none yet."""
        with self._lock:
            model = self._models.get(key)
            if model is None:
                model = load()
                self._models[key] = model
            return model
