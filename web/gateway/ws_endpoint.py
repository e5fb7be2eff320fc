"""`GET /v1/realtime` and `GET /v1/realtime/video` on the gateway: route the upgrade to a
replica, then relay. Both paths route alike (a voice session and a world session are bound to
a replica the same way); only the shape of the ``error`` event sent when no replica can take
the session differs (realtime: ``error.error.code``; world: ``error.code``).

The replica's handshake comes first, the client's second: a replica's refusal (401, 403 for a
bad resume token, 429, ...) is relayed to the client as the same HTTP answer before any
upgrade, and the client is accepted with the subprotocol the replica chose.

Routing retries: a new session tries up to three replicas (one that cannot be reached or
answers 503, e.g. draining, is skipped). A resume goes to the owner; if the owner cannot be
reached while its lease is still live (it was killed a moment ago), the gateway waits for the
lease to lapse (at most ``lapse_wait_s``), then routes to a live replica that takes the
session over. A 409 from a replica (another replica won the session meanwhile) re-reads the
binding and goes to the winner. When every live replica refuses to take over from a dead owner
(a world session cannot move: it lives in its owner's process) the client gets 404
``session_not_found``, not a ``retry later`` it could never satisfy.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection

from session.store.errors import StoreError
from session.world.events import ErrorEvent as WorldErrorEvent
from web.gateway.relay import ClientUpgrade, ReplicaDenial, ReplicaRefused, ReplicaUnreachable, serve_relayed
from web.gateway.routing import NoReplicaAvailable, Route
from web.gateway.state import Gateway

log = logging.getLogger("omniduplex.gateway")

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]

NO_REPLICA_CLOSE = 1013  # "try again later"
REALTIME_SUBPROTOCOL = "realtime"
ATTEMPTS = 3


class _Handshake:
    """What the replica's upgrade request carries (built once, reused across attempts)."""

    def __init__(self, gateway: Gateway, upgrade: ClientUpgrade) -> None:
        self.gateway = gateway
        self.upgrade = upgrade

    async def open(self, route_url: str) -> ClientConnection:
        settings = self.gateway.settings
        return await self.upgrade.open(
            route_url, open_timeout_s=settings.connect_timeout_s, max_size=settings.max_message_bytes
        )


async def connect_new(hs: _Handshake) -> ClientConnection:
    """A new session: power-of-two choices, skipping replicas that fail or drain."""
    tried: set[str] = set()
    refused: ReplicaRefused | None = None
    for _ in range(ATTEMPTS):
        try:
            replica = await hs.gateway.router.new_session(exclude=tried)
        except NoReplicaAvailable:
            if refused is not None:
                raise refused from None
            raise
        tried.add(replica.replica_id)
        try:
            return await hs.open(replica.url)
        except ReplicaUnreachable as exc:
            log.warning("new session: replica %s unreachable: %s", replica.replica_id, exc)
        except ReplicaRefused as exc:
            if exc.denial.status != 503:
                raise
            refused = exc  # draining or full: another replica may take it
    if refused is not None:
        raise refused
    raise NoReplicaAvailable("no replica could be reached")


def gone_with_its_owner(session_id: str) -> ReplicaRefused:
    """The answer when the owner is gone and every live replica refused to take the session
    over (a world session lives in its owner's process only): 404, as a replica answers a
    direct resume of a world whose process is gone."""
    message = (
        f"Session {session_id} lived on a replica that is gone, and no other replica can take it "
        "over (a world session ends with its replica's process)."
    )
    body = json.dumps(
        {"error": {"type": "invalid_request_error", "code": "session_not_found", "message": message}}
    )
    return ReplicaRefused(ReplicaDenial(404, [("content-type", "application/json")], body.encode()))


async def connect_resume(hs: _Handshake, session_id: str) -> tuple[ClientConnection, Route]:
    """A resume: the owner, or once its lease lapsed, a replica that takes the session over."""
    router = hs.gateway.router
    tried: set[str] = set()
    refused_takeover = False  # a replica other than the dead owner answered 409
    for _ in range(ATTEMPTS + 1):
        try:
            route = await router.session(session_id, exclude=tried)
        except NoReplicaAvailable:
            if refused_takeover:
                raise gone_with_its_owner(session_id) from None
            raise
        try:
            return await hs.open(route.replica.url), route
        except ReplicaUnreachable as exc:
            if route.kind != "owner":
                tried.add(route.replica.replica_id)
                continue
            log.info("resume %s: owner %s unreachable (%s); awaiting its lease", session_id, route.owner, exc)
            if not await router.wait_lapse(route.replica.replica_id, hs.gateway.settings.lapse_wait_s):
                why = f"the owner of {session_id} is unreachable but holds its lease"
                raise NoReplicaAvailable(why) from exc
        except ReplicaRefused as exc:
            if exc.denial.status == 409:  # the binding names another replica: re-read it
                if route.kind == "owner":
                    # The process at the owner's address is not the owner (it restarted there
                    # under a new id): the old owner's lease has to lapse before a takeover.
                    await router.wait_lapse(route.replica.replica_id, hs.gateway.settings.lapse_wait_s)
                elif route.kind == "failover":
                    # It would not take the session over from the dead owner (a world cannot
                    # move) or another replica won it meanwhile: the re-read tells which.
                    tried.add(route.replica.replica_id)
                    refused_takeover = True
                continue
            if exc.denial.status == 503 and route.kind != "owner":
                tried.add(route.replica.replica_id)
                continue
            raise
    if refused_takeover:
        raise gone_with_its_owner(session_id)
    raise NoReplicaAvailable(f"no replica could take session {session_id}")


def _denial(status: int, code: str, message: str, retry_after: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"type": kind, "code": code, "message": message}}).encode()
    headers = {"Retry-After": retry_after} if retry_after else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


ErrorEvent = Callable[[str, str], dict[str, Any]]  # (code, message) → the protocol's error event


def realtime_error(code: str, message: str) -> dict[str, Any]:
    """An OpenAI Realtime ``error`` event."""
    return {
        "type": "error",
        "event_id": "event_gw_" + secrets.token_hex(8),
        "error": {"type": "server_error", "code": code, "message": message, "param": None, "event_id": None},
    }


def world_error(code: str, message: str) -> dict[str, Any]:
    """A world session's ``error`` event (code and message at the top level)."""
    return WorldErrorEvent(code=code, message=message).to_dict()


def live_error(code: str, message: str) -> dict[str, Any]:
    """A GPT-Live ``error`` event (session/live/events.py)."""
    body = {"type": "server_error", "code": code, "message": message, "param": None, "client_event_id": None}
    return {"type": "error", "error": body}


def robot_error(code: str, message: str) -> dict[str, Any]:
    """A robot session's error (vLLM-Omni's map; an openpi client sees the text frame as one)."""
    return {"type": "error", "code": code, "message": message}


class RealtimeRelayEndpoint:
    """The ASGI endpoint (raw, so the relay loops call uvicorn's receive/send directly).

    ``error_event`` builds the protocol's ``error`` event for the no-replica close."""

    def __init__(self, error_event: ErrorEvent = realtime_error) -> None:
        self.error_event = error_event

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gateway: Gateway = scope["app"].state.gateway
        websocket = WebSocket(scope, receive, send)
        upgrade = ClientUpgrade.of(scope)
        subprotocols = upgrade.subprotocols
        if not await gateway.authorized(websocket.headers.get("authorization"), subprotocols):
            await websocket.send_denial_response(
                _denial(401, "invalid_api_key", "Missing or invalid API key (Authorization: Bearer <key>).")
            )
            return
        hs = _Handshake(gateway, upgrade)
        session_id = websocket.query_params.get("session_id")
        try:
            if session_id:
                upstream, _ = await connect_resume(hs, session_id)
            else:
                upstream = await connect_new(hs)
        except NoReplicaAvailable as exc:
            await self._no_replica(websocket, subprotocols, self.error_event, str(exc))
            return
        except StoreError as exc:
            await websocket.send_denial_response(
                _denial(503, "store_unavailable", f"The session store is unreachable: {exc}", "1")
            )
            return
        except ReplicaRefused as exc:
            await websocket.send_denial_response(exc.denial.response())
            return
        await serve_relayed(websocket, receive, send, upstream)

    @staticmethod
    async def _no_replica(
        websocket: WebSocket, subprotocols: list[str], error_event: ErrorEvent, why: str
    ) -> None:
        """WebSocket form of a 503: accept, say ``no_replica_available``, close 1013."""
        subprotocol = REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in subprotocols else None
        await websocket.accept(subprotocol=subprotocol)
        message = f"No replica can take this session now ({why}); retry in a second."
        event = error_event("no_replica_available", message)
        await websocket.send_text(json.dumps(event, separators=(",", ":")))
        await websocket.close(code=NO_REPLICA_CLOSE, reason="no_replica_available")
