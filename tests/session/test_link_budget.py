"""`TransportLink`'s outbox is bounded in bytes as well as events, and ending a link never
waits on a transport that cannot close (a peer that reads nothing)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session import link as link_module
from session.link import SLOW_CLIENT_CODE, LinkEnd, TransportLink

pytestmark = pytest.mark.unit


class StuckTransport:
    """A transport whose peer reads nothing: sends and the close frame never complete."""

    def __init__(self) -> None:
        self.closed_with: tuple[int, str] | None = None
        self._never = asyncio.Event()

    async def send(self, event: dict[str, Any]) -> None:
        await self._never.wait()

    async def close(self, code: int, reason: str) -> None:
        self.closed_with = (code, reason)
        await self._never.wait()

    async def receive(self) -> str | None:
        await self._never.wait()
        return None


async def test_outbox_over_its_byte_budget_closes_1008(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_module, "CLOSE_TIMEOUT_S", 0.2)
    transport = StuckTransport()
    link = TransportLink(transport, lambda _: None, limit=4096, max_bytes=1 << 20)
    big = {"type": "conversation.item.retrieved", "text": "x" * (300 * 1024)}
    pushed = 0
    while link.push(dict(big)):
        pushed += 1
        assert pushed < 10, "the byte budget never tripped"
        await asyncio.sleep(0)
    assert 3 <= pushed <= 4  # the first is in the (stuck) send; ~1 MiB waits behind it
    end = await asyncio.wait_for(link.wait(), 5)  # the close frame never leaves: bounded anyway
    assert end is LinkEnd.SLOW_CLIENT and link.queued == 0 and link.queued_bytes == 0
    assert transport.closed_with is not None and transport.closed_with[0] == SLOW_CLIENT_CODE


async def test_count_bound_still_holds_for_small_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_module, "CLOSE_TIMEOUT_S", 0.2)
    link = TransportLink(StuckTransport(), lambda _: None, limit=16)
    accepted = sum(link.push({"type": "x", "n": i}) for i in range(40))
    assert accepted == 16
    assert await asyncio.wait_for(link.wait(), 5) is LinkEnd.SLOW_CLIENT
