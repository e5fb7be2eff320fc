"""loadtest's RealtimeClient: a reader task cancelled just as an event arrives stops.

With ``asyncio.wait_for`` (Python 3.11) that cancel was swallowed, the reader went on waiting
for the next event, and bench_turns' session awaiting it hung at the end of a run with the
host idle (docs/benchmarks.md, "The VAD no longer waits for the live ASR")."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.realtime_client import RealtimeClient

pytestmark = pytest.mark.unit


class _Socket:
    """``recv`` waits on a future the test completes."""

    def __init__(self) -> None:
        self.pending: asyncio.Future[str] | None = None
        self.waiting = asyncio.Event()

    async def recv(self) -> str:
        self.pending = asyncio.get_running_loop().create_future()
        self.waiting.set()
        return await self.pending


async def test_a_reader_cancelled_as_an_event_arrives_stops() -> None:
    socket = _Socket()
    client = RealtimeClient(socket)  # type: ignore[arg-type]

    async def read() -> None:
        while True:
            await client.next(3600)

    reader = asyncio.create_task(read())
    await socket.waiting.wait()
    assert socket.pending is not None
    socket.pending.set_result('{"type": "response.done"}')  # the event and the cancel, one tick
    reader.cancel()
    done, _ = await asyncio.wait([reader], timeout=5)
    assert done == {reader} and reader.cancelled()
