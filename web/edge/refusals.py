"""How the server refuses a request before any session starts: one vocabulary for every route
and transport (realtime WebSocket and WebRTC, world and robot sessions, REST). A
:class:`Denial` is an HTTP status, an error code and a message (and a ``Retry-After``); its
body has the realtime endpoint's shape, ``{"error": {type, code, message}}``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from session.admission import Rejected
from session.identity import Principal, is_session_id
from session.lifecycle import AdmissionRefused, SessionElsewhere
from session.store.errors import ResumeTokenInvalid, SessionNotFound, StoreUnavailable

T = TypeVar("T")


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

# What a resume's authorization may raise; :func:`resume_denial` names the refusal of each.
RESUME_REFUSED = (SessionNotFound, ResumeTokenInvalid, AdmissionRefused, SessionElsewhere, StoreUnavailable)


def resume_denial(exc: Exception) -> Denial:
    """Why a resume is refused (its code is also the metric's)."""
    if isinstance(exc, AdmissionRefused):
        return capacity(exc.decision)
    if isinstance(exc, ResumeTokenInvalid):
        return BAD_TOKEN
    if isinstance(exc, SessionElsewhere):
        return ELSEWHERE
    if isinstance(exc, StoreUnavailable):
        return STORE_DOWN
    return NOT_FOUND


async def authorize_resume(
    session_id: str, token: str | None, authorize: Callable[[str], Awaitable[T]]
) -> T | Denial:
    """``authorize(token)``'s session, or the refusal: no token (403), a malformed id (404), or
    what the authorization raised (:func:`resume_denial`)."""
    try:
        if not token:
            raise ResumeTokenInvalid(session_id)
        if not is_session_id(session_id):
            raise SessionNotFound(session_id)
        return await authorize(token)
    except RESUME_REFUSED as exc:
        return resume_denial(exc)


class Admits(Protocol):
    """A host that holds slots: a new session id, or back with one that did not open."""

    async def admit(self, tenant: str) -> str: ...

    async def forfeit(self, session_id: str) -> None: ...


async def admitted(host: Admits, tenant: str) -> str | Denial:
    """A new session id holding a slot: 429 when no slot is free, 503 when the store is down."""
    try:
        return await host.admit(tenant)
    except AdmissionRefused as refused:
        return capacity(refused.decision)
    except StoreUnavailable:
        return STORE_DOWN


async def open_admitted(host: Admits, tenant: str, create: Callable[[str], Awaitable[T]]) -> T | Denial:
    """A slot (:func:`admitted`), then :func:`create_admitted`."""
    session_id = await admitted(host, tenant)
    if isinstance(session_id, Denial):
        return session_id
    return await create_admitted(host, session_id, create)


async def create_admitted(host: Admits, session_id: str, create: Callable[[str], Awaitable[T]]) -> T | Denial:
    """``create(session_id)`` for an admitted session: 503 when the store is down (or the new
    session's binding failed); the slot goes back whenever ``create`` fails."""
    try:
        return await create(session_id)
    except (StoreUnavailable, SessionElsewhere):
        await host.forfeit(session_id)
        return STORE_DOWN
    except BaseException:
        await host.forfeit(session_id)
        raise


async def identified(
    identify: Callable[[HTTPConnection], Awaitable[Principal | None]] | None, connection: HTTPConnection
) -> Principal | Denial:
    """Who is calling (the default tenant without an identity check): 401 for an unknown key,
    503 when the store is down."""
    if identify is None:
        return Principal("default")
    try:
        principal = await identify(connection)
    except StoreUnavailable:
        return STORE_DOWN
    return UNAUTHORIZED if principal is None else principal
