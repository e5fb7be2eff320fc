"""Wire vocabulary of ``/v1/realtime/video`` (vLLM-Omni's streaming video protocol, extended
with actions): typed client events in, typed server events out, and the error codes.

Client (JSON text frames): ``session.start``, ``session.interaction``, ``session.stop``,
``session.ping``. Server: ``video.start``, ``video.chunk_metadata`` (each one immediately
followed by one binary frame), ``session.interaction.queued``, ``session.interaction.applied``,
``session.pong``, ``session.done``, ``error``.

Client events are pydantic models, a discriminated union on ``type``, validated after
:mod:`session.json_guard` has bounded the frame's depth; a refused event is a
:class:`ProtocolError` with the protocol's code and message (not pydantic's wording).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from session import json_text
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
# pydantic models, one per ``type`` (a discriminated union). Each check raises one custom error
# kind whose context carries the code and message the client gets (read back by
# :func:`_protocol_error`), so the wording is the protocol's, not pydantic's.

_REJECTED = "world_event"
_EVENT_TYPES = "session.start, session.interaction, session.stop, session.ping"


def _reject(code: str, message: str, *, with_event_id: bool = False) -> PydanticCustomError:
    context = {"code": code, "message": message, "with_event_id": with_event_id}
    return PydanticCustomError(_REJECTED, "{message}", context)


def _of_type(name: str, kinds: type | tuple[type, ...], value: Any) -> Any:
    """``value`` if it is one of ``kinds`` (a boolean only where bool is one of them)."""
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise _reject(ErrorCode.INVALID_EVENT, f"{name}: expected {kinds}, got a boolean")
    if not isinstance(value, kinds):
        raise _reject(ErrorCode.INVALID_EVENT, f"{name}: expected {kinds}, got {type(value).__name__}")
    return value


def _typed(name: str, kinds: type | tuple[type, ...], convert: Callable[[Any], Any] | None = None) -> Any:
    """A field validator: :func:`_of_type`, then ``convert``."""

    def check(value: Any) -> Any:
        value = _of_type(name, kinds, value)
        return value if convert is None else convert(value)

    return PlainValidator(check)


def _model_name(value: Any) -> str:
    if not _of_type("model", str, value):
        raise _reject(ErrorCode.INVALID_EVENT, "session.start needs a model")
    return str(value)


def _action_kind(kind: Any) -> KeyEventKind:
    if kind not in ("keydown", "keyup"):
        message = f"action.event must be 'keydown' or 'keyup', got {kind!r}"
        raise _reject(ErrorCode.INVALID_ACTION, message, with_event_id=True)
    return cast(KeyEventKind, kind)


def _action_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > 32:
        message = f"action.key must be a key name, got {key!r}"
        raise _reject(ErrorCode.INVALID_ACTION, message, with_event_id=True)
    return key


def _action_time(t_ms: Any) -> float:
    if isinstance(t_ms, bool) or not isinstance(t_ms, int | float):
        raise _reject(ErrorCode.INVALID_ACTION, "action.t_ms must be a number", with_event_id=True)
    return float(t_ms)


def _action_list(value: Any, info: ValidationInfo) -> Any:
    value = _of_type("actions", list, value)
    max_actions: int = (info.context or {}).get("max_actions", 64)
    if len(value) > max_actions:
        message = f"at most {max_actions} actions per interaction"
        raise _reject(ErrorCode.INVALID_ACTION, message, with_event_id=True)
    return value


class _WireModel(BaseModel):
    """A JSON object from the client: unknown keys are ignored, ``null`` is an absent key."""

    model_config = ConfigDict(frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in cls.unnest(data).items() if value is not None}

    @classmethod
    def unnest(cls, data: dict[str, Any]) -> dict[str, Any]:
        return data


@dataclass(slots=True, frozen=True)
class KeyEvent:
    event: KeyEventKind
    key: str
    t_ms: float | None = None


class KeyAction(_WireModel):
    """One key action of a ``session.interaction`` (the held-keys state takes :class:`KeyEvent`)."""

    event: Annotated[KeyEventKind, PlainValidator(_action_kind)] = Field(None, validate_default=True)
    key: Annotated[str, PlainValidator(_action_key)] = Field(None, validate_default=True)
    t_ms: Annotated[float | None, PlainValidator(_action_time)] = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            message = "an action is an object {event, key, t_ms?}"
            raise _reject(ErrorCode.INVALID_ACTION, message, with_event_id=True)
        return raw


class SessionStart(_WireModel):
    # Fields in the order they are checked: the first wrong one is the one reported.
    type: Literal["session.start"] = "session.start"
    model: Annotated[str, PlainValidator(_model_name)] = Field("", validate_default=True)
    fps: Annotated[float | None, _typed("fps", (int, float), float)] = None
    prompt: Annotated[str, _typed("prompt", str)] = ""
    format: Annotated[str, _typed("format", str)] = "jpeg"
    width: Annotated[int | None, _typed("width", int)] = None
    height: Annotated[int | None, _typed("height", int)] = None
    num_frames: Annotated[int | None, _typed("num_frames", int)] = None
    seed: Annotated[int | None, _typed("seed", int)] = None
    extra_params: Annotated[dict[str, Any], _typed("extra_params", dict, dict)] = Field(default_factory=dict)


class SessionInteraction(_WireModel):
    type: Literal["session.interaction"] = "session.interaction"
    event_id: Annotated[str | None, _typed("event_id", str)] = None
    prompt: Annotated[str | None, _typed("prompt", str)] = None
    actions: Annotated[tuple[KeyAction, ...], BeforeValidator(_action_list)] = ()

    @classmethod
    def unnest(cls, data: dict[str, Any]) -> dict[str, Any]:
        """vLLM-Omni nests the update: ``{"interaction": {"event_id": ..., "event": {...}}}``."""
        nested = data.get("interaction")
        if not isinstance(nested, dict):
            return data
        body = nested.get("event") or {}
        if not isinstance(body, dict):
            raise _reject(ErrorCode.INVALID_EVENT, "interaction.event: expected an object")
        return {"event_id": nested.get("event_id"), **body}

    @model_validator(mode="after")
    def _says_something(self) -> SessionInteraction:
        if self.prompt is None and not self.actions:
            message = "session.interaction needs a prompt or actions"
            raise _reject(ErrorCode.INVALID_EVENT, message, with_event_id=True)
        return self


class SessionStop(_WireModel):
    type: Literal["session.stop"] = "session.stop"


class SessionPing(_WireModel):
    type: Literal["session.ping"] = "session.ping"


ClientEvent = SessionStart | SessionInteraction | SessionStop | SessionPing
_CLIENT_EVENT: TypeAdapter[ClientEvent] = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])


def parse_client_event(text: str, *, max_actions: int = 64) -> ClientEvent:
    """One JSON text frame → a typed event, or :class:`ProtocolError` saying what is wrong."""
    try:  # depth and Unicode checked too: nothing deeper than 64 levels reaches a world
        data = loads_checked(text)
    except JsonRejected as exc:
        code = ErrorCode.INVALID_JSON if exc.code == "invalid_json" else ErrorCode.INVALID_PARAMETER
        raise ProtocolError(code, exc.message) from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_JSON, "an event is a JSON object")
    try:
        return _CLIENT_EVENT.validate_python(data, context={"max_actions": max_actions})
    except ValidationError as exc:
        raise _protocol_error(exc, data) from None


def _protocol_error(exc: ValidationError, data: dict[str, Any]) -> ProtocolError:
    """The first error pydantic found (fields are checked in declaration order)."""
    error = exc.errors(include_url=False)[0]
    ctx = error.get("ctx") or {}
    if error["type"] == _REJECTED:
        event_id = None
        if ctx.get("with_event_id"):
            body = SessionInteraction.unnest(data)
            event_id = body["event_id"] if isinstance(body.get("event_id"), str) else None
        return ProtocolError(ctx["code"], ctx["message"], event_id=event_id)
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        message = f"unknown event type {data.get('type')!r} (expected {_EVENT_TYPES})"
        return ProtocolError(ErrorCode.INVALID_EVENT, message)
    where = ".".join(str(part) for part in error["loc"][1:])  # not reached by the models above
    return ProtocolError(ErrorCode.INVALID_EVENT, f"{where}: {error['msg']}")


# ----------------------------------------------------------------------------- server events


@dataclass(slots=True)
class ServerEvent:
    type: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if v is not None}
        return {"type": self.type, **body}

    def to_json(self) -> str:
        return json_text.dumps(self.to_dict())


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
