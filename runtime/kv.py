"""Per-replica retention of session state (KV caches, rolling contexts) between requests.

Each stage replica owns one :class:`SessionKVStore` with the byte budget of its stage
(``budget.kv_bytes``). Sticky assignment sends a session's later requests to the same replica,
so an engine can keep, say, the thinker's KV cache of a conversation and prefill only new tokens:

    from runtime.kv import current_kv_store

    store = current_kv_store()          # inside Engine.__init__/load/start/step/finish
    cached = store.get(session_key)     # None after eviction: rebuild from the history
    store.put(session_key, kv, nbytes=kv_bytes)

The store is bound to the replica's worker threads (or its worker process), so
:func:`current_kv_store` needs no arguments. Outside a worker (a unit test driving an engine
directly) it returns a process-wide default store. Least recently used sessions are evicted
first when the budget is exceeded; an entry bigger than the whole budget is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

DEFAULT_BUDGET = 256 * 1024 * 1024


def nbytes_of(value: Any) -> int:
    """Best-effort size of arrays/tensors inside ``value`` (nested lists, tuples, dicts)."""
    if hasattr(value, "nbytes") and isinstance(value.nbytes, int):
        return int(value.nbytes)
    if hasattr(value, "element_size") and hasattr(value, "nelement"):
        return int(value.element_size() * value.nelement())
    if isinstance(value, list | tuple):
        return sum(nbytes_of(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes_of(v) for v in value.values())
    for attr in ("key_cache", "value_cache", "layers"):  # transformers Cache objects
        if hasattr(value, attr):
            return nbytes_of(getattr(value, attr))
    return 0


class SessionKVStore:
    """LRU by session key under a byte budget; thread-safe."""

    def __init__(
        self, budget_bytes: int = DEFAULT_BUDGET, *, on_evict: Callable[[str, Any], None] | None = None
    ) -> None:
        self.budget_bytes = budget_bytes
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: Any, *, nbytes: int | None = None) -> bool:
        """Keep ``value`` for ``key``; False when it alone exceeds the budget (not kept)."""
        size = nbytes_of(value) if nbytes is None else nbytes
        evicted: list[tuple[str, Any]] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old[1]
            if size > self.budget_bytes:
                return False
            self._entries[key] = (value, size)
            self._used += size
            while self._used > self.budget_bytes:
                victim, (victim_value, victim_size) = self._entries.popitem(last=False)
                self._used -= victim_size
                self.evictions += 1
                evicted.append((victim, victim_value))
        if self._on_evict is not None:
            for victim, victim_value in evicted:
                self._on_evict(victim, victim_value)
        return True

    def pop(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self._used -= entry[1]
            return entry[0]

    def entries(self) -> list[tuple[str, Any, int]]:
        """Every entry as (key, value, nbytes), least recently used first (a drain hands them on)."""
        with self._lock:
            return [(key, value, size) for key, (value, size) in self._entries.items()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "sessions": len(self._entries),
                "used_bytes": self._used,
                "budget_bytes": self.budget_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }


_local = threading.local()
_process_store: SessionKVStore | None = None
_default_store: SessionKVStore | None = None
_default_lock = threading.Lock()


def bind_thread_store(store: SessionKVStore | None) -> None:
    """Bind ``store`` to the calling thread (the runtime does this on each worker thread)."""
    _local.store = store


def bind_process_store(store: SessionKVStore | None) -> None:
    """Bind ``store`` to the whole process (the runtime does this in a worker process)."""
    global _process_store
    _process_store = store


def current_kv_store() -> SessionKVStore:
    """The store of the replica running this code (see the module docstring)."""
    store = getattr(_local, "store", None)
    if store is None:
        store = _process_store
    if store is not None:
        return store
    global _default_store
    with _default_lock:
        if _default_store is None:
            _default_store = SessionKVStore()
        return _default_store
