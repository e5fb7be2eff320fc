"""`omniduplex gateway`: a stateless router in front of the replicas (run as many as you like).

Everything it knows comes from Redis on each request: the replica registry and each session's
binding (``session.affinity``); nothing is kept between requests, so gateways need no
coordination and any of them can die.

* ``GET /v1/realtime`` (WebSocket): a new session goes to a replica picked by power of two
  choices; ``?session_id=`` (a resume) goes to the session's owner, or after the owner's lease
  lapsed to a live replica that takes the session over and rebuilds it from Redis. Frames are
  then relayed both ways unchanged (:mod:`web.gateway.relay`). Subprotocols and auth headers
  pass through; the replica authenticates, and its refusals (401, 403, 429, ...) reach the
  client as they are.
* ``GET /v1/realtime/video`` (WebSocket, world-model sessions): routed and relayed exactly
  like ``/v1/realtime`` (new → a picked replica; ``?session_id=`` → the world's owner, the only
  replica that can continue it; chunks' binary frames pass unchanged).
* ``POST /v1/realtime/calls`` and ``POST /v1/realtime/video/calls``: the SDP offer goes to a
  picked replica; its answer carries the replica's own ICE candidates, so media then flows
  between client and replica directly. The call → replica pair is kept in Redis (with a TTL)
  so the hangup (``POST .../calls/{id}/hangup``, ``DELETE /v1/realtime/video/calls/{id}``)
  finds the replica.
* REST: ``/v1/sessions/{id}`` (to the owner, else any live replica), ``/v1/models``,
  ``/v1/realtime/client_secrets`` (any replica: keys live in the shared Redis),
  ``/v1/replicas`` (admin key; answered from the registry), ``/healthz``, ``/readyz``.

No live replica: 503 with ``Retry-After`` (WebSocket: ``error`` ``no_replica_available`` then
close 1013). Redis unreachable: 503 ``store_unavailable``, never a guess from stale data.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from session.affinity import ReplicaInfo
from session.identity import ApiKeyMap
from session.store.embedded import redis_connection
from session.store.errors import StoreError
from session.store.redis_store import redis_errors
from web.deploy.replica import admin_denial, registry_json
from web.edge.auth import is_loopback_host
from web.edge.bodies import MAX_FORWARDED_BODY_BYTES, BodyRefused, read_body
from web.edge.cors import CorsMiddleware, origin_policy
from web.edge.uvicorn_guards import install
from web.gateway.http_forward import ReplicaHttpUnreachable, to_response
from web.gateway.routing import NoReplicaAvailable
from web.gateway.state import Gateway, GatewaySettings
from web.gateway.ws_endpoint import RealtimeRelayEndpoint, live_error, robot_error, world_error

log = logging.getLogger("omniduplex.gateway")

CALL_TTL_S = 2 * 3600  # a call outlives no session (max lifetime 60 min by default)
RETRIES = 3  # replicas tried per request before giving up


def error_response(status: int, code: str, message: str, *, retry_after_s: float | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    body = {"error": {"type": kind, "code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def unavailable(exc: Exception) -> Response:
    if isinstance(exc, NoReplicaAvailable):
        return error_response(503, "no_replica_available", str(exc), retry_after_s=exc.retry_after_s)
    message = f"The session store is unreachable: {exc}"
    return error_response(503, "store_unavailable", message, retry_after_s=1)


# --- REST --------------------------------------------------------------------------------------


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "role": "gateway"})


async def readyz(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        live = await gw.registry.live_replicas()
    except StoreError as exc:
        return unavailable(exc)
    serving = sum(1 for r in live if r.accepting)
    status = 200 if serving else 503
    body = {"status": "ready" if serving else "no_replica", "replicas": len(live)}
    return JSONResponse(body, status_code=status)


async def replicas(request: Request) -> Response:
    gw = gateway_of(request)
    denied = admin_denial(request.headers.get("authorization"), gw.settings.admin_key)
    if denied is not None:
        return error_response(*denied)
    try:
        return JSONResponse(await registry_json(gw.registry))
    except StoreError as exc:
        return unavailable(exc)


async def _forward_to(gw: Gateway, request: Request, body: bytes, replica: ReplicaInfo) -> Response | None:
    """The replica's answer, or None when it cannot be reached."""
    host = request.client.host if request.client else None
    try:
        return to_response(await gw.http.forward(request, body, replica.url, client_host=host))
    except ReplicaHttpUnreachable as exc:
        log.warning("replica %s unreachable: %s", replica.replica_id, exc)
        return None


async def _authorized_body(request: Request) -> tuple[Gateway, bytes] | Response:
    """The gateway and the request's body (bounded while read, web/edge/bodies.py), or the refusal
    (401 without a valid key, the body's own refusal)."""
    gw = gateway_of(request)
    if not await gw.authorized(request.headers.get("authorization"), []):
        return error_response(401, "invalid_api_key", "Missing or invalid API key.")
    try:
        return gw, await read_body(request, MAX_FORWARDED_BODY_BYTES)
    except BodyRefused as refused:
        return refused.response


async def _forward_retrying(
    request: Request, pick: Callable[[Gateway, set[str]], Awaitable[ReplicaInfo]]
) -> Response:
    """Forward to the replica ``pick`` names, up to RETRIES replicas while they are unreachable
    (503 when none could be reached or Redis is down)."""
    got = await _authorized_body(request)
    if isinstance(got, Response):
        return got
    gw, body = got
    tried: set[str] = set()
    try:
        for _ in range(RETRIES):
            replica = await pick(gw, tried)
            answer = await _forward_to(gw, request, body, replica)
            if answer is not None:
                return answer
            tried.add(replica.replica_id)
        raise NoReplicaAvailable("no replica could be reached")
    except (NoReplicaAvailable, StoreError) as exc:
        return unavailable(exc)


async def any_replica(request: Request) -> Response:
    """Requests every replica answers alike (`/v1/models`, client secrets)."""

    async def pick(gw: Gateway, tried: set[str]) -> ReplicaInfo:
        return await gw.router.any_replica(exclude=tried)

    return await _forward_retrying(request, pick)


async def session_rest(request: Request) -> Response:
    """`GET|DELETE /v1/sessions/{id}`: to the owner while it lives, else any live replica."""
    session_id = request.path_params["session_id"]

    async def pick(gw: Gateway, tried: set[str]) -> ReplicaInfo:
        return (await gw.router.session(session_id, exclude=tried)).replica

    return await _forward_retrying(request, pick)


async def create_call(request: Request) -> Response:
    """`POST /v1/realtime/calls` (voice) or `POST /v1/realtime/video/calls` (world): the offer
    to a picked replica; media then goes direct. A resuming call (``?session_id=``) goes to
    the session's owner, like a WebSocket resume (an unreachable owner's lease is waited out)."""
    got = await _authorized_body(request)
    if isinstance(got, Response):
        return got
    gw, body = got
    resuming = request.query_params.get("session_id")
    try:
        if resuming:
            answer, replica = await _resume_call(gw, request, body, resuming)
        else:
            answer, replica = await _new_call(gw, request, body)
        location = answer.headers.get("location", "")
        call_id = location.rstrip("/").rsplit("/", 1)[-1] if answer.status_code == 201 else ""
        if call_id and replica is not None:
            async with redis_errors():
                await gw.redis.set(gw.call_key(call_id), replica.replica_id, ex=CALL_TTL_S)
        return answer
    except (NoReplicaAvailable, StoreError) as exc:
        return unavailable(exc)


async def _new_call(gw: Gateway, request: Request, body: bytes) -> tuple[Response, ReplicaInfo | None]:
    tried: set[str] = set()
    last: Response | None = None
    for _ in range(RETRIES):
        replica = await gw.router.new_session(exclude=tried)
        answer = await _forward_to(gw, request, body, replica)
        tried.add(replica.replica_id)
        if answer is None:
            continue
        if answer.status_code == 503:  # draining or full: another replica may take it
            last = answer
            continue
        return answer, replica
    if last is not None:
        return last, None
    raise NoReplicaAvailable("no replica could be reached")


async def _resume_call(
    gw: Gateway, request: Request, body: bytes, session_id: str
) -> tuple[Response, ReplicaInfo | None]:
    """A resuming call, routed as `ws_endpoint.connect_resume` routes a WebSocket resume: the
    owner; an owner that cannot be reached (killed a moment ago) or whose address now answers
    409 (restarted under a new id) has its lease waited out, then a live replica takes the
    session over; a world no other replica can take over is gone with its owner (404)."""
    tried: set[str] = set()
    refused_takeover = False
    for _ in range(RETRIES + 1):
        try:
            route = await gw.router.session(session_id, exclude=tried)
        except NoReplicaAvailable:
            if refused_takeover:
                return _gone_with_its_owner(session_id), None
            raise
        answer = await _forward_to(gw, request, body, route.replica)
        if answer is None or (answer.status_code == 409 and route.kind == "owner"):
            if route.kind != "owner":
                tried.add(route.replica.replica_id)
                continue
            log.info("resume call %s: owner %s not answering; awaiting its lease", session_id, route.owner)
            if not await gw.router.wait_lapse(route.replica.replica_id, gw.settings.lapse_wait_s):
                raise NoReplicaAvailable(f"the owner of {session_id} is unreachable but holds its lease")
            continue
        if answer.status_code == 409 and route.kind == "failover":
            tried.add(route.replica.replica_id)  # it would not take the session over
            refused_takeover = True
            continue
        if answer.status_code == 503 and route.kind != "owner":
            tried.add(route.replica.replica_id)
            continue
        return answer, route.replica
    if refused_takeover:
        return _gone_with_its_owner(session_id), None
    raise NoReplicaAvailable(f"no replica could take session {session_id}")


def _gone_with_its_owner(session_id: str) -> Response:
    message = (
        f"Session {session_id} lived on a replica that is gone, and no other replica can take it "
        "over (a world session ends with its replica's process)."
    )
    return error_response(404, "session_not_found", message)


async def call_action(request: Request) -> Response:
    """A call's hangup (`POST /v1/realtime/calls/{call_id}/hangup`, `DELETE
    /v1/realtime/video/calls/{call_id}`): to the replica that answered the call."""
    gw = gateway_of(request)
    call_id = request.path_params["call_id"]
    try:
        async with redis_errors():
            replica_id = await gw.redis.get(gw.call_key(call_id))
        live = {r.replica_id: r for r in await gw.registry.live_replicas()}
    except StoreError as exc:  # never guess which replica has the call
        return unavailable(exc)
    replica = live.get(str(replica_id)) if replica_id else None
    if replica is None:
        return error_response(404, "call_not_found", f"No live call {call_id}.")
    try:
        body = await read_body(request, MAX_FORWARDED_BODY_BYTES)
    except BodyRefused as refused:
        return refused.response
    answer = await _forward_to(gw, request, body, replica)
    return answer if answer is not None else error_response(404, "call_not_found", f"No live call {call_id}.")


def routes() -> list[BaseRoute]:
    return [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/v1/replicas", replicas),
        Route("/v1/models", any_replica),
        Route("/v1/realtime/client_secrets", any_replica, methods=["POST"]),
        Route("/v1/sessions/{session_id}", session_rest, methods=["GET", "DELETE"]),
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", call_action, methods=["POST"]),
        WebSocketRoute("/v1/realtime", RealtimeRelayEndpoint()),
        # World-model sessions: the same routing and relay, the world protocol's error event.
        Route("/v1/realtime/video/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/video/calls/{call_id}", call_action, methods=["DELETE"]),
        WebSocketRoute("/v1/realtime/video", RealtimeRelayEndpoint(world_error)),
        # Robot policy sessions: routed alike (frames relayed as they come, binary included).
        WebSocketRoute("/v1/realtime/robot/openpi", RealtimeRelayEndpoint(robot_error)),
        # GPT-Live sessions (duplex pipelines): relayed like /v1/realtime; calls like voice calls.
        WebSocketRoute("/v1/live/sessions", RealtimeRelayEndpoint(live_error)),
        Route("/v1/live/sessions", create_call, methods=["POST"]),
        Route("/v1/live/sessions/{call_id}", call_action, methods=["DELETE"]),
    ]


def create_gateway_app(settings: GatewaySettings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Fail fast instead of retrying with backoff: the answer to a Redis outage is a 503 now.
        async with redis_connection(
            settings.redis_url, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 1)
        ) as redis:
            gateway = Gateway(settings, redis)
            app.state.gateway = gateway
            try:
                yield
            finally:
                await gateway.close()

    policy = origin_policy(settings.cors_origins, settings.api_keys)  # judged here, at the edge
    middleware = [Middleware(CorsMiddleware, policy=policy)]
    return Starlette(routes=routes(), middleware=middleware, lifespan=lifespan)


def uvicorn_config(settings: GatewaySettings, log_level: str = "info") -> uvicorn.Config:
    config = uvicorn.Config(
        create_gateway_app(settings),
        host=settings.host,
        port=settings.port,
        ws="websockets-sansio",
        ws_max_size=settings.max_message_bytes,
        ws_per_message_deflate=False,  # relayed frames as they are: no inflate/deflate per frame
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return install(config, http_timeout_s=10.0, ws_send_timeout_s=15.0)  # web/edge/uvicorn_guards.py


def key_count(spec: str) -> int:
    """Configured API keys: ``","`` or ``" "`` is none (web/commands/serve.py's rule)."""
    try:
        return len(ApiKeyMap.parse(spec)) if spec.strip() else 0
    except ValueError:
        return 0


def run_gateway(args: argparse.Namespace) -> int:
    settings = GatewaySettings.from_args(args)
    log_level = str(getattr(args, "log_level", "info"))
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO))
    if not key_count(settings.api_keys) and not settings.insecure and not is_loopback_host(settings.host):
        print(
            f"omniduplex: refusing to run a gateway on {settings.host} without API keys: "
            "set OMNIDUPLEX_API_KEYS (or --api-keys), or pass --insecure",
            file=sys.stderr,
        )
        return 2
    uvicorn.Server(uvicorn_config(settings, log_level=log_level)).run()
    return 0
