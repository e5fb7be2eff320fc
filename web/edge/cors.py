"""Browser origins: CORS for the HTTP routes a web app calls, and the same policy for WebSockets.

A web app that uses this server is served from its own origin and calls us cross-origin: the
official browser SDK posts its SDP offer to `/v1/realtime/calls` with `Authorization`,
`Content-Type: application/sdp` and `X-OpenAI-Agents-SDK` (a preflight first) and reads the
call id from `Location`. Which origins may do so is the deployment's choice
(`omniduplex serve --cors-origins`):

* a list of origins (`https://app.example.com,https://admin.example.com`), or `*` for any;
* default (nothing given): no other origin, except **loopback origins while the server runs
  open** (no API keys, which it only does bound to loopback): a page on another local port
  is the developer's own, while without keys any web site the developer visits could
  otherwise drive the local server from their browser.

Same-origin requests (the `Origin`'s host is the request's `Host`: the demo pages) and requests
without an `Origin` (SDKs, curl: not a browser) always pass. A browser request from an origin
not allowed gets `403 origin_not_allowed` before any route runs — a preflight, a request a
browser sends without one (a `multipart/form-data` offer is such a "simple" request: it would
otherwise open a session the page cannot even read), and a WebSocket upgrade (browsers send
`Origin` on every WebSocket and CORS does not cover them).

No credentials mode: clients authenticate with bearer keys, never cookies, so there is no
`Access-Control-Allow-Credentials` and `*` is safe to answer as the echoed origin.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from session.identity import ApiKeyMap

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# What browser clients send: the agents SDK (authorization, content-type, x-openai-agents-sdk),
# the openai JS SDK in a browser (openai-beta, openai-organization/-project, x-stainless-*), and
# ours (resume token, extensions opt-in).
ALLOWED_HEADERS = (
    "authorization",
    "content-type",
    "x-openai-agents-sdk",
    "openai-beta",
    "openai-organization",
    "openai-project",
    "x-omni-resume-token",
    "x-omni-extensions",
    "x-stainless-arch",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
)
# `Location` carries a call's id (the SDK reads it); the rest: resume data and back-off.
EXPOSED_HEADERS = "Location, X-Omni-Session-Id, X-Omni-Resume-Token, Retry-After"
PREFLIGHT_MAX_AGE_S = 600
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    """Which cross-origin browser pages may call the server (no I/O)."""

    origins: frozenset[str] = frozenset()
    any_origin: bool = False
    loopback: bool = False  # any http(s)://loopback:port origin

    @classmethod
    def from_setting(cls, value: str | None, *, open_mode: bool) -> OriginPolicy:
        """`--cors-origins`: None → the default (loopback origins only while open); "" → none;
        "*" → any; else a comma-separated list of origins (scheme://host[:port])."""
        if value is None:
            return cls(loopback=open_mode)
        items = [v.strip().rstrip("/") for v in value.split(",") if v.strip()]
        if "*" in items:
            return cls(any_origin=True)
        for item in items:
            parts = urlsplit(item)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
                raise ValueError(f"--cors-origins: {item!r} is not an origin (scheme://host[:port])")
        return cls(origins=frozenset(i.lower() for i in items))

    def allows(self, origin: str, host: str | None) -> bool:
        """Whether a request from page `origin` to this server (its `Host` header) may pass."""
        parts = urlsplit(origin)
        if parts.netloc and host is not None and parts.netloc.lower() == host.lower():
            return True  # same origin (the scheme is left aside: a TLS proxy may front us)
        if self.any_origin or origin.lower() in self.origins:
            return True
        return self.loopback and parts.scheme in ("http", "https") and parts.hostname in LOOPBACK_HOSTS

    def describe(self) -> str:
        if self.any_origin:
            return "any origin"
        named = sorted(self.origins)
        if self.loopback:
            named.append("loopback origins (open mode)")
        return ", ".join(named) or "same origin only"


def origin_policy(cors_origins: str | None, api_keys: str) -> OriginPolicy:
    """The policy of a server (or gateway) from its `--cors-origins` and `--api-keys`."""
    open_mode = not api_keys.strip() or len(ApiKeyMap.parse(api_keys)) == 0
    return OriginPolicy.from_setting(cors_origins, open_mode=open_mode)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _refusal(origin: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(
        {
            "error": {
                "type": "invalid_request_error",
                "code": "origin_not_allowed",
                "message": f"Origin {origin!r} may not call this server (see --cors-origins).",
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return headers, body


class CorsMiddleware:
    """ASGI middleware applying an :class:`OriginPolicy` to HTTP and WebSocket requests."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        origin = _header(scope, b"origin") if kind in ("http", "websocket") else None
        if origin is None:  # not a browser (or a navigation): nothing to decide
            await self.app(scope, receive, send)
            return
        allowed = self.policy.allows(origin, _header(scope, b"host"))
        if kind == "websocket":
            if allowed:
                await self.app(scope, receive, send)
            else:
                await self._refuse_websocket(origin, receive, send)
            return
        preflight = scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method")
        if not allowed:
            await self._refuse_http(origin, send)
        elif preflight:
            await self._preflight(origin, send)
        else:
            await self.app(scope, receive, _with_cors(send, origin))

    async def _preflight(self, origin: str, send: Send) -> None:
        headers = [
            *_cors_headers(origin),
            (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
            (b"access-control-allow-headers", ", ".join(ALLOWED_HEADERS).encode()),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _refuse_http(origin: str, send: Send) -> None:
        headers, body = _refusal(origin)
        headers.append((b"vary", b"Origin"))
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _refuse_websocket(origin: str, receive: Receive, send: Send) -> None:
        """403 before the upgrade, with the JSON body (the server supports denial responses:
        every refusal of the realtime routes is one)."""
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        headers, body = _refusal(origin)
        await send({"type": "websocket.http.response.start", "status": 403, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})


def _cors_headers(origin: str) -> Iterable[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", EXPOSED_HEADERS.encode()),
        (b"vary", b"Origin"),
    ]


def _with_cors(send: Send, origin: str) -> Send:
    """`send` that adds the CORS headers to the response start (replacing any already there:
    a response relayed from a replica must not carry two `Access-Control-Allow-Origin`)."""
    added = list(_cors_headers(origin))
    names = {name for name, _ in added}

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
            message = {**message, "headers": [*kept, *added]}
        await send(message)

    return wrapped
