"""Protocol errors of the realtime session core, shaped like OpenAI Realtime `error` events."""

from __future__ import annotations

from typing import Final

INVALID_REQUEST: Final = "invalid_request_error"
SERVER_ERROR: Final = "server_error"

# Error codes (OpenAI's where OpenAI has one; the list for the rest).
INVALID_JSON: Final = "invalid_json"
INVALID_EVENT: Final = "invalid_event"
INVALID_VALUE: Final = "invalid_value"
UNKNOWN_PARAMETER: Final = "unknown_parameter"
MISSING_PARAMETER: Final = "missing_required_parameter"
COMMIT_EMPTY: Final = "input_audio_buffer_commit_empty"
ACTIVE_RESPONSE: Final = "conversation_already_has_active_response"
CANCEL_NOT_ACTIVE: Final = "response_cancel_not_active"
ITEM_NOT_FOUND: Final = "item_not_found"
DUPLICATE_ITEM_ID: Final = "duplicate_item_id"
UNSUPPORTED_CONTENT: Final = "unsupported_content_type"
SESSION_EXPIRED: Final = "session_expired"
# The pipeline's model could not fit the prompt (an engine failure whose text carries this code).
CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"
# Per-session budgets (CoreOptions.max_*): what one client may make the server keep.
CONVERSATION_TOO_LARGE: Final = "conversation_too_large"
STRING_TOO_LONG: Final = "string_above_max_length"
INPUT_AUDIO_TOO_LARGE: Final = "input_audio_buffer_too_large"

# What an error may echo of the client's input: a value shown in a message, a parameter name,
# the failing event's id. An error used to echo the whole invalid value (a 400 KB string sent as
# `session.audio` came back as a 400 KB error, was queued, logged to Redis and copied on the way,
# each time: issue 33's lone fuzzer); past these it shows the start and the length.
MAX_ECHO_CHARS: Final = 200
MAX_MESSAGE_CHARS: Final = 2048


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


class ProtocolError(Exception):
    """A client request the core rejects; becomes one `error` server event.

    Handlers raise it before changing any state, so a rejected event leaves the session as
    it was.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str = INVALID_REQUEST,
    ) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = None if param is None else clip(param)
        self.type = type
        self.event_id: str | None = None  # the client event that failed, echoed in the error

    def __repr__(self) -> str:
        return f"ProtocolError(code={self.code!r}, param={self.param!r}, message={self.message!r})"
