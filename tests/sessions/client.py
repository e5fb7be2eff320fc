"""Raw `websockets` clients for the session tests (the SDK cannot send resume parameters).

Every connection's events go through `tests.realtime.wire.ServerEvents`: strict SDK
validation of every non-`omni.*` event and unique `event_id`s per connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import websockets
from websockets.asyncio.client import ClientConnection

from session.resume import OMNI_MARK
from session.store.event_ids import parse_event_id
from tests.live_server import LiveServer
from tests.realtime.wire import Received, ServerEvents

Base = LiveServer | str  # a live server, or a ws://host:port base URL


def ws_base(server: Base) -> str:
    return server.ws_url if isinstance(server, LiveServer) else server


def realtime_url(server: Base, **query: str) -> str:
    q = {k: v for k, v in query.items() if v is not None}
    return f"{ws_base(server)}/v1/realtime" + (f"?{urlencode(q)}" if q else "")


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class Conn:
    ws: ClientConnection
    events: ServerEvents
    session_id: str
    resume_token: str | None = None

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    def abort(self) -> None:
        """Drop the TCP connection without a close frame (the server sees 1006)."""
        self.ws.transport.abort()

    @property
    def last_event_id(self) -> str:
        return str(self.events.log[-1].raw["event_id"])


@asynccontextmanager
async def opened(server: Base, *, api_key: str | None = None, **query: str) -> AsyncIterator[Conn]:
    """A new session: `session.created`, then `omni.session.resumable` (both consumed). It asks
    for `omni.*` events (`omni_extensions=1`) unless the query says `omni_extensions=None`."""
    query.setdefault("omni_extensions", "1")
    async with (
        websockets.connect(
            realtime_url(server, **query), additional_headers=auth(api_key), open_timeout=20, max_size=None
        ) as ws,
        ServerEvents(ws.recv) as events,
    ):
        created = await events.wait_for("session.created", within_s=30)
        resumable = await events.next(10)
        assert resumable.type == "omni.session.resumable", resumable.raw
        assert resumable.raw["session_id"] == created.raw["session"]["id"]
        yield Conn(ws, events, resumable.raw["session_id"], resumable.raw["resume_token"])


@asynccontextmanager
async def resumed(
    server: Base,
    session_id: str,
    token: str | None,
    last_event_id: str | None,
    *,
    api_key: str | None = None,
    via_subprotocol: bool = False,
) -> AsyncIterator[Conn]:
    """A resumed session; `omni.session.resumed` is the first event (left in the log)."""
    headers = auth(api_key)
    subprotocols: list[Any] | None = None
    if token is not None and via_subprotocol:
        subprotocols = ["realtime", f"omni-resume-token.{token}"]
    elif token is not None:
        headers["X-Omni-Resume-Token"] = token
    url = realtime_url(server, session_id=session_id, last_event_id=last_event_id)  # type: ignore[arg-type]
    async with (
        websockets.connect(
            url, additional_headers=headers, subprotocols=subprotocols, open_timeout=20, max_size=None
        ) as ws,
        ServerEvents(ws.recv) as events,
    ):
        first = await events.next(20)
        assert first.type == "omni.session.resumed", first.raw
        assert first.raw["session_id"] == session_id
        yield Conn(ws, events, session_id, token)


async def user_text(conn: Conn, text: str) -> str:
    await conn.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        }
    )
    done = await conn.events.wait_for("conversation.item.done", within_s=10)
    return str(done.raw["item"]["id"])


async def turn(conn: Conn, text: str, *, wait: bool = True, audio: bool = True) -> list[Received]:
    """A text turn (an audio reply, or text only); the events up to `response.done` when `wait`."""
    await user_text(conn, text)
    create: dict[str, Any] = {"type": "response.create"}
    if not audio:
        create["response"] = {"output_modalities": ["text"]}
    await conn.send(create)
    if not wait:
        return []
    return await conn.events.collect_until("response.done", within_s=30)


def logged(received: Iterable[Received]) -> list[dict[str, Any]]:
    """The session's logged events among those received (connection events left out)."""
    return [
        r.raw for r in received if OMNI_MARK not in str(r.raw["event_id"]) and not r.type.startswith("omni.")
    ]


def seq(event: dict[str, Any]) -> int:
    """The logged seq of an event (for a held audio delta, that of the logged one before it)."""
    ref = parse_event_id(str(event["event_id"]))
    assert ref is not None, event
    return ref.seq


def position(event: dict[str, Any]) -> tuple[int, int]:
    """Where an event is in the session's order (``EventRef.position``)."""
    ref = parse_event_id(str(event["event_id"]))
    assert ref is not None, event
    return ref.position


def reply_text(events: Iterable[Received]) -> str:
    kinds = ("response.output_audio_transcript.delta", "response.output_text.delta")
    return "".join(r.raw["delta"] for r in events if r.type in kinds)


async def until(predicate: Any, within_s: float = 10.0, interval_s: float = 0.05) -> None:
    """Poll a (sync or async) predicate until it is true."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(interval_s)
