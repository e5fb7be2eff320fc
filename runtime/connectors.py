"""Connectors move payloads between stages; the control plane only carries their handles.

The interface is semantics-agnostic: ``put`` stores a payload for a request and returns a small
picklable :class:`Handle`, ``get`` returns the payload, ``release`` drops one reference (an edge
releases a handle once no later chunk can reference it), ``cleanup`` frees everything a request
still holds (cancel, failure, completion) and returns how many items it freed, ``health`` reports.
Connectors are thread-safe: stage workers put and get from their own threads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from runtime.payloads import Payload


class ConnectorError(LookupError):
    """A handle whose data is gone (released, cleaned up) or belongs to another connector."""


@dataclass(frozen=True, slots=True)
class Handle:
    kind: str  # connector kind that stored it ("inproc", "shm")
    request_id: str
    key: str  # unique within the request
    ref: Any = None  # backend metadata (shared memory: segment name and array layout)


def drop_reference(store: dict[str, dict[str, list[Any]]], handle: Handle) -> list[Any] | None:
    """Count one release in a ``request -> key -> [data, refs, ...]`` table (its lock held).

    Returns the entry when that was its last reference (it is then removed, and the request with
    it once empty); None while references remain or when the handle is unknown.
    """
    items = store.get(handle.request_id)
    entry = items.get(handle.key) if items else None
    if items is None or entry is None:
        return None
    entry[1] -= 1
    if entry[1] > 0:
        return None
    del items[handle.key]
    if not items:
        del store[handle.request_id]
    return entry


class Connector(ABC):
    kind: str = ""

    @abstractmethod
    def put(self, request_id: str, key: str, payload: Payload, *, refs: int = 1) -> Handle:
        """Store ``payload``; it stays until ``refs`` releases or a cleanup of the request."""

    @abstractmethod
    def get(self, handle: Handle) -> Payload:
        """The payload behind ``handle`` (raises :class:`ConnectorError` when it is gone)."""

    @abstractmethod
    def release(self, handle: Handle) -> bool:
        """Drop one reference; True when that freed the data. Unknown handles are ignored."""

    @abstractmethod
    def cleanup(self, request_id: str) -> int:
        """Free everything still stored for ``request_id``; the number of items freed."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Plain-data status: ``ok``, ``items``, ``requests``, ``bytes`` (where known)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free everything (the runtime calls this on shutdown)."""


class InProcessConnector(Connector):
    """Same-process hand-over by reference: no copy, no serialisation."""

    kind = "inproc"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[str, dict[str, list[Any]]] = {}  # request -> key -> [payload, refs]

    def put(self, request_id: str, key: str, payload: Payload, *, refs: int = 1) -> Handle:
        with self._lock:
            self._store.setdefault(request_id, {})[key] = [payload, refs]
        return Handle(self.kind, request_id, key)

    def get(self, handle: Handle) -> Payload:
        with self._lock:
            entry = self._store.get(handle.request_id, {}).get(handle.key)
        if entry is None:
            raise ConnectorError(f"inproc: {handle.request_id}/{handle.key} is gone (released or cleaned up)")
        payload: Payload = entry[0]
        return payload

    def release(self, handle: Handle) -> bool:
        with self._lock:
            return drop_reference(self._store, handle) is not None

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            return len(self._store.pop(request_id, {}))

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {
                "kind": self.kind,
                "ok": True,
                "requests": len(self._store),
                "items": sum(len(v) for v in self._store.values()),
            }

    def close(self) -> None:
        with self._lock:
            self._store.clear()
