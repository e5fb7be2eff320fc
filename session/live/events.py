"""The GPT-Live wire vocabulary: client events parsed and checked, server events built.

The contract is what LiveKit Agents' ``GPTLiveModel`` sends and reads
(``livekit/agents/llm/_realtime/gpt_live_types.py``): one JSON text frame per event, each with
a ``type``. :func:`parse_client_event` turns a decoded frame into one typed event or raises
:class:`LiveProtocolError` with the code a client can act on and the dotted ``param``; the
client's ``event_id``, when one could be read, comes back as ``client_event_id`` (the field
GPT-Live's ``error`` carries). ``session.input_audio.append`` is the hot path (ten a second per
session): it is read without a model class. Fields a client may not send are refused
(``unknown_parameter``): a misspelt setting is an error, never silently ignored.

Server events are plain dicts built here (:func:`started`, :func:`audio_delta`, ...), so the
core names no literal event type of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

DelegationTarget = Literal["client", "responses"]
AppendKind = Literal["instructions", "thinking", "commentary"]

# error codes (the ``code`` of an ``error`` event)
INVALID_JSON: Final = "invalid_json"
INVALID_EVENT: Final = "invalid_event"
UNKNOWN_EVENT: Final = "unknown_event"
MISSING_PARAMETER: Final = "missing_required_parameter"
UNKNOWN_PARAMETER: Final = "unknown_parameter"
INVALID_VALUE: Final = "invalid_value"
INVALID_AUDIO: Final = "invalid_audio"
UNSUPPORTED_FORMAT: Final = "unsupported_audio_format"
MODEL_NOT_FOUND: Final = "model_not_found"
DELEGATION_UNAVAILABLE: Final = "delegation_unavailable"
DELEGATION_FIXED: Final = "delegation_immutable"
UNKNOWN_DELEGATION: Final = "unknown_delegation"
NOT_STARTED: Final = "session_not_started"
ALREADY_STARTED: Final = "session_already_started"
START_TIMEOUT: Final = "session_start_timeout"
MESSAGE_TOO_LARGE: Final = "message_too_large"
AUDIO_TOO_LARGE: Final = "input_audio_too_large"
TEXT_TOO_LARGE: Final = "text_too_large"
CONTEXT_FULL: Final = "context_full"
INPUT_OVERFLOW: Final = "input_audio_overflow"
LIVE_FAILED: Final = "live_request_failed"
SERVER_ERROR: Final = "server_error"

SAMPLE_RATE: Final = 24_000


@dataclass(frozen=True, slots=True)
class LiveLimits:
    """What one session may make the server keep or handle, in bytes and seconds (each limit
    has its error code; docs/sessions.md, "GPT-Live sessions")."""

    max_message_bytes: int = 256 * 1024  # one client frame (message_too_large, close 1009)
    max_append_audio_bytes: int = 96_000  # one append: 2 s of 24 kHz PCM16 (input_audio_too_large)
    max_instructions_bytes: int = 32 * 1024  # session.start's instructions (text_too_large)
    max_append_bytes: int = 4 * 1024  # one instructions/thinking/commentary append (text_too_large)
    max_input_items: int = 128  # session.start's startup history (invalid_value)
    max_context_bytes: int = 256 * 1024  # all text the session keeps (context_full)
    max_pending_items: int = 64  # response.item.create results awaiting response.create (context_full)
    max_queued_audio_s: float = 10.0  # input audio ahead of the model (input_audio_overflow)
    start_timeout_s: float = 10.0  # from the upgrade to session.start (session_start_timeout, 1008)
    usage_interval_s: float = 10.0  # session.usage.updated every this many seconds of audio


class LiveProtocolError(Exception):
    """A client event the server refuses: an ``error`` event with this code goes back."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.kind = kind

    def to_event(self) -> dict[str, Any]:
        return error(self.code, self.message, param=self.param, event_id=self.event_id, kind=self.kind)


# --- client events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartupItem:
    """One message of ``session.start``'s startup history."""

    role: Literal["developer", "user", "assistant"]
    text: str


@dataclass(frozen=True, slots=True)
class StartConfig:
    """``session.start``'s session: fixed for the life of the session."""

    model: str
    instructions: str = ""
    history: tuple[StartupItem, ...] = ()
    voice: str | dict[str, Any] | None = None
    delegation: DelegationTarget | None = None  # None: not asked (the pipeline's default)
    responses: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SessionStart:
    event_id: str | None
    config: StartConfig


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    event_id: str | None
    delegation: DelegationTarget
    responses: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AudioAppend:
    audio: str  # base64 PCM16, decoded by the core (it knows the limits)


@dataclass(frozen=True, slots=True)
class MuteInput:
    event_id: str | None
    muted: bool


@dataclass(frozen=True, slots=True)
class ContextAppend:
    event_id: str | None
    kind: AppendKind
    content: str
    delegation_id: str | None


@dataclass(frozen=True, slots=True)
class ItemCreate:
    event_id: str | None
    item: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    event_id: str | None


@dataclass(frozen=True, slots=True)
class SessionClose:
    event_id: str | None


ClientEvent = (
    SessionStart
    | SessionUpdate
    | AudioAppend
    | MuteInput
    | ContextAppend
    | ItemCreate
    | ResponseCreate
    | SessionClose
)

APPENDS: Final[dict[str, AppendKind]] = {
    "session.instructions.append": "instructions",
    "session.thinking.append": "thinking",
    "session.commentary.append": "commentary",
}
CLIENT_TYPES: Final = frozenset(
    {
        "session.start",
        "session.update",
        "session.input_audio.append",
        "session.input_audio.mute",
        "session.input_audio.unmute",
        "response.item.create",
        "response.create",
        "session.close",
        *APPENDS,
    }
)


def _fields(data: dict[str, Any], allowed: frozenset[str], where: str, event_id: str | None) -> None:
    for key in data:
        if key not in allowed:
            param = f"{where}.{key}" if where else key
            raise LiveProtocolError(
                UNKNOWN_PARAMETER, f"Unknown parameter: '{param}'.", param=param, event_id=event_id
            )


def _str(data: dict[str, Any], key: str, where: str, event_id: str | None, *, required: bool) -> str | None:
    value = data.get(key)
    param = f"{where}.{key}" if where else key
    if value is None:
        if required:
            raise LiveProtocolError(
                MISSING_PARAMETER, f"Missing required parameter: '{param}'.", param=param, event_id=event_id
            )
        return None
    if not isinstance(value, str):
        raise LiveProtocolError(INVALID_VALUE, f"'{param}' must be a string.", param=param, event_id=event_id)
    return value


def _object(data: dict[str, Any], key: str, where: str, event_id: str | None) -> dict[str, Any] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        param = f"{where}.{key}" if where else key
        raise LiveProtocolError(
            INVALID_VALUE, f"'{param}' must be an object.", param=param, event_id=event_id
        )
    return value


def parse_client_event(data: Any) -> ClientEvent:
    """One decoded client frame as a typed event; :class:`LiveProtocolError` otherwise."""
    if not isinstance(data, dict):
        raise LiveProtocolError(INVALID_EVENT, "A client event must be a JSON object.")
    kind = data.get("type")
    if kind == "session.input_audio.append":  # the hot path: one check, no model
        audio = data.get("audio")
        if not isinstance(audio, str) or len(data) > 3 or not set(data) <= {"type", "audio", "event_id"}:
            _fields(data, frozenset({"type", "audio", "event_id"}), "", None)
            _str(data, "audio", "", None, required=True)
        return AudioAppend(str(audio))
    raw_id = data.get("event_id")
    event_id = raw_id if isinstance(raw_id, str) else None
    if not isinstance(kind, str):
        raise LiveProtocolError(INVALID_EVENT, "The event has no 'type'.", param="type", event_id=event_id)
    if kind not in CLIENT_TYPES:
        raise LiveProtocolError(
            UNKNOWN_EVENT, f"Unknown event type '{kind[:64]}'.", param="type", event_id=event_id
        )
    if raw_id is not None and event_id is None:
        raise LiveProtocolError(INVALID_VALUE, "'event_id' must be a string.", param="event_id")
    if kind in APPENDS:
        _fields(data, frozenset({"type", "event_id", "content", "delegation_id"}), "", event_id)
        content = _str(data, "content", "", event_id, required=True)
        assert content is not None
        return ContextAppend(
            event_id, APPENDS[kind], content, _str(data, "delegation_id", "", event_id, required=False)
        )
    if kind in ("session.input_audio.mute", "session.input_audio.unmute"):
        _fields(data, frozenset({"type", "event_id"}), "", event_id)
        return MuteInput(event_id, kind.endswith(".mute"))
    if kind in ("response.create", "session.close"):
        _fields(data, frozenset({"type", "event_id"}), "", event_id)
        return ResponseCreate(event_id) if kind == "response.create" else SessionClose(event_id)
    if kind == "response.item.create":
        _fields(data, frozenset({"type", "event_id", "item"}), "", event_id)
        item = _object(data, "item", "", event_id)
        if item is None:
            raise LiveProtocolError(
                MISSING_PARAMETER, "Missing required parameter: 'item'.", param="item", event_id=event_id
            )
        if not isinstance(item.get("type"), str):
            raise LiveProtocolError(
                MISSING_PARAMETER, "The item has no 'type'.", param="item.type", event_id=event_id
            )
        return ItemCreate(event_id, item)
    if kind == "session.update":
        _fields(data, frozenset({"type", "event_id", "session"}), "", event_id)
        session = _object(data, "session", "", event_id) or {}
        _fields(session, frozenset({"delegation"}), "session", event_id)
        target, responses = _delegation(session, "session", event_id)
        if target is None:
            raise LiveProtocolError(
                MISSING_PARAMETER,
                "session.update takes only 'session.delegation'.",
                param="session.delegation",
                event_id=event_id,
            )
        return SessionUpdate(event_id, target, responses)
    _fields(data, frozenset({"type", "event_id", "session"}), "", event_id)
    start = _object(data, "session", "", event_id)
    if start is None:
        raise LiveProtocolError(
            MISSING_PARAMETER, "Missing required parameter: 'session'.", param="session", event_id=event_id
        )
    return SessionStart(event_id, _start_config(start, event_id))


def _start_config(session: dict[str, Any], event_id: str | None) -> StartConfig:
    _fields(
        session, frozenset({"model", "instructions", "input", "audio", "delegation"}), "session", event_id
    )
    model = _str(session, "model", "session", event_id, required=True)
    assert model is not None
    instructions = _str(session, "instructions", "session", event_id, required=False) or ""
    history = _history(session.get("input"), event_id)
    voice: str | dict[str, Any] | None = None
    audio = _object(session, "audio", "session", event_id)
    if audio is not None:
        _fields(audio, frozenset({"format", "output"}), "session.audio", event_id)
        fmt = _object(audio, "format", "session.audio", event_id)
        if fmt is not None:
            _fields(fmt, frozenset({"type", "rate"}), "session.audio.format", event_id)
            if fmt.get("type", "audio/pcm") != "audio/pcm" or fmt.get("rate", SAMPLE_RATE) != SAMPLE_RATE:
                raise LiveProtocolError(
                    UNSUPPORTED_FORMAT,
                    f"This server takes and sends audio/pcm at {SAMPLE_RATE} Hz only "
                    f"(got {fmt.get('type', 'audio/pcm')!s:.32} at {fmt.get('rate', SAMPLE_RATE)!s:.16}).",
                    param="session.audio.format",
                    event_id=event_id,
                )
        output = _object(audio, "output", "session.audio", event_id)
        if output is not None:
            _fields(output, frozenset({"voice"}), "session.audio.output", event_id)
            value = output.get("voice")
            if value is not None and not isinstance(value, str | dict):
                raise LiveProtocolError(
                    INVALID_VALUE,
                    "'session.audio.output.voice' must be a name or an object.",
                    param="session.audio.output.voice",
                    event_id=event_id,
                )
            voice = value
    target, responses = _delegation(session, "session", event_id)
    return StartConfig(model, instructions, history, voice, target, responses)


def _history(raw: Any, event_id: str | None) -> tuple[StartupItem, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise LiveProtocolError(
            INVALID_VALUE, "'session.input' must be a list.", param="session.input", event_id=event_id
        )
    items: list[StartupItem] = []
    for i, item in enumerate(raw):
        where = f"session.input.{i}"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise LiveProtocolError(
                INVALID_VALUE, f"'{where}' must be a message.", param=where, event_id=event_id
            )
        _fields(item, frozenset({"type", "role", "content"}), where, event_id)
        role = item.get("role", "user")
        if role not in ("developer", "user", "assistant"):
            raise LiveProtocolError(
                INVALID_VALUE,
                f"'{where}.role' must be developer, user or assistant.",
                param=f"{where}.role",
                event_id=event_id,
            )
        texts: list[str] = []
        for j, part in enumerate(item.get("content") or []):
            ok = isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
            if not ok or not isinstance(part.get("text", ""), str):
                param = f"{where}.content.{j}"
                raise LiveProtocolError(
                    INVALID_VALUE, f"'{param}' must be a text part.", param=param, event_id=event_id
                )
            texts.append(part.get("text", ""))
        items.append(StartupItem(role, "".join(texts)))
    return tuple(items)


def _delegation(
    session: dict[str, Any], where: str, event_id: str | None
) -> tuple[DelegationTarget | None, dict[str, Any]]:
    raw = _object(session, "delegation", where, event_id)
    if raw is None:
        return None, {}
    param = f"{where}.delegation"
    _fields(raw, frozenset({"type", "responses"}), param, event_id)
    target = raw.get("type", "responses")
    if target not in ("client", "responses"):
        raise LiveProtocolError(
            INVALID_VALUE,
            f"'{param}.type' must be 'client' or 'responses'.",
            param=f"{param}.type",
            event_id=event_id,
        )
    responses = _object(raw, "responses", param, event_id)
    return target, dict(responses or {})


# --- server events -------------------------------------------------------------------------


def error(
    code: str,
    message: str,
    *,
    param: str | None = None,
    event_id: str | None = None,
    kind: str = "invalid_request_error",
) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": kind,
            "code": code,
            "message": message,
            "param": param,
            "client_event_id": event_id,
        },
    }


def started(session: dict[str, Any]) -> dict[str, Any]:
    return {"type": "session.started", "session": session}


def audio_delta(delta: str) -> dict[str, Any]:
    return {"type": "session.output_audio.delta", "delta": delta}


def transcript_delta(
    who: Literal["input", "output"], text: str, start_ms: int, end_ms: int
) -> dict[str, Any]:
    return {"type": f"session.{who}_transcript.delta", "delta": text, "start_ms": start_ms, "end_ms": end_ms}


def ack(kind: str, event_id: str | None) -> dict[str, Any]:
    """``session.input_audio.muted``, ``session.instructions.appended``, ``session.updated``..."""
    return {"type": kind, "client_event_id": event_id}


def delegation_created(delegation_id: str, target: DelegationTarget) -> dict[str, Any]:
    return {"type": "session.delegation.created", "delegation": {"id": delegation_id, "target": target}}


def response_event(delegation_id: str | None, event: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response.event", "delegation_id": delegation_id, "event": event}


def usage_updated(seconds: float) -> dict[str, Any]:
    return {"type": "session.usage.updated", "usage": {"seconds": round(seconds, 3)}}


def closed(reason: str, seconds: float) -> dict[str, Any]:
    return {"type": "session.closed", "reason": reason, "usage": {"seconds": round(seconds, 3)}}
