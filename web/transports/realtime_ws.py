"""`GET /v1/realtime`: the OpenAI Realtime (GA) protocol over WebSocket, with resume.

Only bytes ⇄ events here; sessions live in `ctx.host` (:mod:`session.voice.hosting`). Everything
that can be refused is refused before the upgrade, as an HTTP answer with a JSON body:

* 401 `invalid_api_key`; 400 `invalid_session_config`;
* open: 429 `server_at_capacity` with `Retry-After` when admission rejects at once (queue
  full, draining); 503 `store_unavailable` when Redis is down. A client that must wait is
  upgraded (and, if it asked for `omni.*` events, gets `omni.admission.queued {position,
  estimated_wait_ms}` updates), then either `session.created` or `error server_at_capacity`
  and close 1013. The 101 carries the resume data as headers (web/transports/omni_extensions.py);
  `omni.session.resumable` follows `session.created` only for a client that asked;
* resume (`?session_id=…&last_event_id=…`, token in `X-Omni-Resume-Token` or the
  `omni-resume-token.<token>` subprotocol): 403 `invalid_resume_token` for a missing or wrong
  token; 404 `session_not_found` for an unknown, expired or another tenant's session; 429 when
  the session must be restored here and no slot is free; 503 when Redis is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from session.admission import Admitted, Queued, Rejected
from session.identity import (
    RESUME_HEADER,
    Principal,
    api_key_from_request,
    authenticate,
    is_session_id,
    new_resume_token,
    new_session_id,
    resume_token_from_request,
)
from session.link import ConnectionInfo
from session.realtime.config import SessionConfig, SessionIn
from session.resume import connection_event
from session.store.errors import ResumeTokenInvalid, SessionNotFound, StoreUnavailable
from session.store.event_ids import event_text
from session.voice.hosting import AdmissionRefused, SessionElsewhere, SessionHost
from web.edge.refusals import (
    BAD_TOKEN,
    STORE_DOWN,
    UNAUTHORIZED,
    capacity,
    error_body,
    resume_denial,
)
from web.edge.uvicorn_guards import SEND_NOWAIT, SET_RECEIVER
from web.server.context import ServerContext
from web.transports.omni_extensions import raw_headers, resume_headers, wants_extensions

__all__ = ["initial_config", "realtime_endpoint"]

log = logging.getLogger(__name__)

REALTIME_SUBPROTOCOL = "realtime"
CAPACITY_CLOSE = 1013  # "try again later"


def offered_subprotocols(websocket: WebSocket) -> list[str]:
    raw = websocket.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


async def principal_for(ctx: ServerContext, headers: Any, subprotocols: list[str]) -> Principal | None:
    if ctx.open_mode:
        return Principal("default")
    key = api_key_from_request(headers.get("authorization"), subprotocols)
    return await authenticate(key, ctx.api_keys, ctx.ephemeral)


def initial_config(ctx: ServerContext, model: str | None, principal: Principal) -> SessionConfig:
    config = SessionConfig(model=model or ctx.spec.name)
    if principal.scoped_config:
        scoped = {k: v for k, v in principal.scoped_config.items() if k not in ("id", "object", "expires_at")}
        config = config.apply_update(SessionIn.model_validate(scoped))
    return config


# Client frames kept while a session waits in the admission queue (~10 s of 24 kHz PCM16
# appends in base64); past it the connection is closed with 1008.
QUEUED_INPUT_MAX_BYTES = 1 << 20


class WebSocketTransport:
    """A starlette WebSocket as a session `Transport`; remembers how the client left."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.info = ConnectionInfo()  # disconnect_code: how the client left
        self.pending: deque[str] = deque()  # frames read while waiting in the admission queue
        self.pending_bytes = 0  # ... their size, bounded by QUEUED_INPUT_MAX_BYTES
        nowait = websocket.scope.get("extensions", {}).get(SEND_NOWAIT)
        self._send_text_nowait: Callable[[str], bool] | None = nowait if callable(nowait) else None
        if self._send_text_nowait is not None:
            self.info.send_nowait = self.send_nowait
        receiver = websocket.scope.get("extensions", {}).get(SET_RECEIVER)
        self._set_receiver: Callable[[Callable[[str | bytes], None] | None], None] | None = (
            receiver if callable(receiver) else None
        )
        if self._set_receiver is not None:
            self.info.deliver = self.deliver

    @property
    def connected(self) -> bool:
        return self.websocket.application_state == WebSocketState.CONNECTED

    async def send(self, event: dict[str, Any]) -> None:
        if self.connected:
            # A logged event carries the JSON text the log stored: no second serialization.
            text = event_text(event)
            await self.websocket.send_text(text)

    def send_nowait(self, event: dict[str, Any]) -> bool:
        """Write `event` now if the socket can take it without waiting (the guarded protocol's
        scope extension): True if written; False: use `send`."""
        nowait = self._send_text_nowait
        return nowait is not None and self.connected and nowait(event_text(event))

    async def close(self, code: int, reason: str) -> None:
        if self.connected:
            await self.websocket.close(code=code, reason=reason)

    def _take_pending(self) -> str:
        text = self.pending.popleft()
        self.pending_bytes -= len(text)
        return text

    async def receive(self) -> str | None:
        if self.pending:
            return self._take_pending()
        return await self.read()

    async def deliver(self, on_text: Callable[[str], None]) -> None:
        """Hand each client frame to `on_text` as the protocol parses it (no task hop per
        frame), the frames read while waiting in admission first; return once the client is
        gone (its close code kept). A binary frame is decoded as `read` decodes it."""
        set_receiver = self._set_receiver
        assert set_receiver is not None
        while self.pending:
            on_text(self._take_pending())
        set_receiver(lambda data: on_text(frame_text(data)))
        try:
            # With the receiver set, read() returns only at the disconnect (None).
            while (frame := await self.read()) is not None:
                on_text(frame)
        finally:
            set_receiver(None)

    async def read(self) -> str | None:
        try:
            message = await self.websocket.receive()
        except (WebSocketDisconnect, RuntimeError):
            self.info.disconnect_code = self.info.disconnect_code or 1006
            return None
        if message["type"] == "websocket.disconnect":
            self.info.disconnect_code = int(message.get("code") or 1005)
            return None
        text = message.get("text")
        return frame_text(text if text is not None else message.get("bytes") or b"")


def frame_text(data: str | bytes) -> str:
    """A client frame as text: a binary frame is decoded as UTF-8, invalid bytes replaced."""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")


async def realtime_endpoint(websocket: WebSocket) -> None:
    ctx: ServerContext = websocket.app.state.ctx
    subprotocols = offered_subprotocols(websocket)
    principal = await principal_for(ctx, websocket.headers, subprotocols)
    if principal is None:
        ctx.metrics.admission("invalid_api_key")
        await websocket.send_denial_response(UNAUTHORIZED.response())
        return
    session_id = websocket.query_params.get("session_id")
    if session_id is not None:
        await resume_session(ctx, websocket, principal, session_id, subprotocols)
    else:
        await open_session(ctx, websocket, principal, subprotocols)


async def _accept(
    websocket: WebSocket, subprotocols: list[str], headers: dict[str, str] | None = None
) -> None:
    await websocket.accept(
        subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in subprotocols else None,
        headers=raw_headers(headers) if headers else None,
    )


def _capacity_error(decision: Rejected) -> dict[str, Any]:
    return connection_event(
        "error",
        None,
        error={
            "type": "server_error",
            "code": decision.code,
            "message": f"The server is at capacity ({decision.reason}); retry in {decision.retry_after_s} s.",
            "param": None,
            "event_id": None,
        },
    )


async def open_session(
    ctx: ServerContext, websocket: WebSocket, principal: Principal, subprotocols: list[str]
) -> None:
    host: SessionHost = ctx.host
    try:
        config = initial_config(ctx, websocket.query_params.get("model"), principal)
    except Exception as exc:
        ctx.metrics.admission("invalid_session_config")
        await websocket.send_denial_response(error_body(400, "invalid_session_config", str(exc)))
        return
    session_id = new_session_id()
    # Drawn now, so the 101 can carry it even when the upgrade comes before the record (queued).
    token = new_resume_token()
    accept_headers = resume_headers(session_id, token)
    extensions = wants_extensions(websocket.query_params, websocket.headers)
    try:
        decision = await host.admission.try_admit(session_id, principal.tenant)
    except StoreUnavailable:
        ctx.metrics.admission("store_unavailable")
        await websocket.send_denial_response(STORE_DOWN.response())
        return
    if isinstance(decision, Rejected):
        ctx.metrics.admission(decision.code)
        await websocket.send_denial_response(capacity(decision).response())
        return
    transport = WebSocketTransport(websocket)
    if isinstance(decision, Queued):
        await _accept(websocket, subprotocols, accept_headers)
        waited = await _wait_in_queue(host, transport, decision, principal.tenant, announce=extensions)
        if waited is None:  # the client left while queued
            return
        if isinstance(waited, Rejected):
            ctx.metrics.admission(waited.code)
            with contextlib.suppress(Exception):
                await transport.send(_capacity_error(waited))
                await transport.close(CAPACITY_CLOSE, "server at capacity")
            return
    try:
        hs, token = await host.create(session_id, principal.tenant, config, resume_token=token)
    except StoreUnavailable:
        await host.forfeit(session_id)
        ctx.metrics.admission("store_unavailable")
        if websocket.application_state == WebSocketState.CONNECTED:
            await transport.close(1011, "session store unavailable")
        else:
            await websocket.send_denial_response(STORE_DOWN.response())
        return
    ctx.metrics.admission("admitted")
    await _bind_ephemeral(ctx, principal, session_id)
    if websocket.application_state != WebSocketState.CONNECTED:
        await _accept(websocket, subprotocols, accept_headers)
    await host.serve_new(hs, transport, token, announce=extensions)


async def _bind_ephemeral(ctx: ServerContext, principal: Principal, session_id: str) -> None:
    """An `ek_` key may later GET/DELETE only what it opened (session/identity.py)."""
    if principal.ephemeral_key is not None:
        with contextlib.suppress(Exception):  # Redis just answered the create; a miss only narrows access
            await ctx.ephemeral.bind_session(principal, session_id)


async def _wait_in_queue(
    host: SessionHost, transport: WebSocketTransport, first: Queued, tenant: str, *, announce: bool
) -> Admitted | Rejected | None:
    """Queued: wait until admitted or refused, sending `omni.admission.queued` updates to a
    client that asked for `omni.*` events (`announce`). Frames the client sends meanwhile are
    kept for the session; None if the client leaves (its queue place or slot is given back)."""

    async def on_queued(q: Queued) -> None:
        if not announce:
            return
        event = connection_event(
            "omni.admission.queued", None, position=q.position, estimated_wait_ms=q.estimated_wait_ms
        )
        await transport.send(event)

    await on_queued(first)
    sid = first.session_id
    acquire = asyncio.create_task(
        host.admission.acquire(sid, tenant, deadline_s=host.settings.queue_deadline_s, on_queued=on_queued),
        name=f"admission:{sid}",
    )
    outcome: Admitted | Rejected | None = None
    reader: asyncio.Task[str | None] | None = None
    try:
        while True:
            reader = asyncio.create_task(transport.read(), name=f"queued-read:{sid}")
            await asyncio.wait({acquire, reader}, return_when=asyncio.FIRST_COMPLETED)
            if acquire.done():
                outcome = acquire.result()
                break
            text = reader.result()
            if text is None:
                break
            if transport.pending_bytes + len(text) > QUEUED_INPUT_MAX_BYTES:
                # Streaming a file while queued: keeping it would grow without bound, and
                # dropping some of it would lose the client's input silently.
                await transport.close(1008, "too much input while waiting in the admission queue")
                transport.info.disconnect_code = 1008
                break
            transport.pending.append(text)
            transport.pending_bytes += len(text)
    except Exception:
        log.warning("session %s: admission wait failed", sid, exc_info=True)
    finally:
        for task in (acquire, reader):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if not isinstance(outcome, Admitted) or transport.info.disconnect_code is not None:
            await host.forfeit(sid)  # leaves the queue, or gives back a slot nobody will use
    if transport.info.disconnect_code is not None:
        return None
    return outcome


async def resume_session(
    ctx: ServerContext, websocket: WebSocket, principal: Principal, session_id: str, subprotocols: list[str]
) -> None:
    host: SessionHost = ctx.host
    token = resume_token_from_request(websocket.headers.get(RESUME_HEADER), subprotocols)
    if not token:
        ctx.metrics.resume("invalid_resume_token")
        await websocket.send_denial_response(BAD_TOKEN.response())
        return
    try:
        if not is_session_id(session_id):
            raise SessionNotFound(session_id)
        await host.authorize(principal.tenant, session_id, token)
        hs = await host.restore(principal.tenant, session_id, token)
    except (SessionNotFound, ResumeTokenInvalid, AdmissionRefused, SessionElsewhere, StoreUnavailable) as exc:
        denial = resume_denial(exc)
        ctx.metrics.resume(denial.code)
        await websocket.send_denial_response(denial.response())
        return
    ctx.metrics.resume("resumed")
    await _bind_ephemeral(ctx, principal, session_id)  # it holds the token: its resume is its own
    await _accept(websocket, subprotocols)
    await host.serve_resume(hs, WebSocketTransport(websocket), websocket.query_params.get("last_event_id"))
