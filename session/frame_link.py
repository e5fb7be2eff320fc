"""What a world or robot session driver needs of its connection and of the runtime.

Both kinds talk to their client over one connection that sends text and binary frames (a
WebSocket, or a WebRTC call's data channel for worlds) and drive one runtime request (submit,
append input, update its conditioning, cancel). The two protocols and the exception adapters
raise from a send to a peer that is gone are defined here once, so a web adapter written for
one kind serves the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from runtime.payloads import Conditioning, Payload
from runtime.progress import RequestHandle

__all__ = ["FrameTransport", "RequestRuntime", "TransportClosed"]


class TransportClosed(Exception):
    """The transport cannot send any more (the peer went away); adapters raise it from sends."""


class FrameTransport(Protocol):
    """One client connection; raises :class:`TransportClosed` when the peer is gone."""

    async def send_text(self, text: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class RequestRuntime(Protocol):
    """The part of :class:`runtime.orchestrator.Orchestrator` a world or robot session uses."""

    async def submit(
        self, params: Mapping[str, Any], *, session_key: str | None = None, request_id: str | None = None
    ) -> RequestHandle: ...

    async def append_input(self, request_id: str, payload: Payload) -> bool: ...

    async def update(self, request_id: str, update: Conditioning) -> bool: ...

    async def cancel(self, request_id: str) -> bool: ...
