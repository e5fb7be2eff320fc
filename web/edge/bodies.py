"""Request bodies read with a byte limit and a deadline, enforced while reading.

``await request.body()`` buffers everything the client sends before any size check: a 64 MB
chunked SDP offer raised the peak RSS by 164 MB before its 400, and a 20 MB JSON body went
into Redis. Here the limit is checked against ``Content-Length`` first (413 before a byte of
the body is read) and then against the bytes received so far, chunk by chunk, so a chunked
body stops being read at the first chunk past the limit. A body that trickles in (slowloris)
ends with 408 at ``timeout_s``.

Every JSON body is then parsed by :func:`session.json_guard.loads_checked` (depth, Unicode):
``invalid_json`` / ``invalid_value`` as 400, never a 500.

A client that goes away while its body is read (starlette's ``ClientDisconnect``) is not an
error: one INFO line (method, path, bytes received) and :class:`BodyRefused` with a 499
``client_disconnected`` answer, which every caller already returns as the refusal it is (the
server drops it: nobody is there to read it). It escaped before, as "Exception in ASGI
application" with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import Message

from session.json_guard import JsonRejected, loads_checked

log = logging.getLogger(__name__)

MAX_JSON_BODY_BYTES: Final = 1024 * 1024  # client_secrets and other JSON bodies
MAX_FORWARDED_BODY_BYTES: Final = MAX_JSON_BODY_BYTES  # what a gateway or sibling worker relays
BODY_TIMEOUT_S: Final = 10.0


class BodyRefused(Exception):
    """The body was not read: ``response`` says why (413 too large, 408 too slow, 400)."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def _error(status: int, code: str, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"type": kind, "code": code, "message": message}}, status_code=status)


def body_timeout_s(request: Request) -> float:
    """The app's ``body_timeout_s`` (the session server sets its ``http_timeout_s``,
    web/settings.py), else 10 s."""
    return float(getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S))


async def read_body(request: Request, limit: int, *, timeout_s: float | None = None) -> bytes:
    """The whole body, or :class:`BodyRefused` once it is known to exceed ``limit`` bytes."""
    too_large = _error(413, "request_too_large", f"The request body must be at most {limit} bytes.")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise BodyRefused(
            too_large if length.isdigit() else _error(400, "invalid_request", "Bad Content-Length.")
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(body_timeout_s(request) if timeout_s is None else timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyRefused(too_large)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused(
            _error(408, "request_timeout", "The request body did not arrive in time.")
        ) from None
    except ClientDisconnect:
        log.info(
            "%s %s: the client went away during its body (%d of %s bytes received)",
            request.method,
            request.url.path,
            size,
            length if length is not None else "?",
        )
        raise BodyRefused(
            _error(499, "client_disconnected", "The client went away before its body was read.")
        ) from None
    return b"".join(chunks)


async def read_json_body(request: Request, limit: int = MAX_JSON_BODY_BYTES) -> Any:
    """The parsed JSON body (None when empty), or :class:`BodyRefused`."""
    body = await read_body(request, limit)
    if not body.strip():
        return None
    try:
        return loads_checked(body)
    except JsonRejected as exc:
        raise BodyRefused(_error(400, exc.code, exc.message)) from None


def replayed(request: Request, body: bytes) -> Request:
    """A request over the same scope whose body is ``body`` (read already, within limits), for
    parsers that read the stream themselves (multipart forms)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)
