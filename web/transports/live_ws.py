"""``GET /v1/live/sessions``: OpenAI's GPT-Live protocol over WebSocket, for duplex pipelines.

Only bytes ⇄ events here; sessions live in the :class:`~session.live.hosting.LiveHost`
(``ServerContext.live``, built when the server's pipeline takes its own turns). Everything that can
be refused before a session exists is refused before the upgrade, as an HTTP answer with a
JSON body (what LiveKit's ``GPTLiveModel`` reports as a failed connection):

* 400 ``live_sessions_unsupported``: the pipeline does not take its own turns (use
  ``/v1/realtime``); 401 ``invalid_api_key``; 429 with ``Retry-After`` when no slot is free;
  503 ``store_unavailable`` when Redis is down;
* resume (``?session_id=…``, token in ``X-Omni-Resume-Token``): 403 ``invalid_resume_token``,
  404 ``session_not_found`` (unknown, ended, another tenant's, or its process is gone), 409
  ``session_elsewhere`` (scale-out).

The 101 of a new session carries ``X-Omni-Session-Id`` and ``X-Omni-Resume-Token``; a client
that asks for the extensions (``?omni_extensions=1`` or ``X-Omni-Extensions: 1``) also finds
the token in ``session.started``'s ``session.omni``. Everything after the upgrade (the first
event must be ``session.start``) is the core's (:mod:`session.live.core`).

The same service answers ``POST /v1/live/sessions`` with an SDP offer (a WebRTC call:
:mod:`web.transports.live_call`, refused before any peer connection exists, as above) and ``DELETE
/v1/live/sessions/{call_id}`` (the call's ``Location``: its session ends).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from media.webrtc import OfferError, parse_ice_servers
from session.identity import RESUME_HEADER, Principal, resume_token_from_request
from session.live.core import LiveCoreOptions, LiveSessionCore
from session.live.delegation import ResponsesRunner
from session.live.driver import LiveDriver, LiveEntryPoint
from session.live.events import DelegationTarget, LiveLimits
from session.live.hosting import LiveHost, LiveSession
from session.store.errors import SessionNotFound, StoreUnavailable
from web.edge.refusals import STARTING, STORE_DOWN, UNAUTHORIZED, Denial, authorize_resume, open_admitted
from web.server.context import ServerContext
from web.transports.live_call import LiveCall, answer_offer, new_call_id, read_offer
from web.transports.omni_extensions import raw_headers, resume_headers, wants_extensions
from web.transports.realtime_ws import WebSocketTransport, offered_subprotocols, principal_for

log = logging.getLogger(__name__)

LIVE_PATH = "/v1/live/sessions"


def unsupported(pipeline: str) -> Denial:
    return Denial(
        400,
        "live_sessions_unsupported",
        f"The pipeline '{pipeline}' does not take its own turns: GPT-Live sessions need a full-duplex "
        "model (e.g. --pipeline duplex-tiny). Use the Realtime protocol (/v1/realtime) with this one.",
    )


class LiveService:
    """GPT-Live sessions of this process: the host (set in the lifespan) and the endpoints."""

    def __init__(self, limits: LiveLimits | None = None, *, connect_timeout_s: float = 30.0) -> None:
        self.limits = limits or LiveLimits()
        self.connect_timeout_s = connect_timeout_s
        self.host: LiveHost | None = None
        self.ctx: ServerContext | None = None
        self.calls: dict[str, LiveCall] = {}
        self.call_sessions: dict[str, tuple[str, str]] = {}  # call id -> (tenant, session id), live calls
        self._tasks: set[asyncio.Task[None]] = set()

    # --- the session layer -------------------------------------------------------------------

    def build_host(self, ctx: ServerContext) -> LiveHost | None:
        """The live host on the process's shared session parts; None when the pipeline does
        not take its own turns (its sessions are then refused)."""
        self.ctx = ctx
        caps = ctx.capabilities
        if caps.live_entry is None or not caps.live_responses:
            return None
        live = LiveEntryPoint(caps.live_entry, caps.input_rate)
        # `responses` delegation runs on the pipeline's text model: the stage its `responses`
        # entry names (e.g. speech.responder); without one, sessions may only delegate to the client.
        text_entry = ctx.spec.entries.get("responses")
        runner = ResponsesRunner(ctx.orchestrator, text_entry, model=ctx.spec.name) if text_entry else None
        targets: frozenset[DelegationTarget] = frozenset({"client", "responses"} if runner else {"client"})

        def new_driver(session_id: str, expires_at: int, resume: dict[str, Any] | None) -> LiveDriver:
            options = LiveCoreOptions(
                session_id=session_id,
                pipeline=ctx.spec.name,
                expires_at=expires_at,
                delegations=targets,
                limits=self.limits,
                resume=resume,
            )
            return LiveDriver(
                LiveSessionCore(options),
                ctx.orchestrator,
                live,
                outbox_max_bytes=ctx.settings.outbox_max_bytes,
                delegations=runner,
                observer=ctx.metrics,
            )

        self.host = LiveHost(ctx.host, new_driver, pipeline=ctx.spec.name)
        return self.host

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute(LIVE_PATH, self.endpoint, name="live_sessions"),
            Route(LIVE_PATH, self.create_call, methods=["POST"], name="live_calls"),
            Route(LIVE_PATH + "/{call_id}", self.hangup, methods=["DELETE"], name="live_call"),
        ]

    async def close(self) -> None:
        """Shutdown: end every call (before the host ends their sessions)."""
        for call in list(self.calls.values()):
            await call.link.close("server shutting down")
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- one connection ----------------------------------------------------------------------

    async def _session_for(
        self, conn: WebSocket | Request, subprotocols: list[str], kind: str
    ) -> tuple[LiveHost, LiveSession, str | None] | Denial:
        """Who is calling, and their new or resumed session; or why not (before any upgrade)."""
        ctx = self.ctx
        if ctx is None:
            return STARTING
        host = self.host
        if host is None:
            return unsupported(ctx.spec.name)
        try:
            principal = await principal_for(ctx, conn.headers, subprotocols)
        except StoreUnavailable:
            return STORE_DOWN
        if principal is None:
            return UNAUTHORIZED
        announce = wants_extensions(conn.query_params, conn.headers)
        opened: tuple[LiveSession, str | None] | Denial
        if conn.query_params.get("session_id") is not None:
            opened = await self._resume(host, conn, principal, subprotocols)
        else:
            opened = await self._open(host, principal, announce, kind)
        if isinstance(opened, Denial):
            return opened
        s, token = opened
        if principal.ephemeral_key is not None:  # an ek_ key may later GET/DELETE what it opened
            try:
                await ctx.ephemeral.bind_session(principal, s.session_id)
            except Exception:
                log.debug("live session %s: ephemeral binding not stored", s.session_id)
        return host, s, token

    async def endpoint(self, websocket: WebSocket) -> None:
        got = await self._session_for(websocket, offered_subprotocols(websocket), "websocket")
        if isinstance(got, Denial):
            if self.ctx is not None:
                self.ctx.metrics.admission(got.code)
            await websocket.send_denial_response(got.response())
            return
        host, s, token = got
        transport = WebSocketTransport(websocket)
        try:
            headers = resume_headers(s.session_id, token) if token is not None else None
            await websocket.accept(headers=raw_headers(headers) if headers else None)
            attached = await (host.open(s, transport) if token is not None else host.resume(s, transport))
            link = s.driver.link
            if attached and link is not None:
                await link.wait()
        finally:
            code = transport.info.disconnect_code
            await asyncio.shield(host.connection_ended(s, transport, code))

    async def _open(
        self, host: LiveHost, principal: Principal, announce: bool, kind: str
    ) -> tuple[LiveSession, str] | Denial:
        opened = await open_admitted(
            host,
            principal.tenant,
            lambda session_id: host.create(
                session_id, principal.tenant, transport_kind=kind, announce=announce
            ),
        )
        if not isinstance(opened, Denial):
            assert self.ctx is not None
            self.ctx.metrics.admission("admitted")
        return opened

    async def _resume(
        self, host: LiveHost, conn: WebSocket | Request, principal: Principal, subprotocols: list[str]
    ) -> tuple[LiveSession, None] | Denial:
        session_id = conn.query_params.get("session_id", "")
        token = resume_token_from_request(conn.headers.get(RESUME_HEADER), subprotocols)

        async def authorize(token: str) -> tuple[LiveSession, None]:
            return await host.authorize(principal.tenant, session_id, token), None

        return await authorize_resume(session_id, token, authorize)

    # --- WebRTC (POST /v1/live/sessions with an SDP offer) ------------------------------------

    async def create_call(self, request: Request) -> Response:
        """A new session's call, or (``?session_id=…``, token in ``X-Omni-Resume-Token``) a call
        that resumes one. Refusals come before any peer connection exists."""
        offer = await read_offer(request)
        if isinstance(offer, Response):
            return offer
        got = await self._session_for(request, [], "webrtc")
        if isinstance(got, Denial):
            if self.ctx is not None:
                self.ctx.metrics.admission(got.code)
            return got.response()
        host, s, token = got
        assert self.ctx is not None
        ice = parse_ice_servers(self.ctx.settings.stun, self.ctx.settings.turn)
        try:
            link, answer = await answer_offer(offer, ice)
        except BaseException as exc:
            if token is not None:  # nobody holds its token yet: the new session ends
                await host.connection_ended(s, None, None)
            if isinstance(exc, OfferError):
                return Denial(400, "invalid_offer", str(exc)).response()
            raise
        call = LiveCall(
            new_call_id(), link, connect_timeout_s=self.connect_timeout_s, new_session=token is not None
        )
        call.bind(s.driver)
        self.calls[call.call_id] = call
        self.call_sessions[call.call_id] = (s.tenant, s.session_id)
        task = asyncio.create_task(
            self._serve_call(host, s, call, token), name=f"{call.call_id}:{s.session_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        headers = {"Location": f"{LIVE_PATH}/{call.call_id}"}
        if token is not None:
            headers.update(resume_headers(s.session_id, token))
        return Response(answer, status_code=201, media_type="application/sdp", headers=headers)

    async def _serve_call(self, host: LiveHost, s: LiveSession, call: LiveCall, token: str | None) -> None:
        try:
            if await call.watch_connect():
                attached = await (
                    host.open(s, call) if token is not None else host.resume(s, call, kind="webrtc")
                )
                link = s.driver.link
                if attached and link is not None:
                    await link.wait()
        except Exception:
            log.exception("live call %s: serving session %s failed", call.call_id, s.session_id)
        finally:
            self.calls.pop(call.call_id, None)
            self.call_sessions.pop(call.call_id, None)
            await asyncio.shield(host.connection_ended(s, call, call.info.disconnect_code))
            await call.link.close("call ended")

    async def hangup(self, request: Request) -> Response:
        """``DELETE /v1/live/sessions/{call_id}`` (the call's ``Location``): the call's session
        ends (``session.closed {reason: "remote_hangup"}`` on its channel)."""
        ctx, host = self.ctx, self.host
        if ctx is None or host is None:
            return (STARTING if ctx is None else unsupported(ctx.spec.name)).response()
        try:
            principal = await principal_for(ctx, request.headers, [])
        except StoreUnavailable:
            return STORE_DOWN.response()
        if principal is None:
            return UNAUTHORIZED.response()
        known = self.call_sessions.get(request.path_params["call_id"])
        if known is None or known[0] != principal.tenant:
            return Denial(404, "call_not_found", "No such call (or its session has ended).").response()
        if not await ctx.ephemeral.may_access(principal, known[1]):  # an ek_ key: its own only
            return Denial(404, "call_not_found", "No such call (or its session has ended).").response()
        try:
            await host.delete(known[0], known[1], cause="hangup")
        except SessionNotFound:
            return Denial(404, "call_not_found", "No such call (or its session has ended).").response()
        return Response(status_code=200)
