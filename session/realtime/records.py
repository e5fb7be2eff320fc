"""What of a session the store keeps, and how a core is rebuilt from it.

The core's state that must outlive a process is the session config and the conversation:
items with their transcripts (and ASR text heard for history), never their audio. These
functions turn them into JSON-ready records for the store and back. The core reports what
changed since the last call as :class:`StateChanges` (`take_state_changes`), so the driver
persists item boundaries (added, done, truncated, transcribed, deleted) and config updates,
never per-delta progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from session.realtime.config import SessionConfig, SessionIn
from session.realtime.conversation import Content, Item

# Fields of the GA session object that describe the session rather than configure it.
_READ_ONLY = ("id", "object", "expires_at")


@dataclass(slots=True)
class StateChanges:
    """Durable state changed by one or more core calls, in the order to apply them."""

    deletes: list[str] = field(default_factory=list)
    # (item record, previous item id: "root" for first) in conversation order
    upserts: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    config: dict[str, Any] | None = None  # `config_record(...)` when the config changed
    # The response in progress ({"id", "audio"}; None: none) when that changed. Stored at
    # `response.created`, before the response has an output item, so a process that dies
    # before the first output still leaves a trace: the restored session ends it.
    open_response: dict[str, Any] | None = None
    open_response_changed: bool = False


def config_record(
    config: SessionConfig, *, session_id: str, expires_at: int, conversation_id: str
) -> dict[str, Any]:
    """The session's stored config: the GA session object and the conversation id."""
    return {
        "session": config.to_wire(session_id=session_id, expires_at=expires_at),
        "conversation_id": conversation_id,
    }


def config_from_record(record: dict[str, Any], *, default_model: str) -> SessionConfig:
    """Rebuild a `SessionConfig` from `config_record` output (the session object replays as
    a `session.update` onto defaults, so the same validation applies)."""
    session = {k: v for k, v in dict(record.get("session") or {}).items() if k not in _READ_ONLY}
    session.setdefault("type", "realtime")
    return SessionConfig(model=default_model).apply_update(SessionIn.model_validate(session))


def item_to_record(item: Item) -> dict[str, Any]:
    """The wire item (no audio) plus what the core needs to rebuild it: the ASR text heard
    for history, the assistant audio's duration and the producing response."""
    record = item.to_wire()
    if item.response_id is not None:
        record["response_id"] = item.response_id
    for part, wire in zip(item.content, record.get("content", []), strict=False):
        if part.heard and part.heard != part.transcript:
            wire["heard"] = part.heard
        if part.type == "output_audio" and (part.has_audio or part.dropped_ms is not None):
            wire["audio_ms"] = round(part.output_audio_ms())
        if part.truncated:
            wire["truncated"] = True
    return record


def item_from_record(record: dict[str, Any]) -> Item:
    """An `Item` from `item_to_record` output. Audio is not stored, so restored items carry
    none: their transcripts stand in for it in the history of later responses."""
    content = [
        Content(
            type=str(c["type"]),
            text=c.get("text"),
            transcript=c.get("transcript"),
            heard=c.get("heard"),
            image_url=c.get("image_url"),
            detail=c.get("detail"),
            truncated=bool(c.get("truncated", False)),
            # the audio is gone, as if dropped by retention; its length still bounds truncate
            dropped_ms=float(c["audio_ms"]) if isinstance(c.get("audio_ms"), int | float) else None,
        )
        for c in record.get("content", [])
    ]
    return Item(
        id=str(record["id"]),
        type=record["type"],
        role=record.get("role"),
        status=record.get("status", "completed"),
        content=content,
        name=record.get("name"),
        arguments=record.get("arguments"),
        call_id=record.get("call_id"),
        output=record.get("output"),
        response_id=record.get("response_id"),
    )
