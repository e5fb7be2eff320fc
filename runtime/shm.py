"""Shared-memory connector: payload arrays live in POSIX shared-memory segments.

``put`` copies every numpy array / torch tensor inside a payload (nested in dataclass fields,
lists, tuples, dicts) into one segment, 64-byte aligned; the handle carries only the segment
name, the array layout and the payload's small remainder. ``get`` copies the arrays back out and
unmaps at once, so no mapping outlives a call and a consumer never sees memory that a later
``release`` frees.

Ownership: the connector in the orchestrator's process owns every segment's lifetime (release,
cleanup, close). A worker process gets a *producer* view (:meth:`SharedMemoryConnector.producer`)
whose segments carry a per-process name prefix; the owner adopts them when the child reports
their handles, and sweeps ``/dev/shm`` for that prefix when the child dies, so segments of a
crashed child never leak.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from runtime.connectors import Connector, ConnectorError, Handle, drop_reference
from runtime.payloads import Payload

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "odx"
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class _ArraySlot:
    index: int


@dataclass(frozen=True, slots=True)
class ArraySpec:
    offset: int
    dtype: str
    shape: tuple[int, ...]
    torch_dtype: str | None = None  # set when the value was a torch tensor


@dataclass(frozen=True, slots=True)
class ShmRef:
    segment: str | None  # None when the payload holds no arrays
    nbytes: int
    arrays: tuple[ArraySpec, ...]
    skeleton: Any  # the payload with arrays replaced by _ArraySlot markers


def _is_tensor(value: Any) -> bool:
    cls = type(value)
    return cls.__module__.startswith("torch") and cls.__name__ in ("Tensor", "Parameter")


def _rebuilt(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with each leaf replaced by what ``leaf`` makes of it (None: kept), through
    dataclasses (a changed one is a copy), lists, tuples and dicts."""
    new = leaf(value)
    if new is not None:
        return new
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            new = _rebuilt(old, leaf)
            if new is not old:
                changed[f.name] = new
        return dataclasses.replace(value, **changed) if changed else value
    if isinstance(value, list):
        return [_rebuilt(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuilt(v, leaf) for v in value)
    if isinstance(value, dict):
        return {k: _rebuilt(v, leaf) for k, v in value.items()}
    return value


def _strip(value: Any, arrays: list[tuple[np.ndarray, str | None]]) -> Any:
    """``value`` with its arrays and tensors moved to ``arrays``, each replaced by its slot."""

    def slot(leaf: Any) -> _ArraySlot | None:
        if isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject:
            arrays.append((leaf, None))
            return _ArraySlot(len(arrays) - 1)
        if _is_tensor(leaf):
            import torch

            tensor = leaf.detach().to("cpu").contiguous()
            torch_dtype = str(tensor.dtype).removeprefix("torch.")
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw bits
                tensor = tensor.view(torch.int16)
            arrays.append((tensor.numpy(), torch_dtype))
            return _ArraySlot(len(arrays) - 1)
        return None

    return _rebuilt(value, slot)


def _restore(value: Any, arrays: list[Any]) -> Any:
    """``value`` with each slot :func:`_strip` left replaced by its array again."""
    return _rebuilt(value, lambda leaf: arrays[leaf.index] if isinstance(leaf, _ArraySlot) else None)


def _to_value(array: np.ndarray, spec: ArraySpec) -> Any:
    if spec.torch_dtype is None:
        return array
    import torch

    tensor = torch.from_numpy(array)
    if spec.torch_dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def unlink_segment(name: str) -> bool:
    """Unlink one segment by name; False when it was already gone."""
    try:
        segment = SharedMemory(name=name)
    except FileNotFoundError:
        return False
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        return False
    return True


def sweep_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix`` (a dead child's leftovers)."""
    if not SHM_DIR.is_dir():
        return 0
    return sum(unlink_segment(p.name) for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


class SharedMemoryConnector(Connector):
    kind = "shm"

    def __init__(self, *, prefix: str | None = None, owner: bool = True) -> None:
        self.prefix = prefix or f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(3)}_"
        self.owner = owner
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._children = itertools.count()
        # request -> key -> [segment name | None, refs, nbytes]
        self._items: dict[str, dict[str, list[Any]]] = {}
        self._closed = False

    # -- producer views for worker processes -------------------------------------------------

    def child_prefix(self) -> str:
        """A fresh name prefix for one worker process (swept when that process dies)."""
        return f"{self.prefix}c{next(self._children)}_"

    @classmethod
    def producer(cls, prefix: str) -> SharedMemoryConnector:
        """The view a worker process uses: it creates and reads segments, the owner frees them."""
        return cls(prefix=prefix, owner=False)

    # -- Connector ----------------------------------------------------------------------------

    def put(self, request_id: str, key: str, payload: Payload, *, refs: int = 1) -> Handle:
        arrays: list[tuple[np.ndarray, str | None]] = []
        skeleton = _strip(payload, arrays)
        specs: list[ArraySpec] = []
        offset = 0
        for array, torch_dtype in arrays:
            specs.append(ArraySpec(offset, array.dtype.str, tuple(array.shape), torch_dtype))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        name: str | None = None
        if arrays:
            name = f"{self.prefix}{next(self._counter)}"
            segment = SharedMemory(name=name, create=True, size=max(offset, 1))
            try:
                for (array, _), spec in zip(arrays, specs, strict=True):
                    if array.nbytes:
                        dst = np.ndarray(array.shape, array.dtype, buffer=segment.buf, offset=spec.offset)
                        dst[...] = array
                        del dst
            finally:
                segment.close()
        handle = Handle(self.kind, request_id, key, ShmRef(name, offset, tuple(specs), skeleton))
        if self.owner:
            self.adopt(handle, refs=refs)
        return handle

    def adopt(self, handle: Handle, *, refs: int = 1) -> None:
        """Take over the lifetime of a segment a worker process created."""
        ref: ShmRef = handle.ref
        with self._lock:
            self._items.setdefault(handle.request_id, {})[handle.key] = [ref.segment, refs, ref.nbytes]

    def get(self, handle: Handle) -> Payload:
        ref = handle.ref
        if not isinstance(ref, ShmRef):
            raise ConnectorError(f"shm: {handle.request_id}/{handle.key} is not a shared-memory handle")
        if self.owner:
            with self._lock:
                known = handle.key in self._items.get(handle.request_id, {})
            if not known:
                raise ConnectorError(
                    f"shm: {handle.request_id}/{handle.key} is gone (released or cleaned up)"
                )
        values: list[Any] = []
        if ref.segment is not None:
            try:
                segment = SharedMemory(name=ref.segment)
            except FileNotFoundError:
                raise ConnectorError(f"shm: segment {ref.segment} is gone") from None
            try:
                for spec in ref.arrays:
                    dtype = np.dtype(spec.dtype)
                    if int(np.prod(spec.shape)) == 0:
                        array = np.empty(spec.shape, dtype)
                    else:
                        array = np.ndarray(spec.shape, dtype, buffer=segment.buf, offset=spec.offset).copy()
                    values.append(_to_value(array, spec))
            finally:
                segment.close()
        payload: Payload = _restore(ref.skeleton, values)
        return payload

    def release(self, handle: Handle) -> bool:
        with self._lock:
            entry = drop_reference(self._items, handle)
        if entry is None:
            return False
        if entry[0] is not None:
            unlink_segment(entry[0])
        return True

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            items = self._items.pop(request_id, {})
        for segment, _, _ in items.values():
            if segment is not None:
                unlink_segment(segment)
        return len(items)

    def health(self) -> dict[str, Any]:
        with self._lock:
            entries = [e for items in self._items.values() for e in items.values()]
            requests = len(self._items)
        return {
            "kind": self.kind,
            "ok": SHM_DIR.is_dir() and not self._closed,
            "requests": requests,
            "items": len(entries),
            "segments": sum(e[0] is not None for e in entries),
            "bytes": sum(e[2] for e in entries),
            "prefix": self.prefix,
        }

    def close(self) -> None:
        if not self.owner or self._closed:
            return
        self._closed = True
        with self._lock:
            request_ids = list(self._items)
        for request_id in request_ids:
            self.cleanup(request_id)
        sweep_segments(self.prefix)  # children's leftovers share this prefix
