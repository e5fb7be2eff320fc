"""``GET /v1/live/sessions``: OpenAI's GPT-Live protocol over WebSocket, for duplex pipelines.

Only bytes ⇄ events here; sessions live in the :class:`~session.live.hosting.LiveHost`
(``app.state.live``, built when the server's pipeline takes its own turns). Everything that can
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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from session.identity import RESUME_HEADER, Principal, is_session_id, resume_token_from_request
from session.live.core import LiveCoreOptions, LiveSessionCore
from session.live.driver import LiveDriver, LiveEntryPoint
from session.live.events import LiveLimits
from session.live.hosting import AdmissionRefused, LiveHost, LiveSession, SessionElsewhere
from session.store.errors import ResumeTokenInvalid, SessionNotFound, StoreUnavailable
from web.context import ServerContext
from web.omni_extensions import raw_headers, resume_headers, wants_extensions
from web.realtime_ws import WebSocketTransport, offered_subprotocols, principal_for
from web.video import BAD_TOKEN, ELSEWHERE, NOT_FOUND, STARTING, STORE_DOWN, UNAUTHORIZED, Denial

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

    def __init__(self, limits: LiveLimits | None = None) -> None:
        self.limits = limits or LiveLimits()
        self.host: LiveHost | None = None
        self.ctx: ServerContext | None = None

    # --- the session layer -------------------------------------------------------------------

    def build_host(self, ctx: ServerContext) -> LiveHost | None:
        """The live host on the process's shared session parts; None when the pipeline does
        not take its own turns (its sessions are then refused)."""
        self.ctx = ctx
        caps = ctx.capabilities
        if caps.live_entry is None or not caps.live_responses:
            return None
        live = LiveEntryPoint(caps.live_entry, caps.input_rate)

        def new_driver(session_id: str, expires_at: int, resume: dict[str, Any] | None) -> LiveDriver:
            options = LiveCoreOptions(
                session_id=session_id,
                pipeline=ctx.spec.name,
                expires_at=expires_at,
                limits=self.limits,
                resume=resume,
            )
            return LiveDriver(
                LiveSessionCore(options),
                ctx.orchestrator,
                live,
                outbox_max_bytes=ctx.settings.outbox_max_bytes,
                observer=ctx.metrics,
            )

        self.host = LiveHost(ctx.host, new_driver, pipeline=ctx.spec.name)
        return self.host

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute(LIVE_PATH, self.endpoint, name="live_sessions")]

    # --- one connection ----------------------------------------------------------------------

    async def endpoint(self, websocket: WebSocket) -> None:
        ctx = self.ctx
        if ctx is None:
            await websocket.send_denial_response(STARTING.response())
            return
        host = self.host
        if host is None:
            ctx.metrics.admission("live_sessions_unsupported")
            await websocket.send_denial_response(unsupported(ctx.spec.name).response())
            return
        subprotocols = offered_subprotocols(websocket)
        try:
            principal = await principal_for(ctx, websocket.headers, subprotocols)
        except StoreUnavailable:
            await websocket.send_denial_response(STORE_DOWN.response())
            return
        if principal is None:
            ctx.metrics.admission("invalid_api_key")
            await websocket.send_denial_response(UNAUTHORIZED.response())
            return
        announce = wants_extensions(websocket.query_params, websocket.headers)
        opened: tuple[LiveSession, str | None] | Denial
        if websocket.query_params.get("session_id") is not None:
            opened = await self._resume(host, websocket, principal, subprotocols)
        else:
            opened = await self._open(host, principal, announce)
        if isinstance(opened, Denial):
            ctx.metrics.admission(opened.code)
            await websocket.send_denial_response(opened.response())
            return
        s, token = opened
        if principal.ephemeral_key is not None:  # an ek_ key may later GET/DELETE what it opened
            try:
                await ctx.ephemeral.bind_session(principal, s.session_id)
            except Exception:
                log.debug("live session %s: ephemeral binding not stored", s.session_id)
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
        self, host: LiveHost, principal: Principal, announce: bool
    ) -> tuple[LiveSession, str] | Denial:
        try:
            session_id = await host.admit(principal.tenant)
        except AdmissionRefused as refused:
            d = refused.decision
            return Denial(429, d.code, f"No session slot is free ({d.reason}).", d.retry_after_s)
        except StoreUnavailable:
            return STORE_DOWN
        try:
            s, token = await host.create(
                session_id, principal.tenant, transport_kind="websocket", announce=announce
            )
        except (StoreUnavailable, SessionElsewhere):
            await host.forfeit(session_id)
            return STORE_DOWN
        except BaseException:
            await host.forfeit(session_id)
            raise
        assert self.ctx is not None
        self.ctx.metrics.admission("admitted")
        return s, token

    async def _resume(
        self, host: LiveHost, websocket: WebSocket, principal: Principal, subprotocols: list[str]
    ) -> tuple[LiveSession, None] | Denial:
        session_id = websocket.query_params.get("session_id", "")
        token = resume_token_from_request(websocket.headers.get(RESUME_HEADER), subprotocols)
        try:
            if not token:
                raise ResumeTokenInvalid(session_id)
            if not is_session_id(session_id):
                raise SessionNotFound(session_id)
            return await host.authorize(principal.tenant, session_id, token), None
        except SessionNotFound:
            return NOT_FOUND
        except ResumeTokenInvalid:
            return BAD_TOKEN
        except SessionElsewhere:
            return ELSEWHERE
        except StoreUnavailable:
            return STORE_DOWN
