"""The ``mooncake`` connector: payloads in a registered pool, pulled by whoever needs them.

``put`` pickles a payload (protocol 5: array bytes out of band) and copies it into one slice of
this process's pool; the handle names the owner (``host:port`` of its transfer engine), the
slice's address and size. ``get`` in the owner copies the slice out; anywhere else it pulls the
slice into a scratch slice of its own pool through the transfer engine and decodes it there: the
payload's arrays are views of that slice, which returns to the pool (at the next call) once the
last of them is gone (at most ``lend_max`` bytes lent so, and only slices of ``LEND_MIN`` bytes
or more; else the arrays are copied out once and the slice freed at once). Payloads of at most
``inline_max`` bytes ride inline in the handle (the control message) instead.

Ownership: the owner frees a slice after its last release, or on a cleanup of its request, or
when the reaper finds it older than ``ttl_s`` (abandoned: its consumer died). Releases and
cleanups of slices another process owns go to that process through ``owners`` (the control
plane); the server's connector sends them, a stage host's receives them.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.connectors import Connector, ConnectorError, Handle, drop_reference
from runtime.payloads import Payload
from runtime.remote.histogram import Histogram
from runtime.remote.slices import ALIGN, PoolFull
from runtime.remote.transfer import TransferEndpoint, TransferError, TransferTimeout

log = logging.getLogger(__name__)

INLINE_MAX = 4096  # bytes: a handle carries payloads this small itself
LEND_MIN = 64 << 10  # a pulled slice smaller than this is copied out (cheaper than lending it)
DEFAULT_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class MooncakeRef:
    owner: str  # the owning transfer engine's "host:port"; "" for an inline payload
    address: int = 0  # of the slice in the owner's registered buffer
    nbytes: int = 0
    header: int = 0  # bytes of pickle stream at the slice's start
    buffers: tuple[tuple[int, int], ...] = ()  # (offset, length) of out-of-band buffers
    inline: bytes | None = None


class RemoteOwners(Protocol):
    """Where releases and cleanups of other processes' slices go (thread-safe, never blocks)."""

    def release(self, owner: str, handles: list[Handle]) -> None: ...

    def cleanup(self, request_id: str) -> None: ...


def encode(payload: Payload) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    return header, buffers


def _layout(header: bytes, buffers: list[pickle.PickleBuffer]) -> tuple[int, list[tuple[int, int]]]:
    offset = -(-len(header) // ALIGN) * ALIGN
    spans = []
    for buf in buffers:
        length = buf.raw().nbytes
        spans.append((offset, length))
        offset += -(-length // ALIGN) * ALIGN
    return offset, spans


def decode(data: memoryview | bytearray, ref: MooncakeRef) -> Payload:
    view = memoryview(data)
    buffers = [view[o : o + n] for o, n in ref.buffers]
    payload: Payload = pickle.loads(view[: ref.header], buffers=buffers)
    return payload


class MooncakeConnector(Connector):
    kind = "mooncake"

    def __init__(
        self,
        endpoint: TransferEndpoint,
        *,
        owners: RemoteOwners | None = None,
        inline_max: int = INLINE_MAX,
        ttl_s: float = DEFAULT_TTL_S,
        lend_max: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.owners = owners
        self.inline_max = inline_max
        self.ttl_s = ttl_s
        # bytes of pulled slices a process lets decoded payloads keep (a quarter of the pool)
        self.lend_max = endpoint.pool.size // 4 if lend_max is None else lend_max
        self._lent = 0
        self._returned: deque[tuple[int, int]] = deque()  # lent slices whose payload is gone
        self._clock = clock
        self._lock = threading.Lock()
        # request -> key -> [slice offset, refs, nbytes, created]
        self._items: dict[str, dict[str, list[Any]]] = {}
        self.stats = {"puts": 0, "inline": 0, "pulls": 0, "bytes_pulled": 0, "reaped": 0, "failures": 0}
        self.pulls: dict[str, tuple[Histogram, list[int]]] = {}  # owner -> (latency, [bytes, failures])
        self._closed = False

    @property
    def session(self) -> str:
        return self.endpoint.session

    # -- Connector ----------------------------------------------------------------------------

    def put(self, request_id: str, key: str, payload: Payload, *, refs: int = 1) -> Handle:
        self._collect()
        header, buffers = encode(payload)
        total, spans = _layout(header, buffers)
        if total <= self.inline_max:
            self.stats["inline"] += 1
            inline = pickle.dumps(payload, protocol=5) if buffers else header
            return Handle(self.kind, request_id, key, MooncakeRef("", nbytes=len(inline), inline=inline))
        pool = self.endpoint.pool
        try:
            offset = pool.alloc(total)
        except PoolFull as exc:
            raise ConnectorError(f"mooncake: {exc}") from None
        view = self.endpoint.view(offset, total)
        view[: len(header)] = header
        for (start, length), buf in zip(spans, buffers, strict=True):
            view[start : start + length] = buf.raw().cast("B")
        with self._lock:
            self._items.setdefault(request_id, {})[key] = [offset, refs, total, self._clock()]
        self.stats["puts"] += 1
        ref = MooncakeRef(self.session, self.endpoint.address(offset), total, len(header), tuple(spans))
        return Handle(self.kind, request_id, key, ref)

    def get(self, handle: Handle) -> Payload:
        ref = handle.ref
        if not isinstance(ref, MooncakeRef):
            raise ConnectorError(f"mooncake: {handle.request_id}/{handle.key} is not a mooncake handle")
        if ref.inline is not None:
            payload: Payload = pickle.loads(ref.inline)
            return payload
        if ref.owner == self.session:
            with self._lock:
                entry = self._items.get(handle.request_id, {}).get(handle.key)
                if entry is None:
                    raise ConnectorError(
                        f"mooncake: {handle.request_id}/{handle.key} is gone (released or cleaned up)"
                    )
                data = bytearray(self.endpoint.view(entry[0], ref.nbytes))
            return decode(data, ref)
        return self._pull(handle, ref)

    def _pull(self, handle: Handle, ref: MooncakeRef) -> Payload:
        self._collect()
        pool = self.endpoint.pool
        try:
            scratch = pool.alloc(ref.nbytes)
        except PoolFull as exc:
            raise ConnectorError(f"mooncake: no room to receive {ref.nbytes} B: {exc}") from None
        with self._lock:
            found = self.pulls.get(ref.owner)
            if found is None:
                found = self.pulls[ref.owner] = (Histogram(), [0, 0])
            latency, moved = found
        started = time.perf_counter()
        try:
            self.endpoint.read(ref.owner, ref.address, scratch, ref.nbytes)
        except TransferError as exc:
            if isinstance(exc, TransferTimeout):  # the engine may still write there: never reused
                log.warning("mooncake: %d B slice kept out of the pool after a timed-out pull", ref.nbytes)
            else:
                pool.free(scratch)
            with self._lock:
                self.stats["failures"] += 1
                moved[1] += 1
            raise ConnectorError(f"mooncake: {handle.request_id}/{handle.key}: {exc}") from None
        latency.observe(time.perf_counter() - started)
        with self._lock:
            self.stats["pulls"] += 1
            self.stats["bytes_pulled"] += ref.nbytes
            moved[0] += ref.nbytes
        return self._unpack(scratch, ref)

    def _unpack(self, scratch: int, ref: MooncakeRef) -> Payload:
        """Decode a pulled slice where it landed. Its out-of-band buffers (array bytes) stay in
        the slice, which goes back to the pool when the payload's last array is gone, while
        ``lend_max`` bytes allow; past that they are copied out once and the slice freed."""
        pool = self.endpoint.pool
        with self._lock:
            lend = bool(ref.buffers) and LEND_MIN <= ref.nbytes <= self.lend_max - self._lent
            if lend:
                self._lent += ref.nbytes
        if not lend:
            try:
                view = self.endpoint.view(scratch, ref.nbytes)
                if not ref.buffers:  # all in band: unpickling copies what it keeps
                    payload: Payload = pickle.loads(view[: ref.header])
                    return payload
                return decode(bytearray(view), ref)
            finally:
                pool.free(scratch)
        backing = self.endpoint.array(scratch, ref.nbytes)
        weakref.finalize(backing, self._give_back, scratch, ref.nbytes)
        return decode(backing.data, ref)

    def _give_back(self, scratch: int, nbytes: int) -> None:
        """A lent payload is gone. A finalizer: it may run in any thread, inside a collection
        triggered while this thread holds a lock, so it takes none; the next call frees it."""
        self._returned.append((scratch, nbytes))

    def _collect(self) -> None:
        while self._returned:
            try:
                scratch, nbytes = self._returned.popleft()
            except IndexError:  # another thread took the last one
                return
            with self._lock:
                self._lent -= nbytes
            self.endpoint.pool.free(scratch)

    def release(self, handle: Handle) -> bool:
        ref = handle.ref
        if not isinstance(ref, MooncakeRef) or ref.inline is not None:
            return False
        if ref.owner != self.session:
            if self.owners is not None:
                self.owners.release(ref.owner, [handle])
            return False
        with self._lock:
            entry = drop_reference(self._items, handle)
        if entry is None:
            return False
        self.endpoint.pool.free(entry[0])
        return True

    def cleanup(self, request_id: str) -> int:
        with self._lock:
            items = self._items.pop(request_id, {})
        for entry in items.values():
            self.endpoint.pool.free(entry[0])
        if self.owners is not None:
            self.owners.cleanup(request_id)
        return len(items)

    def drop(self, request_id: str) -> int:
        """Free this process's slices of ``request_id`` only (a cleanup another process asked for)."""
        with self._lock:
            items = self._items.pop(request_id, {})
        for entry in items.values():
            self.endpoint.pool.free(entry[0])
        return len(items)

    def holding(self, request_prefix: str) -> int:
        """Slices this process still owns for requests whose id starts with ``request_prefix``."""
        with self._lock:
            return sum(len(items) for r, items in self._items.items() if r.startswith(request_prefix))

    def reap(self) -> int:
        """Free slices older than ``ttl_s`` (their consumer never released them); how many."""
        self._collect()
        cutoff = self._clock() - self.ttl_s
        freed: list[int] = []
        with self._lock:
            for request_id in list(self._items):
                items = self._items[request_id]
                for key in [k for k, e in items.items() if e[3] < cutoff]:
                    freed.append(items.pop(key)[0])
                if not items:
                    del self._items[request_id]
        for offset in freed:
            self.endpoint.pool.free(offset)
        self.stats["reaped"] += len(freed)
        return len(freed)

    def health(self) -> dict[str, Any]:
        self._collect()
        with self._lock:
            entries = [e for items in self._items.values() for e in items.values()]
            requests = len(self._items)
        pool = self.endpoint.pool
        return {
            "kind": self.kind,
            "ok": not self._closed,
            "session": self.session,
            "requests": requests,
            "items": len(entries),
            "bytes": sum(e[2] for e in entries),
            "pool_bytes": pool.size,
            "pool_used_bytes": pool.used_bytes,
            "lent_bytes": self._lent,
            **self.stats,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._items.clear()
        self.endpoint.close()
