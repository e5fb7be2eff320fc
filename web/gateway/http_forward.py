"""The gateway's HTTP forwarding: one pooled ``httpx`` client, requests copied to a replica.

Bodies are small (SDP offers, JSON) so they are read whole: that also lets a request be sent
again to another replica when the first one cannot be reached or is draining.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from web.gateway.relay import HOP_HEADERS

# Response headers recomputed by the server that sends them on.
_RESPONSE_SKIP = HOP_HEADERS | {"content-encoding", "date", "server"}


class ReplicaHttpUnreachable(Exception):
    """The replica could not be reached (connect error, timeout, reset)."""


class HttpForwarder:
    def __init__(self, *, timeout_s: float = 30.0, connect_timeout_s: float = 2.0) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            trust_env=False,  # never through an environment proxy: replicas are next door
            follow_redirects=False,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def forward(
        self, request: Request, body: bytes, base_url: str, *, client_host: str | None = None
    ) -> httpx.Response:
        """Send ``request`` (with its already read ``body``) to the replica at ``base_url``."""
        url = base_url.rstrip("/") + request.url.path
        headers = _request_headers(request.headers.raw, client_host)
        try:
            return await self.client.request(
                request.method, url, params=request.url.query or None, headers=headers, content=body
            )
        except httpx.TransportError as exc:
            raise ReplicaHttpUnreachable(f"{base_url}: {type(exc).__name__}: {exc}") from exc


def _request_headers(raw: Iterable[tuple[bytes, bytes]], client_host: str | None) -> list[tuple[str, str]]:
    out = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in raw
        if k.decode("latin-1").lower() not in HOP_HEADERS and k.lower() != b"accept-encoding"
    ]
    if client_host:
        out.append(("x-forwarded-for", client_host))
    return out


def to_response(upstream: httpx.Response, *, extra: dict[str, str] | None = None) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_SKIP}
    headers.update(extra or {})
    return Response(upstream.content, status_code=upstream.status_code, headers=headers)
