"""Routes of world-model video sessions: ``/v1/realtime/video`` over a WebSocket and over WebRTC,
and the ``/world`` demo.

I/O only. Both transports run the same :class:`~session.world.core.VideoSessionCore` and
:class:`~session.world.driver.VideoSessionDriver`:

* WebSocket ``/v1/realtime/video``: JSON control in and out, each chunk as
  ``video.chunk_metadata`` + one binary frame (JPEG or fMP4).
* WebRTC ``POST /v1/realtime/video/calls`` (body: an SDP offer with one receive-only video
  section and a ``controls`` data channel; ``201`` with the SDP answer and ``Location``):
  the same JSON events on ``controls`` (``video.chunk_metadata`` with ``kind: "rtp"`` is the
  chunk status: index, frames, fps, queue depth) and the frames on the video track, which
  aiortc encodes (VP8/H.264). ``DELETE /v1/realtime/video/calls/{call_id}`` hangs up.

Both transports are hosted sessions like voice ones, on a
:class:`~session.world.hosting.WorldHost` (``service.host``, set by the app once the session
layer is up; until then a request is refused with 503): identity (API key or
``ek_`` key → tenant), an admission slot shared with voice sessions, a Redis record, a resume
token (on the 101 / the 201 as ``X-Omni-Resume-Token``; and, for a client that asked for
``omni.*`` events with ``?omni_extensions=1``, ``omni.session.resumable`` first: on the
WebSocket, and on ``controls`` once a call's channel opens), retention and resume. A dropped
WebSocket or a vanished call (ICE/DTLS failure, peer closed without a hangup) detaches a
generating world for the disconnect grace; it resumes over the WebSocket (``?session_id=…``
with ``X-Omni-Resume-Token`` or the ``omni-resume-token.<token>`` subprotocol) or with a new
call (``POST
/v1/realtime/video/calls?session_id=…`` with ``X-Omni-Resume-Token``), whichever transport it
began on. The hangup ends the world at once, peer up or not. Every refusal comes before the
upgrade or any peer connection, as JSON. See docs/sessions.md, "World sessions".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from media.video_rtc import FrameTrack, VideoPeer, check_video_offer
from media.webrtc import MAX_OFFER_BYTES, IceServer, OfferError
from session.identity import RESUME_HEADER, Principal, resume_token_from_request
from session.store.errors import SessionNotFound, StoreUnavailable
from session.world.config import VideoConfig
from session.world.core import VideoSessionCore
from session.world.driver import RuntimeProvider, VideoSessionDriver
from session.world.hosting import WorldHost, WorldSession
from session.world.outlets import encoded_outlet
from web.edge.bodies import BodyRefused, read_body
from web.edge.refusals import (
    CALL_NOT_FOUND,
    STARTING,
    STORE_DOWN,
    Denial,
    admitted,
    authorize_resume,
    create_admitted,
    identified,
)
from web.transports.frame_ws import WebSocketFrameTransport, serve_until_closed
from web.transports.omni_extensions import raw_headers, resume_headers, wants_extensions
from web.transports.video_call import CALL_PREFIX, PeerVideoTransport, TrackOutlet, VideoCall

__all__ = ["Denial", "PeerVideoTransport", "TrackOutlet", "VideoCall", "VideoService"]

log = logging.getLogger(__name__)

REALTIME_SUBPROTOCOL = "realtime"
DriverFactory = Callable[[VideoSessionCore], VideoSessionDriver]

STATIC_WORLD = Path(__file__).parents[1] / "static" / "world"


# ---------------------------------------------------------------------------------- service


# Who is calling (None: no valid key → 401). May raise StoreUnavailable.
Identify = Callable[[HTTPConnection], Awaitable[Principal | None]]

MAX_REMEMBERED_CALLS = 4096  # call ids a late hangup can still name


def offered_subprotocols(connection: HTTPConnection) -> list[str]:
    raw = connection.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


class VideoService:
    """Live world-model video sessions of this process (WebSocket and WebRTC), and their routes."""

    def __init__(
        self,
        runtimes: RuntimeProvider,
        config: VideoConfig | None = None,
        *,
        ice_servers: Sequence[IceServer] = (),
        connect_timeout_s: float = 15.0,
        identify: Identify | None = None,
    ) -> None:
        self.runtimes = runtimes
        self.identify = identify
        self.host: WorldHost | None = None  # the app sets it once the session layer is up
        self.config = config or VideoConfig()
        self.ice_servers = list(ice_servers)
        self.connect_timeout_s = connect_timeout_s
        self.calls: dict[str, VideoCall] = {}  # calls whose peer connection is up
        # call id → (tenant, session id) of hosted calls, for hangups that come after the peer
        # went (a detached world); the newest calls, bounded.
        self.call_sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._call_tasks: set[asyncio.Task[None]] = set()

    def live_sessions(self) -> int:
        """World sessions live in this process (detached ones included):
        ``omniduplex_active_sessions``, ``/readyz`` and the replica's load count them."""
        return len(self.host.sessions) if self.host is not None else 0

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/realtime/video", self.websocket, name="realtime_video"),
            Route(
                "/v1/realtime/video/calls", self.create_call, methods=["POST"], name="realtime_video_calls"
            ),
            Route(
                "/v1/realtime/video/calls/{call_id}",
                self.hangup,
                methods=["DELETE"],
                name="realtime_video_call",
            ),
            Route("/world", _world_redirect, name="world_demo"),
            Mount("/world", StaticFiles(directory=STATIC_WORLD, html=True), name="world_static"),
        ]

    async def _principal(self, connection: HTTPConnection) -> Principal | Denial:
        return await identified(self.identify, connection)

    async def _admit_hosted(self, host: WorldHost, connection: HTTPConnection) -> tuple[str, str] | Denial:
        """Identity, then a slot: (tenant, session id) or why not."""
        principal = await self._principal(connection)
        if isinstance(principal, Denial):
            return principal
        session_id = await admitted(host, principal.tenant)
        return session_id if isinstance(session_id, Denial) else (principal.tenant, session_id)

    async def _create_hosted(
        self, host: WorldHost, admitted: tuple[str, str], transport_kind: str, new_driver: DriverFactory
    ) -> tuple[WorldSession, str] | Denial:
        """The record of an admitted session whose driver ``new_driver`` builds; the slot goes
        back if it cannot be made."""
        tenant, session_id = admitted

        async def create(session_id: str) -> tuple[WorldSession, str]:
            driver = new_driver(VideoSessionCore(self.config, session_id=session_id))
            return await host.create(session_id, tenant, driver, transport_kind=transport_kind)

        return await create_admitted(host, session_id, create)

    # --- WebRTC calls -------------------------------------------------------------------------

    async def create_call(self, request: Request) -> Response:
        """Answer an SDP offer: a new world's call, or (``?session_id=…`` with the resume token
        in ``X-Omni-Resume-Token``) a call that resumes a world. Every refusal comes before a
        peer connection exists; the call then runs until its peer or its session ends."""
        host = self.host
        if host is None:
            return STARTING.response()
        if request.query_params.get("session_id") is not None:
            return await self._resume_call(host, request)
        admitted = await self._admit_hosted(host, request)
        if isinstance(admitted, Denial):
            return admitted.response()
        answered = await self._answer(request)
        if isinstance(answered, Denial):
            await host.forfeit(admitted[1])
            return answered.response()
        call, answer = answered

        def new_driver(core: VideoSessionCore) -> VideoSessionDriver:
            return VideoSessionDriver(core, call.transport, self.runtimes, outlets=call.outlets, retain=True)

        opened = await self._create_hosted(host, admitted, "webrtc", new_driver)
        if isinstance(opened, Denial):
            await call.peer.close("refused")
            return opened.response()
        hosted, token = opened
        await host.open(hosted, call.transport, None)  # attached; its token once `controls` opens
        headers = {"Location": f"/v1/realtime/video/calls/{call.call_id}"}
        headers.update(resume_headers(hosted.session_id, token))
        self._remember(call, hosted)
        if wants_extensions(request.query_params, request.headers):
            announce = functools.partial(host.announce, hosted, call.transport, token)
        else:
            announce = functools.partial(_attached, True)
        self._serve(call, self._serve_hosted(call, host, hosted, announce))
        return Response(answer, status_code=201, media_type="application/sdp", headers=headers)

    async def _resume_call(self, host: WorldHost, request: Request) -> Response:
        """A new call for a live world (detached, or still on another connection, which it
        replaces): refused before any peer connection (401, 400, 403, 404, 409, 503)."""
        principal = await self._principal(request)
        if isinstance(principal, Denial):
            return principal.response()
        try:
            offer = await _read_offer(request)
            check_video_offer(offer)
        except OfferError as exc:
            return Denial(400, "invalid_offer", str(exc)).response()
        hosted = await self._authorize_resume(host, request, principal)
        if isinstance(hosted, Denial):
            return hosted.response()
        answered = await self._answer(request, offer)
        if isinstance(answered, Denial):  # the world stays as it was (detached, in its grace)
            return answered.response()
        call, answer = answered
        self._remember(call, hosted)
        resume = functools.partial(
            host.resume, hosted, call.transport, kind=call.transport.kind, outlets=call.outlets
        )
        self._serve(call, self._serve_hosted(call, host, hosted, resume))
        headers = {
            "Location": f"/v1/realtime/video/calls/{call.call_id}",
            "X-Omni-Session-Id": hosted.session_id,
        }
        return Response(answer, status_code=201, media_type="application/sdp", headers=headers)

    async def _answer(self, request: Request, offer: str | None = None) -> tuple[VideoCall, str] | Denial:
        """A peer connection answering the request's offer, as a call (or why not: 400)."""
        track = FrameTrack()
        try:
            if offer is None:
                offer = await _read_offer(request)
            peer, answer = await VideoPeer.answer(offer, ice_servers=self.ice_servers, track=track)
        except OfferError as exc:
            return Denial(400, "invalid_offer", str(exc))
        return VideoCall(f"{CALL_PREFIX}{secrets.token_hex(10)}", peer, track), answer

    def _remember(self, call: VideoCall, hosted: WorldSession) -> None:
        """A hosted call, live, and its world for a hangup that comes after the peer went."""
        self.calls[call.call_id] = call
        self.call_sessions[call.call_id] = (hosted.tenant, hosted.session_id)
        while len(self.call_sessions) > MAX_REMEMBERED_CALLS:
            self.call_sessions.popitem(last=False)

    def _serve(self, call: VideoCall, serving: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(serving, name=f"video-call-{call.call_id}")
        self._call_tasks.add(task)
        task.add_done_callback(self._call_tasks.discard)

    async def _serve_hosted(
        self, call: VideoCall, host: WorldHost, hosted: WorldSession, attach: Callable[[], Awaitable[bool]]
    ) -> None:
        """Once connected, ``attach`` the call (announce a new world's token, or resume one),
        serve it, then tell the host how it ended: a drop detaches a generating world."""
        try:
            if await call.connected(self.connect_timeout_s) and await attach():
                await call.serve(hosted.driver)
        except Exception:
            log.exception("video call %s failed", call.call_id)
        finally:
            self.calls.pop(call.call_id, None)
            code = call.disconnect_code
            await call.peer.close("call ended")
            await asyncio.shield(host.connection_ended(hosted, call.transport, code))

    async def hangup(self, request: Request) -> Response:
        """``DELETE /v1/realtime/video/calls/{id}``: end the call's world for good, whether its
        peer is still up or not (a detached world, or one resumed on another connection)."""
        call_id = request.path_params["call_id"]
        host = self.host
        if host is None:
            return STARTING.response()
        principal = await self._principal(request)
        if isinstance(principal, Denial):
            return principal.response()
        known = self.call_sessions.get(call_id)
        if known is None or known[0] != principal.tenant:
            return CALL_NOT_FOUND.response()
        try:
            await host.delete(*known, cause="hangup")
        except SessionNotFound:
            self.call_sessions.pop(call_id, None)
            return CALL_NOT_FOUND.response()
        except StoreUnavailable:
            return STORE_DOWN.response()
        self.call_sessions.pop(call_id, None)
        call = self.calls.get(call_id)
        if call is not None:  # a call whose world moved on (resumed elsewhere) still ends
            await call.peer.close("hung up")
        return Response(status_code=200)  # a voice call's hangup answers the same

    # --- WebSockets ---------------------------------------------------------------------------

    async def websocket(self, websocket: WebSocket) -> None:
        host = self.host
        if host is None:
            await websocket.send_denial_response(STARTING.response())
        elif websocket.query_params.get("session_id") is not None:
            await self._resume(websocket, host)
        else:
            await self._websocket_hosted(websocket, host)

    async def _websocket_hosted(self, websocket: WebSocket, host: WorldHost) -> None:
        transport = WebSocketFrameTransport(websocket)

        def new_driver(core: VideoSessionCore) -> VideoSessionDriver:
            return VideoSessionDriver(core, transport, self.runtimes, retain=True)

        admitted = await self._admit_hosted(host, websocket)
        if isinstance(admitted, Denial):
            await websocket.send_denial_response(admitted.response())
            return
        opened = await self._create_hosted(host, admitted, "websocket", new_driver)
        if isinstance(opened, Denial):
            await websocket.send_denial_response(opened.response())
            return
        hosted, token = opened
        announce = wants_extensions(websocket.query_params, websocket.headers)
        try:
            await _accept(websocket, resume_headers(hosted.session_id, token))
            if await host.open(hosted, transport, token if announce else None):
                await self._serve_connection(websocket, hosted, transport)
        finally:
            await asyncio.shield(host.connection_ended(hosted, transport, transport.disconnect_code))

    async def _resume(self, websocket: WebSocket, host: WorldHost) -> None:
        principal = await self._principal(websocket)
        if isinstance(principal, Denial):
            await websocket.send_denial_response(principal.response())
            return
        hosted = await self._authorize_resume(host, websocket, principal)
        if isinstance(hosted, Denial):
            await websocket.send_denial_response(hosted.response())
            return
        transport = WebSocketFrameTransport(websocket)
        try:
            await _accept(websocket)
            if await host.resume(hosted, transport, kind=transport.kind, outlets=encoded_outlet):
                await self._serve_connection(websocket, hosted, transport)
        finally:
            await asyncio.shield(host.connection_ended(hosted, transport, transport.disconnect_code))

    async def _authorize_resume(
        self, host: WorldHost, connection: HTTPConnection, principal: Principal
    ) -> WorldSession | Denial:
        """The live world that ``?session_id=`` and the resume token name (a WebSocket or a call
        may resume a world begun on either), or why not."""
        session_id = connection.query_params.get("session_id", "")
        token = resume_token_from_request(
            connection.headers.get(RESUME_HEADER), offered_subprotocols(connection)
        )
        return await authorize_resume(
            session_id, token, lambda token: host.authorize(principal.tenant, session_id, token)
        )

    async def _serve_connection(
        self, websocket: WebSocket, hosted: WorldSession, transport: WebSocketFrameTransport
    ) -> None:
        """Client frames into the driver until the connection ends or the session does."""
        driver = hosted.driver
        await serve_until_closed(
            _receive_frames(websocket, driver, transport), driver.wait_closed(), f"video-{hosted.session_id}"
        )

    async def close(self) -> None:
        """Server shutdown: end every live call (the host ends the worlds)."""
        for call in list(self.calls.values()):
            await call.peer.close("server shutting down")
        tasks = list(self._call_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _accept(websocket: WebSocket, headers: dict[str, str] | None = None) -> None:
    """Accept, selecting ``realtime`` when offered: a browser that offers subprotocols (e.g.
    ``omni-resume-token.<token>``) fails the handshake unless the server selects one.
    ``headers``: a new world's resume data on the 101 (web/transports/omni_extensions.py)."""
    offered = offered_subprotocols(websocket)
    await websocket.accept(
        subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None,
        headers=raw_headers(headers) if headers else None,
    )


async def _attached(result: bool) -> bool:
    """A call's ``attach`` step for a client that did not ask for ``omni.*`` events."""
    return result


async def _receive_frames(
    websocket: WebSocket, driver: VideoSessionDriver, transport: WebSocketFrameTransport
) -> None:
    """Client frames into the driver until the client goes away; remembers how it
    left (its close code) for the host to detach or end the session."""
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                transport.disconnect_code = int(message.get("code") or 1005)
                return
            text = message.get("text")
            if text is not None:
                await driver.handle_text(text)
            elif message.get("bytes") is not None:
                await driver.handle_binary(message["bytes"])
    except (WebSocketDisconnect, RuntimeError, OSError):
        transport.disconnect_code = transport.disconnect_code or 1006


async def _read_offer(request: Request) -> str:
    """The SDP offer, read with a byte limit and a deadline (web/edge/bodies.py); `OfferError` if
    it is refused (400 invalid_offer: too large or too slow)."""
    try:
        body = await read_body(request, 2 * MAX_OFFER_BYTES)
    except BodyRefused as refused:
        raise OfferError(f"the offer was refused: {bytes(refused.response.body).decode()}") from None
    return body.decode("utf-8", errors="replace")


async def _world_redirect(request: Request) -> Response:
    return RedirectResponse(url=str(request.url.replace(path="/world/")))
