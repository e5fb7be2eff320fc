"""``serve --openpi-port``'s embedded server (web/transports/robot.openpi_port), its end: with a
stand-in for uvicorn's server, so no socket is opened."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from web.transports import robot

pytestmark = pytest.mark.unit


class _Server:
    """Stands in for uvicorn's server: it starts when it first runs and ends when told to exit;
    as it ends, ``cancels`` (the task holding the port) is cancelled: a cancel landing in the
    turn the server's end arrives, before the holder has taken it."""

    cancels: asyncio.Task[None] | None = None

    def __init__(self, config: Any) -> None:
        self.started = False
        self._exit = asyncio.Event()

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()

    async def serve(self, sockets: Any = None) -> None:
        task, holder = asyncio.current_task(), self.cancels
        assert task is not None and holder is not None
        task.add_done_callback(lambda _: holder.cancel())  # ahead of the holder's wake-up
        self.started = True
        await self._exit.wait()


async def test_a_cancel_landing_as_the_openpi_server_ends_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The task leaving the openpi port's context is cancelled just as the server has ended: it
    is cancelled (3.11's wait_for swallowed the cancel, and the caller went on as if never
    cancelled)."""
    service = SimpleNamespace(bare_routes=lambda: [], max_payload_bytes=1 << 20)
    went_on: list[str] = []

    async def hold() -> None:
        async with robot.openpi_port(cast(Any, service), "127.0.0.1", 9):
            pass
        went_on.append("after the port")

    monkeypatch.setattr(robot, "_EmbeddedServer", _Server)
    holder = asyncio.create_task(hold())
    monkeypatch.setattr(_Server, "cancels", holder)
    await asyncio.gather(holder, return_exceptions=True)
    assert holder.cancelled() and not went_on
