from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from runtime.kv import SessionKVStore, bind_thread_store, current_kv_store, nbytes_of

pytestmark = pytest.mark.system


def test_lru_eviction_under_a_byte_budget() -> None:
    evicted: list[str] = []
    store = SessionKVStore(100, on_evict=lambda key, _value: evicted.append(key))
    assert store.put("a", "A", nbytes=40) and store.put("b", "B", nbytes=40)
    assert store.get("a") == "A"  # a is now most recently used
    store.put("c", "C", nbytes=40)
    assert evicted == ["b"] and "b" not in store and store.used_bytes == 80
    assert store.put("huge", "H", nbytes=101) is False and "huge" not in store
    store.put("a", "A2", nbytes=10)  # replacing re-accounts
    assert store.used_bytes == 50 and store.get("a") == "A2"
    assert store.pop("c") == "C" and store.pop("c") is None
    stats = store.stats()
    assert stats["sessions"] == 1 and stats["evictions"] == 1 and stats["misses"] == 0


def test_sizes_of_arrays_and_tensors() -> None:
    assert nbytes_of(np.zeros(10, dtype=np.float32)) == 40
    assert nbytes_of([torch.zeros(2, 2), {"v": torch.zeros(4, dtype=torch.float16)}]) == 24
    store = SessionKVStore(30)
    assert store.put("s", torch.zeros(4)) and store.used_bytes == 16


def test_current_store_is_per_worker_thread() -> None:
    mine = SessionKVStore(10)
    seen: list[SessionKVStore] = []

    def worker() -> None:
        bind_thread_store(mine)
        seen.append(current_kv_store())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [mine]
    assert current_kv_store() is not mine  # this thread gets the process default
    assert current_kv_store() is current_kv_store()
