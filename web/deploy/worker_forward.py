"""Inside ``serve --workers N``: send a request about another worker's session to that worker.

The kernel hands a connection on the shared port to any worker (``SO_REUSEPORT``), so a
resume, a REST call or a hangup can land on a worker that does not hold the session. This ASGI
middleware (installed only when the server runs as a worker, so a single process is unchanged)
forwards those to the owner's private ``--advertise-url`` with the gateway's code
(``web.gateway.relay`` for WebSockets, ``web.gateway.http_forward`` for HTTP):

* WS ``/v1/realtime?session_id=`` and ``/v1/realtime/video?session_id=``: the session's bound
  owner, when it is another *live* worker, gets the upgrade and the frames are relayed. A dead
  owner's session is left to this worker (its ``claim`` takes it over, as after a failover).
* ``GET``/``DELETE /v1/sessions/{id}``: to the live owner.
* ``POST /v1/realtime/calls?session_id=`` and ``POST /v1/realtime/video/calls?session_id=``
  (a session resumed on a new WebRTC call): to the live owner, like a WebSocket resume; the
  SDP answer carries the owner's candidates, so the media then goes to it directly.
* ``POST /v1/realtime/calls/{id}/hangup`` and ``DELETE /v1/realtime/video/calls/{id}``: a call
  this worker does not know is tried on the other workers (call ids are not in Redis); the
  first answer that is not 404 wins.
* ``GET /metrics?scope=all``: this worker's metrics merged with every live sibling's
  (``web.server.metrics.merge_worker_metrics``): counters and histograms summed, gauges summed when
  they add up (sessions, bytes, RSS: what the load test's sampler reads) or else kept per
  worker with a ``worker`` label (start time, limits).

A forwarded request carries ``x-omniduplex-worker-forwarded`` and is never forwarded again.
One Redis read per forwarded-candidate request (an upgrade, a REST call), never per frame.
When the owner cannot be reached the request is served here as if it had not been forwarded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from session.store.errors import StoreError
from web.deploy.replica import SESSION_SOCKETS, ReplicaMembership, membership_of
from web.deploy.workers import worker_label
from web.edge.bodies import MAX_FORWARDED_BODY_BYTES, BodyRefused, read_body
from web.gateway.http_forward import HttpForwarder, ReplicaHttpUnreachable, to_response
from web.gateway.relay import ClientUpgrade, ReplicaRefused, ReplicaUnreachable, serve_relayed

log = logging.getLogger("omniduplex.workers")

FORWARDED = b"x-omniduplex-worker-forwarded"
SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)")
HANGUP_PATH = re.compile(r"/v1/realtime/calls/([^/]+)/hangup")
# POST ?session_id=: a resume
CALL_PATHS = ("/v1/realtime/calls", "/v1/realtime/video/calls", "/v1/live/sessions")
VIDEO_CALL_PATH = re.compile(r"/v1/realtime/video/calls/([^/]+)")
OPEN_TIMEOUT_S = 5.0

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
Asgi = Callable[[Any, Receive, Send], Awaitable[None]]


def _query(scope: Mapping[str, Any]) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"))


def _knows_call(service: Any, call_id: str) -> bool:
    """Whether this worker's WebRTC service (voice or video) has the call, live or ended."""
    return service is not None and (call_id in service.calls or call_id in service.call_sessions)


class WorkerForward:
    """ASGI middleware of a worker: requests about a sibling's session go to that sibling."""

    def __init__(self, app: Asgi) -> None:
        self.app = app
        self._http: HttpForwarder | None = None

    @property
    def http(self) -> HttpForwarder:
        if self._http is None:
            self._http = HttpForwarder(timeout_s=30.0, connect_timeout_s=2.0)
        return self._http

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not any(k == FORWARDED for k, _ in scope["headers"]):
            replica = membership_of(scope)
            if replica is not None:
                try:
                    if await self._forwarded(replica, scope, receive, send):
                        return
                except StoreError as exc:  # Redis down: served here (which answers 503 itself)
                    log.warning("worker forward: store unavailable: %s", exc)
        await self.app(scope, receive, send)

    async def _forwarded(self, replica: ReplicaMembership, scope: Any, receive: Receive, send: Send) -> bool:
        path = scope["path"]
        if scope["type"] == "websocket":
            session_id = (_query(scope).get("session_id") or [""])[0]
            if path in SESSION_SOCKETS and session_id:
                url = await self._owner_url(replica, session_id)
                return url is not None and await self._relay_ws(scope, receive, send, url)
            return False
        method = scope.get("method")
        m = SESSION_PATH.fullmatch(path)
        if m is not None and method in ("GET", "DELETE"):
            url = await self._owner_url(replica, m.group(1))
            return url is not None and await self._forward_http(scope, receive, send, [url])
        if path in CALL_PATHS and method == "POST":
            session_id = (_query(scope).get("session_id") or [""])[0]
            if not session_id:
                return False  # a new call: any worker takes it
            url = await self._owner_url(replica, session_id)
            return url is not None and await self._forward_http(scope, receive, send, [url])
        m = HANGUP_PATH.fullmatch(path)
        if m is not None and method == "POST":
            if _knows_call(getattr(scope["app"].state, "webrtc", None), m.group(1)):
                return False
            return await self._forward_http(scope, receive, send, await self._sibling_urls(replica))
        m = VIDEO_CALL_PATH.fullmatch(path)
        if m is not None and method == "DELETE":
            if _knows_call(getattr(scope["app"].state, "video", None), m.group(1)):
                return False
            return await self._forward_http(scope, receive, send, await self._sibling_urls(replica))
        if path == "/metrics" and method == "GET" and _query(scope).get("scope") == ["all"]:
            await self._metrics_all(replica, scope, send)
            return True
        return False

    async def _owner_url(self, replica: ReplicaMembership, session_id: str) -> str | None:
        """The URL of the live sibling that owns ``session_id``, or None (here, unbound, dead)."""
        bound = await replica.binding.get(session_id)
        if bound is None or bound.replica_id == replica.replica_id:
            return None
        live = await replica.registry.live_replicas()
        owner = next((r for r in live if r.replica_id == bound.replica_id), None)
        return owner.url if owner is not None else None

    async def _sibling_urls(self, replica: ReplicaMembership) -> list[str]:
        return [url for _, url in await self._siblings(replica)]

    async def _siblings(self, replica: ReplicaMembership) -> list[tuple[str, str]]:
        """``(replica id, url)`` of every live sibling, by replica id."""
        live = await replica.registry.live_replicas()
        return [
            (r.replica_id, r.url)
            for r in sorted(live, key=lambda r: r.replica_id)
            if r.replica_id != replica.replica_id
        ]

    async def _relay_ws(self, scope: Any, receive: Receive, send: Send, url: str) -> bool:
        """Relay the upgrade to the owner; False (serve here) when the owner cannot be reached."""
        websocket = WebSocket(scope, receive, send)
        upgrade = ClientUpgrade.of(scope, (FORWARDED.decode(), "1"))
        max_size = scope["app"].state.ctx.settings.max_message_bytes
        try:
            upstream = await upgrade.open(url, open_timeout_s=OPEN_TIMEOUT_S, max_size=max_size)
        except ReplicaUnreachable as exc:
            log.warning("worker forward: owner %s unreachable (%s); serving here", url, exc)
            return False
        except ReplicaRefused as exc:
            await websocket.send_denial_response(exc.denial.response())
            return True
        await serve_relayed(websocket, receive, send, upstream)
        return True

    async def _forward_http(self, scope: Any, receive: Receive, send: Send, urls: list[str]) -> bool:
        """Send the request to each of ``urls`` in turn; the first answer that is not 404 (the
        last one's for a hangup nobody knows) is relayed. False: serve here (body replayed)."""
        if not urls:
            return False
        scope = dict(scope, headers=[*scope["headers"], (FORWARDED, b"1")])
        request = Request(scope, receive)
        try:  # bounded while reading (web/edge/bodies.py)
            body = await read_body(request, MAX_FORWARDED_BODY_BYTES)
        except BodyRefused as refused:
            await refused.response(scope, receive, send)
            return True
        client = scope.get("client")
        for url in urls:
            try:
                answer = await self.http.forward(
                    request, body, url, client_host=client[0] if client else None
                )
            except ReplicaHttpUnreachable as exc:
                log.warning("worker forward: %s unreachable (%s)", url, exc)
                continue
            if answer.status_code != 404 or len(urls) == 1:
                await to_response(answer)(scope, receive, send)
                return True

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
        return True

    async def _metrics_all(self, replica: ReplicaMembership, scope: Any, send: Send) -> None:
        from web.server.metrics import METRICS_CONTENT_TYPE, merge_worker_metrics

        texts = [(worker_label(replica.replica_id), scope["app"].state.ctx.metrics.render().decode())]
        for replica_id, url in await self._siblings(replica):
            try:
                reply = await self.http.client.get(url + "/metrics", headers={FORWARDED.decode(): "1"})
            except Exception as exc:  # a sibling restarting: its share is missing from this scrape
                log.warning("worker metrics: %s: %s", url, exc)
                continue
            if reply.status_code == 200:
                texts.append((worker_label(replica_id), reply.text))
        response = Response(merge_worker_metrics(texts), media_type=METRICS_CONTENT_TYPE)

        async def no_receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        await response(scope, no_receive, send)
