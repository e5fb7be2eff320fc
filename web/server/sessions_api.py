"""`GET /v1/sessions/{id}` (a session's state) and `DELETE /v1/sessions/{id}` (end it).

Same credentials as the realtime endpoint; a session is visible only to its tenant: another
tenant's id, an unknown one and an expired one all answer 404 `session_not_found`. An `ek_`
client secret sees only the sessions it opened (404 for the tenant's others).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from session.identity import Principal, api_key_from_request, authenticate, is_session_id
from session.live.hosting import LiveHost
from session.robot.hosting import RobotHost
from session.store.errors import SessionNotFound, StoreUnavailable
from session.voice.hosting import SessionHost
from session.world.hosting import WorldHost
from web.edge.refusals import error_body
from web.server.context import ServerContext


async def _principal(request: Request) -> Principal | None:
    ctx: ServerContext = request.app.state.ctx
    if ctx.open_mode:
        return Principal("default")
    return await authenticate(
        api_key_from_request(request.headers.get("authorization")), ctx.api_keys, ctx.ephemeral
    )


def _not_found() -> JSONResponse:
    return error_body(404, "session_not_found", "No such session (it may have expired).")


async def session_endpoint(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    host: SessionHost | WorldHost | RobotHost | LiveHost = ctx.host
    try:
        principal = await _principal(request)
    except StoreUnavailable:
        return error_body(503, "store_unavailable", "The session store is unavailable.", retry_after_s=1)
    if principal is None:
        return error_body(401, "invalid_api_key", "Missing or invalid API key.")
    session_id = request.path_params["session_id"]
    for kind in (ctx.world, ctx.robot, ctx.live):  # a session of another kind live here
        if kind is not None and kind.live(principal.tenant, session_id) is not None:
            host = kind  # same describe/delete interface
    try:
        if not is_session_id(session_id):
            raise SessionNotFound(session_id)
        if not await ctx.ephemeral.may_access(principal, session_id):  # an ek_ key: its own only
            raise SessionNotFound(session_id)
        if request.method == "DELETE":
            await host.delete(principal.tenant, session_id)
            return JSONResponse({"id": session_id, "object": "realtime.session.deleted", "deleted": True})
        body = await host.describe(principal.tenant, session_id)
    except SessionNotFound:
        return _not_found()
    except StoreUnavailable:
        return error_body(503, "store_unavailable", "The session store is unavailable.", retry_after_s=1)
    replica = ctx.replica
    if replica is not None:  # scale-out: where the session is bound (web/deploy/replica.py)
        try:
            body["replica"] = await replica.owner_json(session_id)
        except StoreUnavailable:
            body["replica"] = None
    return JSONResponse(body)


def session_routes() -> list[BaseRoute]:
    return [Route("/v1/sessions/{session_id}", session_endpoint, methods=["GET", "DELETE"])]
