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
from typing import Any

import numpy as np

from runtime.remote.slices import SlicePool

log = logging.getLogger(__name__)

METADATA = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")


class TransferError(RuntimeError):
    """The transfer engine could not start, or a transfer failed (the peer is gone)."""


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

    def __init__(self, host: str, pool_bytes: int, *, protocol: str = "tcp") -> None:
        if protocol not in PROTOCOLS:
            raise TransferError(f"transfer protocol must be one of {PROTOCOLS}, not {protocol!r}")
        host = check_local_address(host)
        os.environ.setdefault("GLOG_minloglevel", "2")  # the engine's INFO/WARNING lines
        # A transfer to a peer that stopped answering gives up instead of waiting on it. (The
        # engine's RPC and data ports listen on every interface whatever address it is given:
        # checked with 0.3.13.post1; docs/scaleout.md says what that means for the network.)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
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

    def address(self, offset: int) -> int:
        return self.base + offset

    def read(self, peer: str, remote_address: int, offset: int, nbytes: int) -> None:
        """Pull ``nbytes`` at the peer's ``remote_address`` into this buffer at ``offset``."""
        if nbytes == 0:
            return
        rc = self._engine.transfer_sync_read(peer, self.base + offset, remote_address, nbytes)
        with self._lock:
            if rc < 0:
                self.failures += 1
            else:
                self.reads += 1
                self.bytes_read += nbytes
        if rc < 0:
            raise TransferError(f"transfer of {nbytes} B from {peer} failed (code {rc}): the peer is gone")

    def close(self) -> None:
        try:
            self._engine.unregister_memory(self.base)
        except Exception:  # the process is going away anyway
            log.debug("unregister_memory failed", exc_info=True)
