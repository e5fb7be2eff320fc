"""The ASGI app: routes only; all state lives in the ServerContext built by the lifespan."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from media.webrtc import parse_ice_servers
from runtime.spec import load_pipeline
from session.identity import Principal, api_key_from_request, authenticate
from session.robot.hosting import RobotHost
from session.robot.metadata import policy_metadata
from session.world.hosting import WorldHost
from session.world.runtimes import OrchestratorPool
from web.deploy.replica import ReplicaGate, replica_membership, replica_routes
from web.deploy.stages import stage_routes
from web.edge.bodies import BodyRefused, read_json_body
from web.edge.cors import CorsMiddleware, origin_policy
from web.edge.refusals import error_body
from web.server.context import ServerContext, server_context
from web.server.sessions_api import session_routes
from web.settings import ServerSettings
from web.transports.live_ws import LiveService
from web.transports.realtime_ws import realtime_endpoint
from web.transports.robot import RobotService, openpi_port, robot_api_key
from web.transports.video import VideoService
from web.transports.webrtc import WebRtcService

log = logging.getLogger(__name__)


def ctx_of(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    ctx = ctx_of(request)
    if not ctx.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    try:
        await ctx.redis.ping()
    except Exception as exc:
        return JSONResponse({"status": "redis unavailable", "error": str(exc)}, status_code=503)
    counts = ctx.metrics.session_counts()  # voice and world
    body = {"status": "ready", "pipeline": ctx.spec.name, "sessions": sum(counts.values())}
    return JSONResponse({**body, "sessions_by_kind": counts})


async def models(request: Request) -> Response:
    ctx = ctx_of(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [{"id": ctx.spec.name, "object": "model", "created": 0, "owned_by": "omniduplex"}],
        }
    )


async def client_secrets(request: Request) -> Response:
    """`POST /v1/realtime/client_secrets`: a short-lived `ek_` key scoped to a session config."""
    ctx = ctx_of(request)
    principal = await authenticate(
        api_key_from_request(request.headers.get("authorization")), ctx.api_keys, None
    )
    if principal is None and ctx.open_mode:
        from session.identity import Principal

        principal = Principal("default")
    if principal is None:
        return error_body(401, "invalid_api_key", "Missing or invalid API key.")
    try:  # read with a byte limit and a deadline; depth and Unicode checked (web/edge/bodies.py)
        body: Any = await read_json_body(request)
    except BodyRefused as refused:
        return refused.response
    body = {} if body is None else body
    if not isinstance(body, dict):
        return error_body(400, "invalid_value", "The body must be a JSON object.")
    ttl = ctx.settings.ephemeral_ttl_s
    expires = body.get("expires_after")
    if isinstance(expires, dict) and "seconds" in expires:
        seconds = expires["seconds"]
        if not isinstance(seconds, int) or not 10 <= seconds <= 7200:
            return error_body(400, "invalid_value", "expires_after.seconds must be an integer in [10, 7200].")
        ttl = float(seconds)
    session = body.get("session") or {"type": "realtime"}
    if not isinstance(session, dict):
        return error_body(400, "invalid_value", "session must be an object.")
    from session.realtime.config import SessionConfig, SessionIn

    try:
        effective = SessionConfig(model=ctx.spec.name).apply_update(SessionIn.model_validate(session))
    except Exception as exc:
        return error_body(400, "invalid_value", f"session: {exc}")
    secret = await ctx.ephemeral.create(principal.tenant, session, ttl_s=ttl)
    wire = effective.to_wire(session_id="", expires_at=int(secret.expires_at))
    wire.pop("id", None)
    return JSONResponse({"value": secret.value, "expires_at": int(secret.expires_at), "session": wire})


async def metrics(request: Request) -> Response:
    """`GET /metrics`: Prometheus text exposition of this process."""
    from web.server.metrics import METRICS_CONTENT_TYPE

    return Response(ctx_of(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


def routes() -> list[BaseRoute]:
    return [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/realtime/client_secrets", client_secrets, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        *session_routes(),
    ]


async def video_principal(conn: HTTPConnection) -> Principal | None:
    """World-model sessions authenticate like realtime ones (API key or ephemeral key → tenant);
    open mode (no keys configured) is tenant ``default``."""
    ctx: ServerContext = conn.app.state.ctx
    if ctx.open_mode:
        return Principal("default")
    protocols = [p.strip() for p in conn.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = api_key_from_request(conn.headers.get("authorization"), protocols)
    return await authenticate(key, ctx.api_keys, ctx.ephemeral)


def robot_identify(ctx: ServerContext) -> Callable[[HTTPConnection], Awaitable[Principal | None]]:
    """Robots authenticate like voice sessions (openpi's ``Api-Key`` scheme too), on the main
    port and on the bare openpi port alike (hence bound to the context, not to an app)."""

    async def identify(conn: HTTPConnection) -> Principal | None:
        if ctx.open_mode:
            return Principal("default")
        return await authenticate(robot_api_key(conn), ctx.api_keys, ctx.ephemeral)

    return identify


def robot_metadata(pipeline: str) -> dict[str, Any] | None:
    """The robot policy's metadata from its pipeline YAML (the policy itself loads on first
    use); None, logged, when it cannot be read: robots are then refused (503), and nothing
    else of the server depends on it."""
    try:
        return policy_metadata(load_pipeline(pipeline))
    except Exception:
        log.warning("robot pipeline %r unavailable: robot sessions are refused", pipeline, exc_info=True)
        return None


def create_app(settings: ServerSettings) -> Starlette:
    webrtc = WebRtcService(settings)
    pool = OrchestratorPool()
    live = LiveService()  # GPT-Live sessions, when the pipeline takes its own turns
    robot = RobotService(pool, robot_metadata(settings.robot_pipeline), pipeline=settings.robot_pipeline)
    video = VideoService(
        pool,
        ice_servers=parse_ice_servers(settings.stun, settings.turn),
        identify=video_principal,  # slots, records, retention: the WorldHost set in the lifespan
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = time.monotonic()
        async with server_context(settings) as ctx:
            app.state.ctx = ctx
            app.state.body_timeout_s = settings.http_timeout_s  # web/edge/bodies.py
            app.state.started = started
            app.state.webrtc = webrtc
            # World sessions share the voice sessions' store, admission slots and binding.
            world = video.host = ctx.world = WorldHost(ctx.host)
            app.state.video = video
            ctx.metrics.bind_worlds(video.live_sessions)  # counted in metrics, /readyz, load
            await world.start()
            # Robot sessions too: same store, slots and binding; their policy runs in the pool.
            robots = RobotHost(ctx.host, robot.new_driver, pipeline=settings.robot_pipeline)
            robot.host = ctx.robot = robots
            app.state.robot_service = robot
            robot.observer = ctx.metrics
            robot.identify = robot_identify(ctx)
            ctx.metrics.bind_robots(lambda: len(robots.sessions))
            await robots.start()
            live_host = ctx.live = live.build_host(ctx)  # None: the pipeline refuses them
            if live_host is not None:
                ctx.metrics.bind_live(lambda: len(live_host.sessions))
                await live_host.start()
            try:

                def load() -> int:  # live voice and world sessions
                    return sum(ctx.metrics.session_counts().values())

                # Scale-out (web/deploy/replica.py): registry lease and SIGTERM drain; None when standalone.
                async with replica_membership(settings, ctx.redis, load=load) as replica:
                    ctx.replica = app.state.replica = replica  # the app's for web/deploy's middleware
                    if replica is not None:  # admit and bind under the deployment's replica id
                        ctx.host.join_replica(replica.replica_id, replica.claim)
                        replica.on_lease_regained(ctx.host.recheck_bindings)  # fence moved sessions
                    bare = openpi_port(robot, settings.host, settings.openpi_port, shared=settings.worker)
                    async with bare:  # `--openpi-port N`: openpi's root path on its own port
                        yield
            finally:
                await live.close()  # its WebRTC calls
                if live_host is not None:
                    await live_host.close()  # every live session ends: its model context is here
                await webrtc.close()
                await robots.close()  # parked: context in Redis, resumable after a restart
                await world.close()  # every world ends: cancelled, slot released, record deleted
                await video.close()
                await pool.close()

    middleware = [Middleware(ReplicaGate)]  # refuses new sessions while the replica drains
    if settings.worker:  # `serve --workers N`: a sibling's session goes to that sibling
        from web.deploy.worker_forward import WorkerForward

        middleware.insert(0, Middleware(WorkerForward))
    # Outermost: a browser's origin is judged once, by the process it reached (web/edge/cors.py).
    policy = origin_policy(settings.cors_origins, settings.api_keys)
    middleware.insert(0, Middleware(CorsMiddleware, policy=policy))
    # The video routes come first: they include a static mount for /world.
    return Starlette(
        routes=[
            *video.routes(), *routes(), *robot.routes(), *live.routes(), *webrtc.routes(), *replica_routes(),
            *stage_routes(),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )
