"""A client that stops reading: generation pauses, memory stays flat, the session ends with a reason."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from websockets.exceptions import ConnectionClosed

from session.world.core import Phase
from tests.world.conftest import WorldServer, open_client

pytestmark = pytest.mark.system


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def wait_for(predicate: object, limit_s: float, step: float = 0.05) -> None:
    assert callable(predicate)
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(step)


async def test_slow_reader_pauses_generation_then_session_ends(stall_server: WorldServer) -> None:
    client = await open_client(stall_server, max_queue=1, rcvbuf=8192)
    ws = client.ws
    await client.send(
        {
            "type": "session.start",
            "model": "tiny-video-random",
            "width": 512,
            "height": 512,
            "fps": 60,
            "extra_params": {"chunk_frames": 8, "jpeg_quality": 95},
        }
    )
    await client.expect("video.start")
    await client.chunk()
    driver = stall_server.drivers()[0]

    # Stop reading. The server fills the socket buffers, then its send blocks.
    def blocked() -> bool:
        since = driver.stats.sending_since
        return since is not None and time.monotonic() - since > 0.2

    await wait_for(blocked, 10.0, step=0.01)
    assert driver.core.phase is Phase.STREAMING  # blocked, not yet timed out (1.5 s)
    received, demands, rss = driver.stats.chunks_received, driver.stats.demands, rss_bytes()
    await asyncio.sleep(0.6)
    # generation paused: nothing demanded or made while the socket is full, nothing queued up
    assert driver.stats.chunks_received == received and driver.stats.demands == demands
    assert driver.stats.chunks_received - driver.stats.chunks_sent <= 1
    assert rss_bytes() - rss < 16 * 2**20
    # after the stall timeout the session ends: the request is cancelled in the runtime
    await wait_for(lambda: driver.core.phase is Phase.CLOSED, 5.0)
    orchestrator = stall_server.pool.running["world-tiny-video-random"]
    await wait_for(lambda: not orchestrator.live_requests, 2.0)
    # reading again drains what the socket held, then the reason: error event and close code
    events = []
    try:
        while True:
            message = await asyncio.wait_for(ws.recv(), 5.0)
            if isinstance(message, str):
                events.append(json.loads(message))
    except ConnectionClosed as closed:
        assert closed.rcvd is not None
        assert closed.rcvd.code == 1008 and closed.rcvd.reason.startswith("client_stalled")
    stalled = [e for e in events if e["type"] == "error"]
    assert stalled and stalled[-1]["code"] == "client_stalled"
    await wait_for(lambda: not stall_server.drivers(), 5.0)
    assert driver.stats.send_blocked_s >= 1.4
