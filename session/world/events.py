"""Wire vocabulary of ``/v1/realtime/video`` (vLLM-Omni's streaming video protocol, extended
with actions): typed client events in, typed server events out, and the error codes.

Client (JSON text frames): ``session.start``, ``session.interaction``, ``session.stop``,
``session.ping``. Server: ``video.start``, ``video.chunk_metadata`` (each one immediately
followed by one binary frame), ``session.interaction.queued``, ``session.interaction.applied``,
``session.pong``, ``session.done``, ``error``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

from session.json_guard import JsonRejected, loads_checked

KeyEventKind = Literal["keydown", "keyup"]


class ErrorCode:
    INVALID_JSON = "invalid_json"
    INVALID_EVENT = "invalid_event"  # unknown type, missing or mistyped field
    UNKNOWN_MODEL = "unknown_model"
    UNSUPPORTED_FORMAT = "unsupported_format"
    SIZE_TOO_LARGE = "size_too_large"
    INVALID_PARAMETER = "invalid_parameter"  # fps, num_frames, odd size for m4s, ...
    INVALID_ACTION = "invalid_action"
    PROMPT_NOT_SUPPORTED = "prompt_not_supported"
    NO_ACTIVE_SESSION = "no_active_session"
    SESSION_ALREADY_ACTIVE = "session_already_active"
    CAPACITY = "capacity_exceeded"
    GENERATION_FAILED = "generation_failed"
    CLIENT_STALLED = "client_stalled"
    MESSAGE_TOO_LARGE = "message_too_large"
    SESSION_EXPIRED = "session_expired"  # idle TTL or maximum lifetime (hosted sessions)


class ProtocolError(ValueError):
    """A client event the session refuses: ``code`` for programs, the message for people."""

    def __init__(self, code: str, message: str, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id


# ----------------------------------------------------------------------------- client events


@dataclass(slots=True, frozen=True)
class SessionStart:
    model: str
    prompt: str = ""
    format: str = "jpeg"
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    num_frames: int | None = None
    seed: int | None = None
    extra_params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class KeyEvent:
    event: KeyEventKind
    key: str
    t_ms: float | None = None


@dataclass(slots=True, frozen=True)
class SessionInteraction:
    prompt: str | None = None
    actions: tuple[KeyEvent, ...] = ()
    event_id: str | None = None


@dataclass(slots=True, frozen=True)
class SessionStop:
    pass


@dataclass(slots=True, frozen=True)
class SessionPing:
    pass


ClientEvent = SessionStart | SessionInteraction | SessionStop | SessionPing


def _field(data: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError(ErrorCode.INVALID_EVENT, f"{name}: expected {kinds}, got a boolean")
    if not isinstance(value, kinds):
        raise ProtocolError(ErrorCode.INVALID_EVENT, f"{name}: expected {kinds}, got {type(value).__name__}")
    return value


def _parse_action(raw: Any, event_id: str | None) -> KeyEvent:
    if not isinstance(raw, dict):
        raise ProtocolError(
            ErrorCode.INVALID_ACTION, "an action is an object {event, key, t_ms?}", event_id=event_id
        )
    kind = raw.get("event")
    key = raw.get("key")
    if kind not in ("keydown", "keyup"):
        raise ProtocolError(
            ErrorCode.INVALID_ACTION,
            f"action.event must be 'keydown' or 'keyup', got {kind!r}",
            event_id=event_id,
        )
    if not isinstance(key, str) or not key or len(key) > 32:
        raise ProtocolError(
            ErrorCode.INVALID_ACTION, f"action.key must be a key name, got {key!r}", event_id=event_id
        )
    t_ms = raw.get("t_ms")
    if t_ms is not None and (isinstance(t_ms, bool) or not isinstance(t_ms, int | float)):
        raise ProtocolError(ErrorCode.INVALID_ACTION, "action.t_ms must be a number", event_id=event_id)
    return KeyEvent(kind, key, None if t_ms is None else float(t_ms))


def _parse_interaction(data: dict[str, Any], max_actions: int) -> SessionInteraction:
    # vLLM-Omni nests the update: {"interaction": {"event_id": ..., "event": {"prompt": ...}}}
    nested = data.get("interaction")
    if isinstance(nested, dict):
        body = dict(nested.get("event") or {})
        body.setdefault("event_id", nested.get("event_id"))
    else:
        body = data
    event_id = _field(body, "event_id", str)
    prompt = _field(body, "prompt", str)
    raw_actions = _field(body, "actions", list, [])
    if len(raw_actions) > max_actions:
        raise ProtocolError(
            ErrorCode.INVALID_ACTION, f"at most {max_actions} actions per interaction", event_id=event_id
        )
    actions = tuple(_parse_action(raw, event_id) for raw in raw_actions)
    if prompt is None and not actions:
        raise ProtocolError(
            ErrorCode.INVALID_EVENT, "session.interaction needs a prompt or actions", event_id=event_id
        )
    return SessionInteraction(prompt=prompt, actions=actions, event_id=event_id)


def _parse_start(data: dict[str, Any]) -> SessionStart:
    model = _field(data, "model", str)
    if not model:
        raise ProtocolError(ErrorCode.INVALID_EVENT, "session.start needs a model")
    fps = _field(data, "fps", (int, float))
    return SessionStart(
        model=model,
        prompt=_field(data, "prompt", str, ""),
        format=_field(data, "format", str, "jpeg"),
        width=_field(data, "width", int),
        height=_field(data, "height", int),
        fps=None if fps is None else float(fps),
        num_frames=_field(data, "num_frames", int),
        seed=_field(data, "seed", int),
        extra_params=dict(_field(data, "extra_params", dict, {})),
    )


def parse_client_event(text: str, *, max_actions: int = 64) -> ClientEvent:
    """One JSON text frame → a typed event, or :class:`ProtocolError` saying what is wrong."""
    try:  # depth and Unicode checked too: nothing deeper than 64 levels reaches a world
        data = loads_checked(text)
    except JsonRejected as exc:
        code = ErrorCode.INVALID_JSON if exc.code == "invalid_json" else ErrorCode.INVALID_PARAMETER
        raise ProtocolError(code, exc.message) from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_JSON, "an event is a JSON object")
    kind = data.get("type")
    if kind == "session.start":
        return _parse_start(data)
    if kind == "session.interaction":
        return _parse_interaction(data, max_actions)
    if kind == "session.stop":
        return SessionStop()
    if kind == "session.ping":
        return SessionPing()
    raise ProtocolError(
        ErrorCode.INVALID_EVENT,
        f"unknown event type {kind!r} "
        "(expected session.start, session.interaction, session.stop, session.ping)",
    )


# ----------------------------------------------------------------------------- server events


@dataclass(slots=True)
class ServerEvent:
    type: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if v is not None}
        return {"type": self.type, **body}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


@dataclass(slots=True)
class VideoStart(ServerEvent):
    type: ClassVar[str] = "video.start"
    request_id: str
    session_id: str
    format: str
    config: dict[str, Any]


@dataclass(slots=True)
class ChunkMetadata(ServerEvent):
    """Describes the binary frame that follows it at once (``kind: "media"``); over WebRTC
    (``kind: "rtp"``) it is a status message and the frames travel on the video track."""

    type: ClassVar[str] = "video.chunk_metadata"
    request_id: str
    chunk_index: int  # generation chunk index (where interactions land)
    transport_chunk_index: int  # binary frames sent so far in this request
    frame_count: int
    byte_length: int
    format: str
    fps: float
    pts_ms: float  # presentation time of the chunk's first frame in the stream
    mime_type: str
    kind: str = "media"
    frame_byte_lengths: list[int] | None = None  # jpeg: where each JPEG ends
    init_byte_length: int | None = None  # m4s: leading init segment bytes (first chunk)
    queue_depth: int | None = None  # rtp: frames waiting in the track when the chunk was queued
    # vLLM-Omni's interaction progress: ids whose change begins with this chunk, is still in
    # transition after it, ends with it. Our world engines apply an interaction whole at the
    # chunk it lands on (no blend over `transition_chunks`), so an id starts and completes on
    # the same chunk and `active_event_ids` stays empty.
    started_event_ids: list[str] = field(default_factory=list)
    active_event_ids: list[str] = field(default_factory=list)
    completed_event_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        body = ServerEvent.to_dict(self)  # slots=True dataclasses break zero-argument super()
        # vLLM-Omni's names for the same numbers, so its example client works unchanged.
        body["generation_chunk_index"] = self.chunk_index
        body["num_frames"] = self.frame_count
        return body


@dataclass(slots=True)
class InteractionQueued(ServerEvent):
    type: ClassVar[str] = "session.interaction.queued"
    request_id: str
    event_id: str
    applies_at_chunk: int


@dataclass(slots=True)
class InteractionApplied(ServerEvent):
    """Sent right before the metadata of the first chunk the interactions shaped."""

    type: ClassVar[str] = "session.interaction.applied"
    request_id: str
    chunk_index: int
    event_ids: list[str]
    latency_ms: float  # oldest of these interactions: queued → its chunk going out


@dataclass(slots=True)
class SessionPong(ServerEvent):
    type: ClassVar[str] = "session.pong"


@dataclass(slots=True)
class SessionDone(ServerEvent):
    type: ClassVar[str] = "session.done"
    request_id: str
    chunks: int
    frames: int
    stopped: bool
    reason: str  # completed | stopped | failed | client_stalled | closed


@dataclass(slots=True)
class ErrorEvent(ServerEvent):
    type: ClassVar[str] = "error"
    code: str
    message: str
    event_id: str | None = None
    request_id: str | None = None


@dataclass(slots=True)
class SessionResumable(ServerEvent):
    """Hosted sessions (session/world/hosting.py), first event of a new connection: how to
    resume this session after a dropped connection. The token is shown once."""

    type: ClassVar[str] = "omni.session.resumable"
    session_id: str
    resume_token: str
    expires_at: int


@dataclass(slots=True)
class SessionResumed(ServerEvent):
    """First event of a resuming connection: where the running world is. Chunks continue
    from ``chunk_index`` (the next chunk this client gets); ``request_id`` and ``config``
    are those of ``video.start`` (absent when no world is generating)."""

    type: ClassVar[str] = "omni.session.resumed"
    session_id: str
    phase: str
    chunk_index: int
    chunks_sent: int
    request_id: str | None = None
    format: str | None = None
    config: dict[str, Any] | None = None
