"""Internal failures as clients see them: a generic message and a reference, never the text.

An exception's message is for the server's log: it can name files, libraries, other users'
data or, as with a lone surrogate in a voice turn, just confuse (`'utf-8' codec can't encode
character '\\ud800'`). What a client gets instead is the same sentence every time plus a short
``ref`` that is also on the one log line with the details, so an operator finds it.
"""

from __future__ import annotations

import logging
import secrets

GENERIC = "The server had an error while processing your request"
# Engine failures meant for the client (the request is at fault): their text, from the code on,
# is the client's message (e.g. engines/speech/chat.py's context_length_exceeded).
# stage_unavailable: a stage on another host lost its host, or has none (runtime/remote); the
# client hears which stage, never the host's address.
CLIENT_FACING_CODES = ("context_length_exceeded", "stage_unavailable")


def report_internal(logger: logging.Logger, context: str, detail: object, *, exc_info: bool = False) -> str:
    """Log `detail` (an exception or the runtime's error text) under a new reference and
    return the client's message, e.g. ``"The server had an error while processing your
    request (ref err_3f9a1c2b7d10)."``."""
    ref = f"err_{secrets.token_hex(6)}"
    logger.error("%s [%s]: %s", context, ref, detail, exc_info=exc_info)
    return f"{GENERIC} (ref {ref})."


def client_facing(detail: str) -> str | None:
    """The client's part of a runtime error that carries a client-facing code (from the code
    on, without the stage and exception prefix), or None for an internal failure."""
    for code in CLIENT_FACING_CODES:
        if code in detail:
            return detail[detail.index(code) :]
    return None
