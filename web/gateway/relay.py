"""The gateway's WebSocket relay: one raw ``websockets`` client connection to the replica per
client connection, frames copied both ways unchanged.

Minimal overhead by construction: no JSON parsing, no per-frame task, no compression on the
replica link; each direction is one loop that awaits a frame and writes it on. Backpressure is
end to end: the replica link reads at most ``max_queue`` frames ahead of a slow client, and a
client frame is not read before the previous one was handed to the replica's socket.

Closing: whichever side ends first, the other gets the same close code and reason. A replica
that vanishes (kill -9, crash: no close frame) closes the client with 1012 ``replica_lost``;
the client reconnects with ``?session_id=&last_event_id=`` and the gateway routes the resume.
A client that vanishes closes the replica link with 1001 ``client_lost`` (as its own close
code 1006 would be relayed), however the gateway noticed: a read of its disconnect, or a
failed send to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]

REPLICA_LOST_CODE = 1012  # "service restart": reconnect (and resume) through the gateway
REPLICA_LOST_REASON = "replica_lost"
CLIENT_LOST_CODE = 1001  # "going away": the replica detaches the session (resumable), not ends it
CLIENT_LOST_REASON = "client_lost"

# Request headers that describe this hop, not the request: never forwarded.
HOP_HEADERS = frozenset(
    {
        "host",
        "connection",
        "upgrade",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "content-length",
        "proxy-authorization",
        "proxy-connection",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        # The edge (gateway, or the worker that took the connection) applied the origin policy
        # (web/edge/cors.py) and answers with the CORS headers; the replica behind it must not judge
        # the page's origin against its own Host again.
        "origin",
    }
)


class ReplicaUnreachable(Exception):
    """The replica did not complete the handshake (refused, timed out, died during it)."""


@dataclass(frozen=True, slots=True)
class ReplicaDenial:
    """The replica answered the upgrade with an HTTP error: relayed to the client as is."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def code(self) -> str:
        """The ``error.code`` of a JSON error body, or ``""``."""
        try:
            doc = json.loads(self.body or b"{}")
        except ValueError:
            return ""
        err = doc.get("error") if isinstance(doc, dict) else None
        return str(err.get("code", "")) if isinstance(err, dict) else ""


    def response(self) -> Response:
        """The denial as the client's answer to its upgrade."""
        return Response(self.body, status_code=self.status, headers=dict(self.headers))


class ReplicaRefused(Exception):
    def __init__(self, denial: ReplicaDenial) -> None:
        super().__init__(f"replica answered {denial.status} {denial.code}")
        self.denial = denial


def ws_url(base_url: str, path: str, query_string: str) -> str:
    """``http(s)://host:port`` + path + query → the replica's ``ws(s)://`` URL."""
    base = base_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return f"{base}{path}?{query_string}" if query_string else f"{base}{path}"


def forwarded_headers(
    raw_headers: Iterable[tuple[bytes, bytes]], client_host: str | None
) -> list[tuple[str, str]]:
    """The client's request headers minus hop headers, plus ``X-Forwarded-For``."""
    out: list[tuple[str, str]] = []
    prior_xff = ""
    for raw_name, raw_value in raw_headers:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name in HOP_HEADERS:
            continue
        if name == "x-forwarded-for":
            prior_xff = value
            continue
        out.append((name, value))
    if client_host:
        out.append(("x-forwarded-for", f"{prior_xff}, {client_host}" if prior_xff else client_host))
    elif prior_xff:
        out.append(("x-forwarded-for", prior_xff))
    return out


async def open_upstream(
    url: str,
    *,
    headers: list[tuple[str, str]],
    subprotocols: list[str],
    open_timeout_s: float,
    max_size: int | None,
) -> ClientConnection:
    """Connect to the replica; raises :class:`ReplicaUnreachable` or :class:`ReplicaRefused`."""
    try:
        return await connect(
            url,
            additional_headers=headers,
            subprotocols=[Subprotocol(p) for p in subprotocols] or None,
            compression=None,  # the replica link is local: deflate would cost CPU per frame
            proxy=None,
            user_agent_header=None,  # the client's own User-Agent is forwarded
            open_timeout=open_timeout_s,
            max_size=max_size,
            max_queue=64,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=5,
        )
    except InvalidStatus as exc:
        response = exc.response
        denial = ReplicaDenial(
            status=response.status_code,
            headers=[(k, v) for k, v in response.headers.raw_items() if k.lower() not in HOP_HEADERS],
            body=bytes(response.body or b""),
        )
        raise ReplicaRefused(denial) from exc
    except (OSError, TimeoutError, EOFError, InvalidHandshake) as exc:
        raise ReplicaUnreachable(f"{url}: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ClientUpgrade:
    """What a client's upgrade request carries on to a replica: its path and query, its
    headers (forwarded, see :func:`forwarded_headers`) and the subprotocols it offers."""

    path: str
    query: str
    headers: list[tuple[str, str]]
    subprotocols: list[str]

    @classmethod
    def of(cls, scope: Mapping[str, Any], *extra_headers: tuple[str, str]) -> ClientUpgrade:
        raw = scope.get("headers", [])
        offered = next((v.decode("latin-1") for k, v in raw if k == b"sec-websocket-protocol"), "")
        client = scope.get("client")
        return cls(
            str(scope.get("path", "/v1/realtime")),
            scope.get("query_string", b"").decode("latin-1"),
            [*forwarded_headers(raw, client[0] if client else None), *extra_headers],
            [p.strip() for p in offered.split(",") if p.strip()],
        )

    async def open(self, base_url: str, *, open_timeout_s: float, max_size: int | None) -> ClientConnection:
        """The upgrade on the replica at ``base_url`` (see :func:`open_upstream`)."""
        return await open_upstream(
            ws_url(base_url, self.path, self.query),
            headers=self.headers,
            subprotocols=self.subprotocols,
            open_timeout_s=open_timeout_s,
            max_size=max_size,
        )


async def serve_relayed(
    websocket: WebSocket, receive: Receive, send: Send, upstream: ClientConnection
) -> None:
    """Accept the client's upgrade as the replica accepted it, relay both ways until either
    side ends, and close the replica's side."""
    try:
        await websocket.accept(subprotocol=upstream.subprotocol, headers=upgrade_headers(upstream))
        await relay(receive, send, upstream)
    finally:
        await upstream.close()


def upgrade_headers(upstream: ClientConnection) -> list[tuple[bytes, bytes]] | None:
    """The replica's ``X-Omni-*`` 101 headers (a new session's resume data), for the client's
    101: a stock client behind the gateway learns its resume token as it would direct."""
    response = upstream.response
    if response is None:
        return None
    kept = [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in response.headers.raw_items()
        if k.lower().startswith("x-omni-")
    ]
    return kept or None


def _close_code(code: int | None) -> int:
    """A code that may be sent in a close frame (1005/1006/1015 are only ever observed).

    An abnormal end (1006) becomes 1001 "going away", so the far side still sees a drop, not a
    deliberate close; no status (1005) becomes 1000.
    """
    if code in (1006, 1015):
        return 1001
    if code is None or not (1000 <= code <= 4999) or code == 1005:
        return 1000
    return code


def _client_close(code: int, reason: str) -> tuple[int, str]:
    """What the replica is told when the client left with ``code``.

    The client's own code when it sent one; when it sent none (1005: the TCP connection was
    lost, or an empty close frame; 1006/1015: abnormal) 1001 ``client_lost``, never 1000: the
    replica must see a drop, as it would without a gateway (a world detaches on a drop and
    ends on a clean 1000; a voice session waits its grace instead of parking at once).
    """
    if code in (1005, 1006, 1015):
        return CLIENT_LOST_CODE, CLIENT_LOST_REASON
    return _close_code(code), reason


async def relay(receive: Receive, send: Send, upstream: ClientConnection) -> tuple[str, int, str]:
    """Copy frames both ways until one side ends; close the other side to match.

    Returns ``(who ended, code, reason)`` with who in ``client`` / ``replica`` / ``replica_lost``.
    """
    to_client = asyncio.create_task(_replica_to_client(upstream, send), name="gateway-relay-down")
    to_replica = asyncio.create_task(_client_to_replica(receive, upstream), name="gateway-relay-up")
    try:
        done, _ = await asyncio.wait({to_client, to_replica}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (to_client, to_replica):
            task.cancel()
        await asyncio.gather(to_client, to_replica, return_exceptions=True)
    if to_replica in done and not to_replica.cancelled() and to_replica.exception() is None:
        code, reason = to_replica.result()
        if code is not None:  # the client left: tell the replica (the session detaches there)
            with contextlib.suppress(Exception):
                await upstream.close(*_client_close(code, reason))
            return "client", code, reason
    if to_client in done and not to_client.cancelled() and to_client.exception() is not None:
        # A send to the client failed before its disconnect was read (a stream that never
        # pauses, e.g. a world's chunks, meets a dropped client here first): a drop, so the
        # replica gets 1001, never the clean 1000 that would end a world instead of detaching it.
        with contextlib.suppress(Exception):
            await upstream.close(CLIENT_LOST_CODE, CLIENT_LOST_REASON)
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": CLIENT_LOST_CODE, "reason": CLIENT_LOST_REASON})
        return "client", 1006, CLIENT_LOST_REASON
    # The replica side ended (or the client side failed writing): close the client to match.
    await _close_upstream_quietly(upstream)
    received = upstream.protocol.close_rcvd
    if received is None:
        who, code, reason = "replica_lost", REPLICA_LOST_CODE, REPLICA_LOST_REASON
    else:
        who, code, reason = "replica", _close_code(received.code), received.reason
    with contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": code, "reason": reason})
    return who, code, reason


async def _close_upstream_quietly(upstream: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        await upstream.close()


async def _replica_to_client(upstream: ClientConnection, send: Send) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for message in upstream:
            if isinstance(message, str):
                await send({"type": "websocket.send", "text": message})
            else:
                await send({"type": "websocket.send", "bytes": message})


async def _client_to_replica(receive: Receive, upstream: ClientConnection) -> tuple[int | None, str]:
    """Until the client disconnects: its close code and reason (None: the replica went first)."""
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "websocket.receive":
            text = message.get("text")
            try:
                await upstream.send(text if text is not None else (message.get("bytes") or b""))
            except ConnectionClosed:
                return None, ""
        elif kind == "websocket.disconnect":
            return int(message.get("code") or 1005), str(message.get("reason") or "")
