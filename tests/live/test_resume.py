"""A GPT-Live session outlives a dropped socket: the 101 carries the resume data, a resume with
``?session_id=…`` and the token reattaches the running session (``session.started`` again,
``omni.resumed``, the usage and the model going on from where they were), a wrong token is
refused (403), and a session left detached past the grace ends. A client that asks for the
extensions gets the token in ``session.started`` too. A clean close (1000) ends the session."""

from __future__ import annotations

import asyncio

import pytest
import websockets

from tests.live.wire import append, connect
from tests.live_server import LiveServer

pytestmark = pytest.mark.system


async def test_a_dropped_socket_resumes_the_running_session(server: LiveServer) -> None:
    client = await connect(server)
    sid = client.ws.response.headers["X-Omni-Session-Id"]
    token = client.ws.response.headers["X-Omni-Resume-Token"]
    assert (await client.start())["session"]["id"] == sid
    for i in range(10):
        await client.send(append(0.1, seed=i))
    await client.send({"type": "session.input_audio.mute", "event_id": "m"})
    await client.wait_for("session.input_audio.muted")
    client.ws.transport.abort()  # no close frame: the connection is lost, not closed
    await asyncio.sleep(0.3)
    assert server.ctx.metrics.session_counts()["live"] == 1  # detached, not ended

    with pytest.raises(websockets.InvalidStatus) as refused:
        await connect(server, query=f"?session_id={sid}", headers={"X-Omni-Resume-Token": "wrong"})
    assert refused.value.response.status_code == 403

    again = await connect(server, query=f"?session_id={sid}", headers={"X-Omni-Resume-Token": token})
    async with again.ws:
        started = await again.wait_for("session.started")
        assert started["session"]["id"] == sid
        assert started["session"]["omni"] == {"resumed": True, "usage_s": 1.0}
        for i in range(5):
            await again.send(append(0.1, seed=100 + i))
        await again.send({"type": "session.close"})
        closed = await again.wait_for("session.closed")
        assert closed["usage"]["seconds"] == pytest.approx(1.5)  # one session clock across both sockets
        assert (await again.closed())[0] == 1000
    await _gone(server, sid)


async def test_the_extensions_put_the_token_in_session_started(server: LiveServer) -> None:
    client = await connect(server, query="?omni_extensions=1")
    async with client.ws:
        session = (await client.start())["session"]
        assert session["omni"]["resume_token"] == client.ws.response.headers["X-Omni-Resume-Token"]
        await client.ws.close(1000)
    await _gone(server, session["id"])  # a clean close ends it at once


async def test_a_session_detached_past_the_grace_ends(server: LiveServer) -> None:
    client = await connect(server)
    sid = (await client.start())["session"]["id"]
    token = client.ws.response.headers["X-Omni-Resume-Token"]
    client.ws.transport.abort()
    await _gone(server, sid, within_s=15)  # the grace is 2 s here, a sweep later it ends
    with pytest.raises(websockets.InvalidStatus) as refused:
        await connect(server, query=f"?session_id={sid}", headers={"X-Omni-Resume-Token": token})
    assert refused.value.response.status_code == 404


async def _gone(server: LiveServer, sid: str, within_s: float = 5.0) -> None:
    live = server.ctx.metrics.session_counts
    for _ in range(int(within_s / 0.05)):
        if live()["live"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {sid} is still live")
