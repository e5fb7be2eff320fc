"""`GET /v1/realtime`: the OpenAI Realtime (GA) protocol over WebSocket.

Only bytes ⇄ events here: authentication before the upgrade, then text frames in to the
session driver and server events out as JSON text frames.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from session.driver import DriverOptions, RealtimeDriver
from session.identity import Principal, api_key_from_request, authenticate, new_session_id
from session.realtime.config import SessionConfig, SessionIn
from session.realtime.core import CoreOptions, RealtimeSessionCore
from web.context import ServerContext

log = logging.getLogger(__name__)

REALTIME_SUBPROTOCOL = "realtime"


def error_body(status: int, code: str, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"type": kind, "code": code, "message": message}}, status_code=status)


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


def build_driver(
    ctx: ServerContext,
    config: SessionConfig,
    *,
    send: Any,
    close: Any,
    session_id: str | None = None,
    audio_out_via_track: bool = False,
    audio_sink: Any = None,
) -> RealtimeDriver:
    session_id = session_id or new_session_id()
    core = RealtimeSessionCore(
        CoreOptions(
            config=config,
            max_duration_s=ctx.settings.session_max_duration_s,
            audio_out_via_track=audio_out_via_track,
            pipeline_transcribes_input=ctx.pipeline_transcribes_input,
            session_id=session_id,
        )
    )
    return RealtimeDriver(
        core,
        ctx.orchestrator,
        send=send,
        close=close,
        vad=ctx.speech.new_vad_stream(),
        transcriber=ctx.speech.asr,
        audio_sink=audio_sink,
        options=DriverOptions(session_key=session_id, observer=ctx.metrics),
    )


async def realtime_endpoint(websocket: WebSocket) -> None:
    ctx: ServerContext = websocket.app.state.ctx
    subprotocols = offered_subprotocols(websocket)
    principal = await principal_for(ctx, websocket.headers, subprotocols)
    if principal is None:
        ctx.metrics.admission("invalid_api_key")
        await websocket.send_denial_response(
            error_body(401, "invalid_api_key", "Missing or invalid API key (Authorization: Bearer <key>).")
        )
        return
    if len(ctx.sessions) >= ctx.settings.max_sessions:
        ctx.metrics.admission("server_busy")
        await websocket.send_denial_response(
            error_body(503, "server_busy", f"All {ctx.settings.max_sessions} session slots are in use.")
        )
        return
    try:
        config = initial_config(ctx, websocket.query_params.get("model"), principal)
    except Exception as exc:
        ctx.metrics.admission("invalid_session_config")
        await websocket.send_denial_response(error_body(400, "invalid_session_config", str(exc)))
        return
    ctx.metrics.admission("admitted")
    await websocket.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in subprotocols else None)

    async def send(event: dict[str, Any]) -> None:
        if websocket.application_state == WebSocketState.CONNECTED:
            await websocket.send_text(json.dumps(event, separators=(",", ":")))

    async def close(code: int, reason: str) -> None:
        if websocket.application_state == WebSocketState.CONNECTED:
            await websocket.close(code=code, reason=reason)

    async def incoming() -> str | None:
        try:
            message = await websocket.receive()
        except (WebSocketDisconnect, RuntimeError):
            return None
        if message["type"] == "websocket.disconnect":
            return None
        text = message.get("text")
        if text is None:
            data = message.get("bytes") or b""
            text = data.decode("utf-8", errors="replace")
        return str(text)

    driver = build_driver(ctx, config, send=send, close=close)
    ctx.sessions[driver.core.session_id] = driver
    try:
        await driver.run(incoming)
    finally:
        ctx.sessions.pop(driver.core.session_id, None)
