"""One Mooncake transfer engine per process, with one registered, bounded buffer.

P2PHANDSHAKE mode (no metadata server: a peer's segment is found by asking the peer itself at
``host:rpc_port``) over TCP, or RDMA where the host has it. The engine aborts the whole process
on a malformed local address, so the address is checked here first. The engine releases the
GIL while it moves bytes; every call here is blocking and belongs on a worker thread.

The transfer engine has no authentication: anyone who reaches its port can read and write the
registered buffer. It must only listen on a private network (docs/scaleout.md).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from runtime.remote.slices import SlicePool

log = logging.getLogger(__name__)

METADATA = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")
SPIN_S = 100e-6  # a transfer's first status checks run back to back (a 16 KiB pull takes ~60 µs)
PAUSE_MIN_S = 20e-6  # then sleep between checks, doubling up to
PAUSE_MAX_S = 200e-6
SYNC_MAX = 256 << 10  # reads up to this size use the engine's blocking read (its spin is short)
SPLITS = 4  # a large read goes as this many concurrent parts, each of at least
SPLIT_MIN = 1 << 20


class TransferError(RuntimeError):
    """The transfer engine could not start, or a transfer failed (the peer is gone)."""


class TransferTimeout(TransferError):
    """A transfer did not finish in time; the engine may still write to its destination."""


def check_local_address(host: str) -> str:
    """``host`` as the engine wants it (an IP literal); a clear error instead of an abort."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise TransferError(f"transfer engine address {host!r} is not an IP address") from None
    if address.is_unspecified or address.is_multicast:
        raise TransferError(f"transfer engine address {host!r} is not a unicast address a peer can reach")
    return str(address)


def check_peer(session: str) -> tuple[str, int]:
    """A peer's ``host:port`` segment name, parsed; TransferError when malformed."""
    host, sep, port = session.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"transfer peer {session!r} is not host:port")
    return check_local_address(host.strip("[]")), int(port)


class TransferEndpoint:
    """This process's engine and its registered buffer, carved into slices by a SlicePool."""

    def __init__(
        self,
        host: str,
        pool_bytes: int,
        *,
        protocol: str = "tcp",
        splits: int = SPLITS,
        split_min: int = SPLIT_MIN,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise TransferError(f"transfer protocol must be one of {PROTOCOLS}, not {protocol!r}")
        host = check_local_address(host)
        os.environ.setdefault("GLOG_minloglevel", "2")  # the engine's INFO/WARNING lines
        # A transfer to a peer that stopped answering gives up instead of waiting on it. (The
        # engine's RPC and data ports listen on every interface whatever address it is given:
        # checked with 0.3.13.post1; docs/scaleout.md says what that means for the network.)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
        timeout = os.environ["MC_TRANSFER_TIMEOUT"]
        try:
            self.timeout_s = float(timeout)
        except ValueError:
            raise TransferError(f"MC_TRANSFER_TIMEOUT={timeout!r} is not a number of seconds") from None
        self.splits = max(1, splits)
        self.split_min = max(1, split_min)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the wheel, or libibverbs1 under it, is missing
            raise TransferError(f"Mooncake transfer engine unavailable: {exc}") from exc
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, METADATA, protocol, "")
        if rc != 0:
            raise TransferError(f"transfer engine did not start on {host} ({protocol}): code {rc}")
        self.host = host
        self.port = int(self._engine.get_rpc_port())
        self.session = f"{host}:{self.port}"
        self.pool = SlicePool(pool_bytes)
        self._buffer = np.zeros(self.pool.size, np.uint8)
        self.base = int(self._buffer.ctypes.data)
        rc = self._engine.register_memory(self.base, self.pool.size)
        if rc != 0:
            raise TransferError(f"transfer engine could not register {self.pool.size} B: code {rc}")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self.failures = 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._buffer.data)[offset : offset + nbytes]

    def array(self, offset: int, nbytes: int) -> np.ndarray:
        """The slice as a numpy view of the registered buffer (no copy)."""
        return self._buffer[offset : offset + nbytes]

    def address(self, offset: int) -> int:
        return self.base + offset

    def read(self, peer: str, remote_address: int, offset: int, nbytes: int) -> None:
        """Pull ``nbytes`` at the peer's ``remote_address`` into this buffer at ``offset``.

        Up to ``SYNC_MAX`` bytes: the engine's ``transfer_sync_read``. Larger: submitted
        asynchronously and waited for by polling with short sleeps, because the engine's
        blocking read spins on the status without pause, which on a small host takes a core
        from the engine's I/O threads (twice as slow at 8 MiB on 2 cores). A read of
        ``split_min`` bytes or more goes as up to ``splits`` concurrent parts (one TCP stream
        each). :class:`TransferTimeout` when it has not finished in time: the engine may still
        write into the destination, so the caller must not reuse it.
        """
        if nbytes == 0:
            return
        if nbytes <= SYNC_MAX:
            rc = self._engine.transfer_sync_read(peer, self.base + offset, remote_address, nbytes)
            failed = f"code {rc}" if rc < 0 else ""
        else:
            failed = self._read_async(peer, remote_address, offset, nbytes)
        self._count(nbytes, failed=bool(failed))
        if failed:
            raise TransferError(f"transfer of {nbytes} B from {peer} failed ({failed}): the peer is gone")

    def _read_async(self, peer: str, remote_address: int, offset: int, nbytes: int) -> str:
        """The read as concurrent parts, waited for; why it failed, or "" when it did not."""
        parts = max(1, min(self.splits, nbytes // self.split_min))
        step = -(-nbytes // parts)
        started = time.monotonic()
        deadline = started + self.timeout_s + nbytes / 2**30  # the engine's own rule: + 1 s/GiB
        batches: list[int] = []
        failed = ""
        for start in range(0, nbytes, step):
            length = min(step, nbytes - start)
            batch = self._engine.batch_transfer_async_read(
                peer, [self.base + offset + start], [remote_address + start], [length]
            )
            if not batch:
                failed = "could not be submitted"
                break
            batches.append(batch)
        for batch in batches:  # every part is waited for: none may still write when this returns
            status = self._wait(batch, deadline)
            if status == -2 or status == 0:
                self._count(nbytes, failed=True)
                raise TransferTimeout(
                    f"transfer of {nbytes} B from {peer} did not finish in {time.monotonic() - started:.1f} s"
                )
            if status < 0:
                failed = f"code {status}"
        return failed

    def _count(self, nbytes: int, *, failed: bool) -> None:
        with self._lock:
            if failed:
                self.failures += 1
            else:
                self.reads += 1
                self.bytes_read += nbytes

    def _wait(self, batch: int, deadline: float) -> int:
        """1 done, -1 failed, -2 timed out (engine), 0 still running at ``deadline``."""
        check = self._engine.transfer_check_status
        spin_until = time.monotonic() + SPIN_S
        pause = PAUSE_MIN_S
        while True:
            status = int(check(batch))
            if status != 0:
                return status
            now = time.monotonic()
            if now > deadline:
                return 0
            if now > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, PAUSE_MAX_S)

    def close(self) -> None:
        try:
            self._engine.unregister_memory(self.base)
        except Exception:  # the process is going away anyway
            log.debug("unregister_memory failed", exc_info=True)
