"""Typed client events of the OpenAI Realtime API (GA) and their parsing.

`parse_client_event(raw)` returns one of the 11 event models or raises `ProtocolError` with
the code a client can act on (`invalid_json`, `invalid_event`, `missing_required_parameter`,
`unknown_parameter`, `invalid_value`) and the dotted `param`; the client's `event_id`, when
one could be read, is set on the error so it can be echoed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from session.json_guard import JsonRejected, check_value, parse_json
from session.realtime.config import AudioFormatIn, MaxTokens, Modality, SessionIn, ToolChoice, Tools, Voice
from session.realtime.errors import (
    INVALID_EVENT,
    INVALID_JSON,
    INVALID_VALUE,
    MISSING_PARAMETER,
    ProtocolError,
    clip,
)
from session.realtime.validation import WireModel, protocol_error_from

ItemStatus = Literal["completed", "incomplete", "in_progress"]
ContentType = Literal["input_text", "input_audio", "input_image", "output_text", "output_audio", "text"]


# --- conversation items (as a client sends them) -----------------------------------------


class ContentIn(WireModel):
    type: ContentType
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ItemFieldsIn(WireModel):
    """What every kind of item a client sends may carry besides its own fields."""

    id: str | None = None
    object: Literal["realtime.item"] | None = None
    status: ItemStatus | None = None


class MessageItemIn(ItemFieldsIn):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentIn]


class FunctionCallItemIn(ItemFieldsIn):
    type: Literal["function_call"]
    name: str
    arguments: str
    call_id: str | None = None


class FunctionCallOutputItemIn(ItemFieldsIn):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ItemReferenceIn(WireModel):
    """Only inside `response.create{response.input}`: a reference to an existing item."""

    type: Literal["item_reference"]
    id: str


ItemIn = Annotated[MessageItemIn | FunctionCallItemIn | FunctionCallOutputItemIn, Field(discriminator="type")]
ResponseInputIn = Annotated[
    MessageItemIn | FunctionCallItemIn | FunctionCallOutputItemIn | ItemReferenceIn,
    Field(discriminator="type"),
]


# --- response.create parameters ----------------------------------------------------------


class ResponseAudioOutputIn(WireModel):
    format: AudioFormatIn | None = None
    voice: Voice = None


class ResponseAudioIn(WireModel):
    output: ResponseAudioOutputIn | None = None


class ResponseParamsIn(WireModel):
    audio: ResponseAudioIn | None = None
    conversation: str | None = None
    input: list[ResponseInputIn] | None = None
    instructions: str | None = None
    max_output_tokens: MaxTokens = None
    metadata: dict[str, str] | None = None
    output_modalities: list[Modality] | None = None
    parallel_tool_calls: bool | None = None
    prompt: Any = None
    reasoning: Any = None
    tool_choice: ToolChoice = None
    tools: Tools = None


# --- the 11 client events ----------------------------------------------------------------


class _ClientEvent(WireModel):
    event_id: str | None = None


class SessionUpdate(_ClientEvent):
    type: Literal["session.update"]
    session: SessionIn


class InputAudioBufferAppend(_ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class InputAudioBufferCommit(_ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class InputAudioBufferClear(_ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class OutputAudioBufferClear(_ClientEvent):
    type: Literal["output_audio_buffer.clear"]


class ConversationItemCreate(_ClientEvent):
    type: Literal["conversation.item.create"]
    item: ItemIn
    previous_item_id: str | None = None


class ConversationItemRetrieve(_ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ConversationItemDelete(_ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ConversationItemTruncate(_ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: Annotated[int, Field(ge=0)]
    audio_end_ms: Annotated[int, Field(ge=0)]


class ResponseCreate(_ClientEvent):
    type: Literal["response.create"]
    response: ResponseParamsIn | None = None


class ResponseCancel(_ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | InputAudioBufferAppend
    | InputAudioBufferCommit
    | InputAudioBufferClear
    | OutputAudioBufferClear
    | ConversationItemCreate
    | ConversationItemRetrieve
    | ConversationItemDelete
    | ConversationItemTruncate
    | ResponseCreate
    | ResponseCancel
)

CLIENT_EVENT_TYPES: dict[str, type[_ClientEvent]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": InputAudioBufferAppend,
    "input_audio_buffer.commit": InputAudioBufferCommit,
    "input_audio_buffer.clear": InputAudioBufferClear,
    "output_audio_buffer.clear": OutputAudioBufferClear,
    "conversation.item.create": ConversationItemCreate,
    "conversation.item.retrieve": ConversationItemRetrieve,
    "conversation.item.delete": ConversationItemDelete,
    "conversation.item.truncate": ConversationItemTruncate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}


def decode_event(raw: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """Raw JSON text (or an already decoded dict) → the event object; raises `ProtocolError`
    (`invalid_json`, `invalid_event`) when it is not a JSON object, and `invalid_json` /
    `invalid_value` for what no session may keep: nesting deeper than 64 levels, or a string
    that is not valid Unicode (session/json_guard.py)."""
    data: Any
    try:
        data = raw if isinstance(raw, dict) else parse_json(raw)
    except JsonRejected as exc:
        raise ProtocolError(INVALID_JSON, exc.message) from None
    try:
        check_value(data)
    except JsonRejected as exc:
        err = ProtocolError(
            INVALID_JSON if exc.code == INVALID_JSON else INVALID_VALUE, exc.message, param=exc.param
        )
        if isinstance(data, dict) and isinstance(data.get("event_id"), str):
            err.event_id = data["event_id"]
        raise err from None
    if not isinstance(data, dict):
        raise ProtocolError(INVALID_EVENT, "An event must be a JSON object with a 'type'.")
    return data


_APPEND_KEYS = frozenset({"type", "audio", "event_id"})


def append_audio(data: dict[str, Any]) -> str | None:
    """The `audio` of a well-formed `input_audio_buffer.append`, checked by hand; None for
    any other event or any deviation (the caller then validates with the model, which gives
    the usual error). The hot path: 25 appends a second per session, and the model costs
    several times this check."""
    if data.get("type") != "input_audio_buffer.append" or not data.keys() <= _APPEND_KEYS:
        return None
    audio = data.get("audio")
    event_id = data.get("event_id")
    if type(audio) is not str or not (event_id is None or type(event_id) is str):
        return None
    return audio


def parse_client_event(raw: str | bytes | dict[str, Any]) -> ClientEvent:
    """Decode and validate one client event; raises `ProtocolError` (with `event_id` set)."""
    data = decode_event(raw)
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    try:
        return _validate(data)
    except ProtocolError as err:
        err.event_id = event_id
        raise


def _validate(data: dict[str, Any]) -> ClientEvent:
    kind = data.get("type")
    if kind is None:
        raise ProtocolError(MISSING_PARAMETER, "Missing required parameter: 'type'.", param="type")
    model = CLIENT_EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        supported = ", ".join(f"'{name}'" for name in CLIENT_EVENT_TYPES)
        raise ProtocolError(
            INVALID_EVENT,
            f"Invalid value: '{clip(str(kind))}'. Supported values are: {supported}.",
            param="type",
        )
    try:
        event: ClientEvent = model.model_validate(data)  # type: ignore[assignment]
    except ValidationError as exc:
        raise protocol_error_from(exc) from None
    return event
