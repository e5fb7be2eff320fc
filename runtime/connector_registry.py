"""The connector kinds a pipeline's edges may name, by kind: the one place that knows them all.

The interface (``runtime.connectors``) names no implementation, so a new kind (another process's
memory, a remote host) is a new module and one line here, and no connector imports another.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from runtime.connectors import Connector, InProcessConnector
from runtime.shm import SharedMemoryConnector

CONNECTOR_KINDS: dict[str, Callable[[], Connector]] = {
    InProcessConnector.kind: InProcessConnector,
    SharedMemoryConnector.kind: SharedMemoryConnector,
}


def make_connectors(kinds: Collection[str]) -> dict[str, Connector]:
    """One connector per kind used by a pipeline (shared by its edges and worker processes)."""
    unknown = sorted(set(kinds) - CONNECTOR_KINDS.keys())
    if unknown:
        raise ValueError(f"unknown connector {unknown[0]!r}")
    return {kind: CONNECTOR_KINDS[kind]() for kind in sorted(kinds)}
