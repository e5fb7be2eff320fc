"""Who gets our `omni.*` events, and how a stock client learns its resume data instead.

Strict realtime clients validate every server event against the OpenAI event union (the
Agents SDK does: an unknown `type` becomes a `RealtimeError` handed to the application), so
an event they did not ask for is an error on their side, not something they ignore. The
server therefore sends `omni.*` events only to a connection that asks for them:

* the query parameter `omni_extensions=1` (WebSocket URLs and `POST …/calls` alike: it works
  from a browser, which can set neither headers on a WebSocket nor read the 101), or
* the request header `X-Omni-Extensions: 1` (server-side clients).

A resume request (it carries a resume token, which only a resume-aware client holds) counts
as asking: it gets `omni.session.resumed` / `.snapshot` / `.migrated` either way.

A client that does not ask still gets its resume data, in places strict clients never read:
the response that opens the connection (the WebSocket's 101, a call's 201) carries
`X-Omni-Session-Id` and `X-Omni-Resume-Token`; the session id is also `session.created`'s
`session.id`, and `expires_at` is there too.
"""

from __future__ import annotations

from collections.abc import Mapping

EXTENSIONS_PARAM = "omni_extensions"
EXTENSIONS_HEADER = "x-omni-extensions"
SESSION_ID_HEADER = "X-Omni-Session-Id"
RESUME_TOKEN_HEADER = "X-Omni-Resume-Token"

_YES = frozenset({"1", "true", "yes", "on"})


def wants_extensions(query: Mapping[str, str], headers: Mapping[str, str]) -> bool:
    """Whether the request asks for `omni.*` events (query parameter or header)."""
    value = query.get(EXTENSIONS_PARAM) or headers.get(EXTENSIONS_HEADER) or ""
    return value.strip().lower() in _YES


def resume_headers(session_id: str, resume_token: str) -> dict[str, str]:
    """The resume data as response headers (the 101 of a WebSocket, the 201 of a call)."""
    return {SESSION_ID_HEADER: session_id, RESUME_TOKEN_HEADER: resume_token}


def raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """ASGI form (what `WebSocket.accept(headers=...)` takes)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
