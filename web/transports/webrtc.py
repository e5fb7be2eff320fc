"""The OpenAI Realtime protocol over WebRTC, and the browser demo's routes.

`POST /v1/realtime/calls` answers an SDP offer (`application/sdp`, or `multipart/form-data`
with parts `sdp` and `session`) with `201`, the SDP answer and `Location:
/v1/realtime/calls/<call_id>`; `POST /v1/realtime/calls/<call_id>/hangup` ends the call and
its session. A call is a hosted session like a WebSocket one (`ctx.host`: Redis record,
resume token, admission slot, disconnect grace, retention, `GET`/`DELETE /v1/sessions/{id}`)
on another transport (web/transports/webrtc_call.py): JSON events on the `oai-events` data channel, mic
audio from the inbound track, model audio out on a paced track.

The 201 of a new call carries `X-Omni-Session-Id` and `X-Omni-Resume-Token`; the data channel
carries `omni.session.resumable` too when the offer asked for `omni.*` events
(`?omni_extensions=1`, web/transports/omni_extensions.py).

Resume: `POST /v1/realtime/calls?session_id=…&last_event_id=…` with the token in
`X-Omni-Resume-Token` answers `201` and replays what was missed on the new data channel; a
session that began on a call can equally be resumed over the WebSocket, and the other way
round. Refusals come before any peer connection: 401, 400 (offer, config), 403
`invalid_resume_token`, 404 `session_not_found`, 409 `session_elsewhere`, 429 (no slot: a
call cannot wait in the admission queue), 503 (Redis down).

The demo: `GET /` (web/static/index.html), `POST /v1/demo/session` (an ephemeral key and the
ICE servers for the page; open mode, a valid API key, or the `OMNIDUPLEX_DEMO_KEY` secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from media.tracks import OutboundAudioTrack
from media.webrtc import MAX_OFFER_BYTES, IceServer, OfferError, PeerLink, check_offer, parse_ice_servers
from session.admission import Rejected
from session.identity import (
    RESUME_HEADER,
    Principal,
    api_key_from_request,
    authenticate,
    is_session_id,
    new_session_id,
    resume_token_from_request,
)
from session.json_guard import JsonRejected, loads_checked
from session.link import LinkEnd
from session.realtime.config import SessionConfig, SessionIn
from session.store.aio import cancel_and_wait
from session.store.errors import ResumeTokenInvalid, SessionNotFound, StoreUnavailable
from session.voice.driver import RealtimeDriver
from session.voice.hosting import AdmissionRefused, SessionElsewhere, SessionHost
from web.edge.bodies import BodyRefused, read_body, replayed
from web.edge.refusals import CALL_NOT_FOUND, STORE_DOWN, UNAUTHORIZED, capacity, error_body
from web.server.context import ServerContext
from web.settings import ServerSettings
from web.transports.omni_extensions import resume_headers, wants_extensions
from web.transports.realtime_ws import initial_config
from web.transports.webrtc_call import RealtimeCall, append_rejection, too_large

__all__ = ["DEMO_KEY_ENV", "RealtimeCall", "WebRtcService", "append_rejection", "too_large"]

log = logging.getLogger(__name__)

STATIC = Path(__file__).parents[1] / "static"
DEMO_KEY_ENV = "OMNIDUPLEX_DEMO_KEY"
CALL_PREFIX = "rtc_"
MAX_REMEMBERED_CALLS = 4096  # call ids a late hangup can still name
# The page's default session: server VAD turns with the user's words transcribed.
DEMO_SESSION: dict[str, Any] = {
    "type": "realtime",
    "audio": {"input": {"transcription": {"model": "whisper-1"}}},
}


class WebRtcService:
    """Live WebRTC calls of this process, and the routes for calls and the demo."""

    def __init__(self, settings: ServerSettings, *, connect_timeout_s: float = 30.0) -> None:
        self.ice_servers: list[IceServer] = parse_ice_servers(settings.stun, settings.turn)
        self.connect_timeout_s = connect_timeout_s
        self.calls: dict[str, RealtimeCall] = {}  # calls whose peer connection is up
        # call id → (tenant, session id), for hangups that come after the peer went (the demo
        # closes its peer connection first); the newest calls, bounded.
        self.call_sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/realtime/calls", self.create_call, methods=["POST"]),
            Route("/v1/realtime/calls/{call_id}/hangup", self.hangup, methods=["POST"]),
            Route("/v1/demo/session", self.demo_session, methods=["POST"]),
            Route("/", demo_page),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]

    async def close(self) -> None:
        """Server shutdown: end every call (their sessions detach, then the host parks them)."""
        for call in list(self.calls.values()):
            await call.link.close("server shutting down")
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- calls --------------------------------------------------------------------------------

    async def create_call(self, request: Request) -> Response:
        """A new session's call, or (`?session_id=…&last_event_id=…` with the resume token in
        `X-Omni-Resume-Token`) a call that resumes a session. Everything that can be refused
        is refused before a peer connection exists."""
        ctx: ServerContext = request.app.state.ctx
        principal = await _principal(ctx, request)
        if principal is None:
            ctx.metrics.admission("invalid_api_key")
            return _unauthorized()
        host: SessionHost = ctx.host
        offer = await _read_offer(request)
        if isinstance(offer, Response):
            return offer
        sdp, session_part = offer
        resume_id = request.query_params.get("session_id")
        config: SessionConfig | None = None
        if resume_id is None:
            try:
                config = initial_config(ctx, request.query_params.get("model"), principal)
                if session_part is not None:
                    config = config.apply_update(SessionIn.model_validate(session_part))
            except Exception as exc:
                ctx.metrics.admission("invalid_session_config")
                return error_body(400, "invalid_session_config", str(exc))
        elif session_part is not None:
            return error_body(
                400, "invalid_session_config", "A resumed session keeps its config: send no 'session' part."
            )
        try:
            check_offer(sdp)  # before taking a slot
        except OfferError as exc:
            ctx.metrics.admission("invalid_offer")
            return error_body(400, "invalid_offer", str(exc))
        if resume_id is not None:
            return await self._resume_call(ctx, host, request, principal, resume_id, sdp)
        assert config is not None
        announce = wants_extensions(request.query_params, request.headers)
        return await self._new_call(ctx, host, principal, config, sdp, announce=announce)

    async def _new_call(
        self,
        ctx: ServerContext,
        host: SessionHost,
        principal: Principal,
        config: SessionConfig,
        sdp: str,
        *,
        announce: bool,
    ) -> Response:
        """`announce`: the client asked for `omni.*` events (`omni.session.resumable` on the
        data channel); every client gets the resume data as headers on the 201."""
        session_id = new_session_id()
        refused = await _admit(ctx, host, session_id, principal.tenant)
        if refused is not None:
            return refused
        try:
            link, answer = await self._answer(sdp)
        except BaseException as exc:
            await host.forfeit(session_id)  # retried by the host's sweeper while Redis is down
            if isinstance(exc, OfferError):
                ctx.metrics.admission("invalid_offer")
                return error_body(400, "invalid_offer", str(exc))
            raise
        try:
            hs, token = await host.create(session_id, principal.tenant, config)
        except BaseException as exc:
            await link.close("session setup failed")
            await host.forfeit(session_id)
            if isinstance(exc, StoreUnavailable):
                ctx.metrics.admission("store_unavailable")
                return _store_down()
            if isinstance(exc, SessionElsewhere):
                ctx.metrics.admission("session_elsewhere")
                return _elsewhere()
            raise
        if principal.ephemeral_key is not None:  # it may GET/DELETE what it opened (only)
            with contextlib.suppress(Exception):
                await ctx.ephemeral.bind_session(principal, session_id)
        call = self._call(principal.tenant, session_id, link, new_session=True)
        self._serve(call, host.serve_new(hs, call, token, announce=announce), hs.driver)
        ctx.metrics.admission("admitted")
        return _answered(call, answer, resume_headers(session_id, token))

    async def _resume_call(
        self,
        ctx: ServerContext,
        host: SessionHost,
        request: Request,
        principal: Principal,
        session_id: str,
        sdp: str,
    ) -> Response:
        token = resume_token_from_request(request.headers.get(RESUME_HEADER))
        try:
            if not token:
                raise ResumeTokenInvalid(session_id)
            if not is_session_id(session_id):
                raise SessionNotFound(session_id)
            await host.authorize(principal.tenant, session_id, token)
            hs = await host.restore(principal.tenant, session_id, token)
        except SessionNotFound:
            ctx.metrics.resume("session_not_found")
            return error_body(404, "session_not_found", "No such session (it may have expired).")
        except ResumeTokenInvalid:
            ctx.metrics.resume("invalid_resume_token")
            return error_body(403, "invalid_resume_token", "The resume token is missing or not valid.")
        except AdmissionRefused as refused:
            ctx.metrics.resume(refused.decision.code)
            return _capacity(refused.decision)
        except SessionElsewhere:
            ctx.metrics.resume("session_elsewhere")
            return _elsewhere()
        except StoreUnavailable:
            ctx.metrics.resume("store_unavailable")
            return _store_down()
        try:
            link, answer = await self._answer(sdp)
        except OfferError as exc:  # the session stays as it was (detached, in its grace)
            ctx.metrics.resume("invalid_offer")
            return error_body(400, "invalid_offer", str(exc))
        if principal.ephemeral_key is not None:  # it holds the token: the resumed session is its own
            with contextlib.suppress(Exception):
                await ctx.ephemeral.bind_session(principal, session_id)
        call = self._call(principal.tenant, session_id, link, new_session=False)
        last_event_id = request.query_params.get("last_event_id")
        self._serve(call, host.serve_resume(hs, call, last_event_id), hs.driver)
        ctx.metrics.resume("resumed")
        return _answered(call, answer)

    async def _answer(self, sdp: str) -> tuple[PeerLink, str]:
        return await PeerLink.answer(sdp, ice_servers=self.ice_servers, outbound=OutboundAudioTrack())

    def _call(self, tenant: str, session_id: str, link: PeerLink, *, new_session: bool) -> RealtimeCall:
        call_id = CALL_PREFIX + secrets.token_hex(12)
        call = RealtimeCall(
            call_id,
            tenant,
            session_id,
            link,
            connect_timeout_s=self.connect_timeout_s,
            new_session=new_session,
        )
        self.calls[call_id] = call
        self.call_sessions[call_id] = (tenant, session_id)
        while len(self.call_sessions) > MAX_REMEMBERED_CALLS:
            self.call_sessions.popitem(last=False)
        return call

    def _serve(
        self, call: RealtimeCall, serving: Coroutine[Any, Any, LinkEnd], driver: RealtimeDriver
    ) -> None:
        """Serve the session on the call (the host attaches it, and watches how it ends)."""
        call.bind(driver)

        async def serve() -> None:
            watchdog = asyncio.create_task(call.watch_connect(), name=f"{call.call_id}:connect")
            try:
                await serving
            except Exception:
                log.exception("call %s: serving session %s failed", call.call_id, call.session_id)
            finally:
                await cancel_and_wait(watchdog)
                self.calls.pop(call.call_id, None)
                await call.finish()

        task = asyncio.create_task(serve(), name=f"{call.call_id}:{call.session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def hangup(self, request: Request) -> Response:
        """End the call's session for good (deleted), whether its peer is still up or not."""
        ctx: ServerContext = request.app.state.ctx
        principal = await _principal(ctx, request)
        if principal is None:
            return _unauthorized()
        call_id = request.path_params["call_id"]
        known = self.call_sessions.get(call_id)
        if known is not None and not await ctx.ephemeral.may_access(principal, known[1]):
            known = None  # an ek_ key hangs up only calls of the sessions it opened
        if known is None or (known[0] != principal.tenant and not ctx.open_mode):
            return CALL_NOT_FOUND.response()
        tenant, session_id = known
        try:
            await ctx.host.delete(tenant, session_id, cause="hangup")
        except SessionNotFound:
            self.call_sessions.pop(call_id, None)
            return CALL_NOT_FOUND.response()
        except StoreUnavailable:
            return _store_down()
        self.call_sessions.pop(call_id, None)
        call = self.calls.get(call_id)
        if call is not None:  # a call whose session moved on (resumed elsewhere) still ends
            await call.link.close("hangup")
        return Response(status_code=200)

    # --- the demo -----------------------------------------------------------------------------

    async def demo_session(self, request: Request) -> Response:
        """An ephemeral key for the demo page, and the ICE servers it should use."""
        ctx: ServerContext = request.app.state.ctx
        tenant = await _demo_tenant(ctx, request)
        if tenant is None:
            return error_body(
                401,
                "invalid_api_key",
                f"The demo needs an open (keyless) server, an API key, or the {DEMO_KEY_ENV} secret.",
            )
        secret = await ctx.ephemeral.create(tenant, DEMO_SESSION, ttl_s=ctx.settings.ephemeral_ttl_s)
        return JSONResponse(
            {
                "value": secret.value,
                "expires_at": int(secret.expires_at),
                "model": ctx.spec.name,
                "ice_servers": [s.to_browser() for s in self.ice_servers],
            }
        )


async def _admit(ctx: ServerContext, host: SessionHost, session_id: str, tenant: str) -> Response | None:
    """Take a session slot from the shared admission (the WebSocket's), or say why not.
    A call is one HTTP request, so it cannot wait in the admission queue: full is 429."""
    try:
        decision = await host.admission.try_admit(session_id, tenant, may_queue=False)
    except StoreUnavailable:
        ctx.metrics.admission("store_unavailable")
        return _store_down()
    if isinstance(decision, Rejected):
        ctx.metrics.admission(decision.code)
        return _capacity(decision)
    return None


def _capacity(decision: Rejected) -> Response:
    return capacity(decision).response()


def _store_down() -> Response:
    return STORE_DOWN.response()


def _elsewhere() -> Response:
    return error_body(409, "session_elsewhere", "The session is served by another replica.", retry_after_s=1)


def _answered(call: RealtimeCall, answer: str, extra: dict[str, str] | None = None) -> Response:
    return Response(
        answer,
        status_code=201,
        media_type="application/sdp",
        headers={"Location": f"/v1/realtime/calls/{call.call_id}", **(extra or {})},
    )


def _unauthorized() -> Response:
    return UNAUTHORIZED.response()


async def demo_page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def _principal(ctx: ServerContext, request: Request) -> Principal | None:
    """An API key or ephemeral key (its scope applies even in open mode); open mode admits all."""
    key = api_key_from_request(request.headers.get("authorization"))
    principal = await authenticate(key, ctx.api_keys, ctx.ephemeral) if key else None
    if principal is None and ctx.open_mode:
        return Principal("default")
    return principal


async def _demo_tenant(ctx: ServerContext, request: Request) -> str | None:
    key = api_key_from_request(request.headers.get("authorization"))
    demo_key = os.environ.get(DEMO_KEY_ENV, "")
    if key and demo_key and hmac.compare_digest(key.encode(), demo_key.encode()):
        return "demo"
    tenant = ctx.api_keys.tenant_for(key)
    if tenant is not None:
        return tenant
    if ctx.open_mode:
        return "default"
    return None


async def _read_offer(request: Request) -> tuple[str, dict[str, Any] | None] | Response:
    """The SDP offer and optional session config of a call request, or an error response."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:  # at most 2 × MAX_OFFER_BYTES read, whatever the framing (web/edge/bodies.py)
        body = await read_body(request, 2 * MAX_OFFER_BYTES)
    except BodyRefused as refused:
        return refused.response
    if content_type in ("application/sdp", "text/plain", ""):
        return _decode(body), None
    if content_type != "multipart/form-data":
        return error_body(
            415,
            "unsupported_content_type",
            f"Send the offer as application/sdp or multipart/form-data, not {content_type!r}.",
        )
    try:
        form = await replayed(request, body).form(
            max_files=2, max_fields=4, max_part_size=2 * MAX_OFFER_BYTES
        )
    except Exception as exc:
        return error_body(400, "invalid_multipart", f"Cannot read the multipart body: {exc}")
    try:
        sdp = form.get("sdp")
        if sdp is None:
            return error_body(400, "missing_required_parameter", "The multipart body has no 'sdp' part.")
        sdp_text = _decode(await sdp.read()) if isinstance(sdp, UploadFile) else str(sdp)
        raw_session = form.get("session")
        if raw_session is None:
            return sdp_text, None
        session_text = (
            _decode(await raw_session.read()) if isinstance(raw_session, UploadFile) else str(raw_session)
        )
    finally:
        await form.close()
    try:
        session = loads_checked(session_text)
    except JsonRejected as exc:
        return error_body(400, exc.code, f"The 'session' part: {exc.message}")
    if not isinstance(session, dict):
        return error_body(400, "invalid_value", "The 'session' part must be a JSON object.")
    return sdp_text, session


def _decode(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")
