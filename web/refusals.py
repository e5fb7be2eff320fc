"""How the server refuses a request before any session starts: one vocabulary for every route
and transport (realtime WebSocket and WebRTC, world and robot sessions, REST). A
:class:`Denial` is an HTTP status, an error code and a message (and a ``Retry-After``); its
body has the realtime endpoint's shape, ``{"error": {type, code, message}}``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse

from session.admission import Rejected


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request is refused (HTTP status, error code, text, seconds to retry after)."""

    status: int
    code: str
    message: str
    retry_after_s: int | None = None

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"type": kind, "code": self.code, "message": self.message}}
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def error_body(status: int, code: str, message: str, *, retry_after_s: int | None = None) -> JSONResponse:
    """The response of a :class:`Denial` made on the spot."""
    return Denial(status, code, message, retry_after_s).response()


def capacity(decision: Rejected) -> Denial:
    """No session slot: 429 with the admission decision's code, reason and retry time."""
    return Denial(429, decision.code, f"No session slot is free ({decision.reason}).", decision.retry_after_s)


UNAUTHORIZED = Denial(401, "invalid_api_key", "Missing or invalid API key (Authorization: Bearer <key>).")
STORE_DOWN = Denial(503, "store_unavailable", "The session store (Redis) is unavailable; retry shortly.", 1)
BAD_TOKEN = Denial(403, "invalid_resume_token", "The resume token is missing or not valid.")
NOT_FOUND = Denial(404, "session_not_found", "No such session (it may have expired).")
ELSEWHERE = Denial(409, "session_elsewhere", "The session is served by another replica.", 1)
CALL_NOT_FOUND = Denial(404, "call_not_found", "No such call (or its session has ended).")
STARTING = Denial(503, "not_ready", "The server is starting; retry shortly.", 1)
