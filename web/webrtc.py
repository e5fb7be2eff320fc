"""The OpenAI Realtime protocol over WebRTC, and the browser demo's routes.

`POST /v1/realtime/calls` answers an SDP offer (`application/sdp`, or `multipart/form-data`
with parts `sdp` and `session`) with `201`, the SDP answer and `Location:
/v1/realtime/calls/<call_id>`; `POST /v1/realtime/calls/<call_id>/hangup` ends the call.
A call is the same session driver and core as the WebSocket endpoint (`build_driver`), with
a different transport: JSON events on the `oai-events` data channel, mic audio from the
inbound track (`feed_input_audio`), model audio out on a paced track (`PlayAudio` /
`ClearAudioOutput` effects, playout reported back to the core).

The demo: `GET /` (web/static/index.html), `POST /v1/demo/session` (an ephemeral key and the
ICE servers for the page; open mode, a valid API key, or the `OMNIDUPLEX_DEMO_KEY` secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
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
from session.driver import RealtimeDriver
from session.identity import Principal, api_key_from_request, authenticate, new_session_id
from session.realtime.config import SessionConfig, SessionIn
from session.realtime.effects import CoreOutput, PlayAudio
from session.realtime.ids import random_id
from session.store.errors import StoreUnavailable
from web.context import ServerContext
from web.realtime_ws import build_driver, error_body, initial_config
from web.settings import ServerSettings

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
DEMO_KEY_ENV = "OMNIDUPLEX_DEMO_KEY"
CALL_PREFIX = "rtc_"
# The page's default session: server VAD turns with the user's words transcribed.
DEMO_SESSION: dict[str, Any] = {
    "type": "realtime",
    "audio": {"input": {"transcription": {"model": "whisper-1"}}},
}


APPEND = "input_audio_buffer.append"


def append_rejection(text: str) -> dict[str, Any] | None:
    """The `error` event for an `input_audio_buffer.append` sent on the events channel (mic
    audio belongs on the track), or None when `text` is another event."""
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") != APPEND:
        return None
    client_id = event.get("event_id")
    return {
        "type": "error",
        "event_id": random_id("event"),
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_event",
            "message": "input_audio_buffer.append is not supported on WebRTC calls: "
            "send microphone audio on the audio track.",
            "param": "type",
            "event_id": client_id if isinstance(client_id, str) else None,
        },
    }


def too_large(event: dict[str, Any], size: int, limit: int) -> dict[str, Any]:
    """What the peer gets instead of an event its data channel cannot carry."""
    return {
        "type": "error",
        "event_id": random_id("event"),
        "error": {
            "type": "server_error",
            "code": "event_too_large",
            "message": f"A {event.get('type')} event of {size} bytes exceeds this data channel's "
            f"{limit}-byte message limit and was not sent.",
            "param": None,
            "event_id": None,
        },
    }


class TrackAudioSink:
    """The driver's `AudioSink`: `PlayAudio` / `ClearAudioOutput` effects onto the track."""

    def __init__(self, track: OutboundAudioTrack) -> None:
        self.track = track

    def play(self, effect: PlayAudio) -> None:
        self.track.play(effect.response_id, effect.samples, effect.sample_rate)

    def clear(self, response_id: str) -> None:
        self.track.clear(response_id)


class RealtimeCall:
    """One WebRTC call: a `PeerLink` bound to a `RealtimeDriver`, served by `run()`."""

    def __init__(self, call_id: str, tenant: str, link: PeerLink, *, connect_timeout_s: float) -> None:
        self.call_id = call_id
        self.tenant = tenant
        self.link = link
        self.connect_timeout_s = connect_timeout_s
        self.sink = TrackAudioSink(link.outbound)
        self._inbox: asyncio.Queue[str] = asyncio.Queue(256)
        self.driver: RealtimeDriver | None = None

    def bind(self, driver: RealtimeDriver) -> None:
        self.driver = driver
        self.link.outbound.observer = driver
        self.link.on_audio = driver.feed_input_audio
        self.link.on_message = self._on_message

    # --- transport callbacks for the driver ------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        if event.get("type") == "response.done":
            # All of the response's audio has been queued on the track by now.
            self.link.outbound.finish(str(event.get("response", {}).get("id", "")))
        text = json.dumps(event, separators=(",", ":"))
        if len(text.encode()) > self.link.max_message_size:
            text = json.dumps(too_large(event, len(text.encode()), self.link.max_message_size))
        await self.link.send_text(text)

    async def close_transport(self, code: int, reason: str) -> None:
        await self.link.close(f"session closed ({code}): {reason}")

    def _on_message(self, text: str) -> None:
        if APPEND in text and self.driver is not None:
            rejection = append_rejection(text)
            if rejection is not None:
                self.driver.apply(CoreOutput(events=[rejection]))
                return
        try:
            self._inbox.put_nowait(text)
        except asyncio.QueueFull:
            if self.driver is not None:
                self.driver.request_close(1008, "client sends events faster than they are handled")

    async def _incoming(self) -> str | None:
        if not self._inbox.empty():
            return self._inbox.get_nowait()
        message = asyncio.ensure_future(self._inbox.get())
        ended = asyncio.ensure_future(self.link.ended.wait())
        try:
            await asyncio.wait({message, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not message.done():
                message.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ended
        if message.done() and not message.cancelled():
            return message.result()
        return None

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        assert self.driver is not None
        watchdog = asyncio.create_task(self._watch_connect(), name=f"{self.call_id}:connect")
        try:
            await self.driver.run(self._incoming)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            await self.link.close("session ended")
            log.info(
                "call %s ended (%s); outbound track %s",
                self.call_id,
                self.link.end_reason,
                json.dumps(self.link.outbound.stats()),
            )

    async def _watch_connect(self) -> None:
        """ICE that never connects (or no events channel): release the call and its slot."""
        if not await self.link.wait_ready(self.connect_timeout_s):
            if not self.link.ended.is_set():
                log.info("call %s: not connected in %.0f s", self.call_id, self.connect_timeout_s)
            await self.link.close(self.link.end_reason or "ICE did not connect")

    def hangup(self) -> None:
        if self.driver is not None:
            self.driver.request_close(1000, "hangup")


class WebRtcService:
    """Live WebRTC calls of this process, and the routes for calls and the demo."""

    def __init__(self, settings: ServerSettings, *, connect_timeout_s: float = 30.0) -> None:
        self.ice_servers: list[IceServer] = parse_ice_servers(settings.stun, settings.turn)
        self.connect_timeout_s = connect_timeout_s
        self.calls: dict[str, RealtimeCall] = {}
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
        """Server shutdown: end every call and wait for it."""
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
        ctx: ServerContext = request.app.state.ctx
        principal = await _principal(ctx, request)
        if principal is None:
            ctx.metrics.admission("invalid_api_key")
            return _unauthorized()
        offer = await _read_offer(request)
        if isinstance(offer, Response):
            return offer
        sdp, session_part = offer
        try:
            config = initial_config(ctx, request.query_params.get("model"), principal)
            if session_part is not None:
                config = config.apply_update(SessionIn.model_validate(session_part))
        except Exception as exc:
            ctx.metrics.admission("invalid_session_config")
            return error_body(400, "invalid_session_config", str(exc))
        try:
            check_offer(sdp)  # before taking a slot
        except OfferError as exc:
            ctx.metrics.admission("invalid_offer")
            return error_body(400, "invalid_offer", str(exc))
        session_id = new_session_id()
        refused = await _admit(ctx, session_id, principal.tenant)
        if refused is not None:
            return refused
        try:
            link, answer = await PeerLink.answer(
                sdp, ice_servers=self.ice_servers, outbound=OutboundAudioTrack()
            )
        except BaseException as exc:
            await _release(ctx, session_id)
            if isinstance(exc, OfferError):
                ctx.metrics.admission("invalid_offer")
                return error_body(400, "invalid_offer", str(exc))
            raise
        call_id = CALL_PREFIX + secrets.token_hex(12)
        call = RealtimeCall(call_id, principal.tenant, link, connect_timeout_s=self.connect_timeout_s)
        try:
            self._start(ctx, call, config, session_id)
        except BaseException:
            await link.close("session setup failed")
            await _release(ctx, session_id)
            raise
        ctx.metrics.admission("admitted")
        return Response(
            answer,
            status_code=201,
            media_type="application/sdp",
            headers={"Location": f"/v1/realtime/calls/{call_id}"},
        )

    def _start(self, ctx: ServerContext, call: RealtimeCall, config: SessionConfig, session_id: str) -> None:
        driver = build_driver(
            ctx,
            config,
            send=call.send,
            close=call.close_transport,
            session_id=session_id,
            audio_out_via_track=True,
            audio_sink=call.sink,
        )
        call.bind(driver)
        ctx.sessions[session_id] = driver
        self.calls[call.call_id] = call

        async def serve() -> None:
            try:
                await call.run()
            finally:
                ctx.sessions.pop(session_id, None)
                self.calls.pop(call.call_id, None)
                await _release(ctx, session_id)

        task = asyncio.create_task(serve(), name=f"{call.call_id}:{session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def hangup(self, request: Request) -> Response:
        ctx: ServerContext = request.app.state.ctx
        principal = await _principal(ctx, request)
        if principal is None:
            return _unauthorized()
        call = self.calls.get(request.path_params["call_id"])
        if call is None or (call.tenant != principal.tenant and not ctx.open_mode):
            return error_body(404, "call_not_found", "No such call.")
        call.hangup()
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


async def _admit(ctx: ServerContext, session_id: str, tenant: str) -> Response | None:
    """Take a session slot from the shared admission (the WebSocket's), or say why not.
    A call is one HTTP request, so it cannot wait in the admission queue: full is 429."""
    host = ctx.host
    if host is None:  # no session host (tests of bare contexts): count this process's sessions
        if len(ctx.sessions) < ctx.settings.max_sessions:
            return None
        return error_body(429, "server_at_capacity", "No session slot is free.", retry_after_s=1)
    try:
        decision = await host.admission.try_admit(session_id, tenant, may_queue=False)
    except StoreUnavailable:
        ctx.metrics.admission("store_unavailable")
        return error_body(
            503,
            "store_unavailable",
            "The session store (Redis) is unavailable; retry shortly.",
            retry_after_s=1,
        )
    if isinstance(decision, Rejected):
        ctx.metrics.admission(decision.code)
        return error_body(
            429,
            decision.code,
            f"No session slot is free ({decision.reason}).",
            retry_after_s=decision.retry_after_s,
        )
    return None


async def _release(ctx: ServerContext, session_id: str) -> None:
    if ctx.host is not None:
        await ctx.host.forfeit(session_id)  # retried by the host's sweeper while Redis is down


def _unauthorized() -> Response:
    return error_body(401, "invalid_api_key", "Missing or invalid API key (Authorization: Bearer <key>).")


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
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > 2 * MAX_OFFER_BYTES:
        return error_body(413, "request_too_large", f"The offer must be under {MAX_OFFER_BYTES} bytes.")
    if content_type in ("application/sdp", "text/plain", ""):
        body = await request.body()
        return _decode(body), None
    if content_type != "multipart/form-data":
        return error_body(
            415,
            "unsupported_content_type",
            f"Send the offer as application/sdp or multipart/form-data, not {content_type!r}.",
        )
    try:
        form = await request.form(max_files=2, max_fields=4, max_part_size=2 * MAX_OFFER_BYTES)
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
        session = json.loads(session_text)
    except ValueError:
        return error_body(400, "invalid_json", "The 'session' part is not valid JSON.")
    if not isinstance(session, dict):
        return error_body(400, "invalid_value", "The 'session' part must be a JSON object.")
    return sdp_text, session


def _decode(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")
