"""A minimal raw realtime WebSocket client that keeps every server event it receives.

Shared by the benches and the scale-out tests (``tests/scaleout/cluster.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol


class RealtimeClient:
    """A raw WebSocket client that keeps every server event it receives."""

    timeout_s: ClassVar[float] = 10.0  # the default wait for events
    open_timeout_s: ClassVar[float] = 15.0

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, url: str, *, subprotocols: Sequence[str] = ("realtime",), **kwargs: Any) -> Self:
        protocols = [Subprotocol(p) for p in subprotocols]
        ws = await connect(url, subprotocols=protocols, proxy=None, open_timeout=cls.open_timeout_s, **kwargs)
        return cls(ws)

    async def next(self, timeout_s: float | None = None) -> dict[str, Any]:
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the
        # event arrives, and a reader task cancelled there went on waiting for the next event
        # (bench_turns hung on it at the end of a run, the host idle: docs/benchmarks.md).
        async with asyncio.timeout(wait_s):
            message = await self.ws.recv()
        event: dict[str, Any] = json.loads(message)
        self.events.append(event)
        return event

    async def until(self, type_: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Read (and keep) events until one of ``type_``; TimeoutError after ``timeout_s`` in all."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        async with asyncio.timeout(wait_s):
            while True:
                event = await self.next(wait_s)
                if event["type"] == type_:
                    return event

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def ask(self, text: str) -> None:
        """A user text item and ``response.create``."""
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await self.send({"type": "conversation.item.create", "item": item})
        await self.send({"type": "response.create"})

    async def turn(self, text: str, timeout_s: float | None = None) -> dict[str, Any]:
        """A user text item and a response to it; returns ``response.done``."""
        await self.ask(text)
        return await self.until("response.done", timeout_s)

    async def until_closed(self, timeout_s: float | None = None) -> int | None:
        """Read (and keep) events until the server closes; its close code."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    await self.next(wait_s)
        except ConnectionClosed:
            return self.ws.close_code

    def committed(self) -> dict[str, dict[str, Any]]:
        """Items the client saw completed (``conversation.item.done``), by id."""
        return {e["item"]["id"]: e["item"] for e in self.events if e["type"] == "conversation.item.done"}

    @property
    def last_event_id(self) -> str:
        return str(self.events[-1]["event_id"])

    async def close(self, code: int = 1000) -> None:
        await self.ws.close(code)
