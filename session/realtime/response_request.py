"""`response.create{response}` parameters resolved against the session config."""

from __future__ import annotations

from dataclasses import dataclass

from session.realtime.config import SessionConfig, format_of, normalize_modalities
from session.realtime.conversation import Conversation, Item
from session.realtime.errors import INVALID_VALUE, ProtocolError
from session.realtime.events import ItemReferenceIn, ResponseParamsIn
from session.realtime.ids import IdFactory
from session.realtime.prompt import item_from_client
from session.realtime.responses import ResponseSettings


@dataclass(slots=True)
class ResponseRequest:
    settings: ResponseSettings
    instructions: str
    items: list[Item]  # the context the response answers (conversation, or `response.input`)


def resolve_response_request(
    p: ResponseParamsIn | None,
    *,
    config: SessionConfig,
    conversation: Conversation,
    new_id: IdFactory,
    frame_ms: int,
    via_track: bool,
) -> ResponseRequest:
    """Per-response overrides on top of the session config; raises `ProtocolError`."""
    cfg = config
    fields = p.model_fields_set if p is not None else set()
    modalities = cfg.output_modalities
    if p is not None and p.output_modalities is not None:
        modalities = normalize_modalities(p.output_modalities, "response.output_modalities")
    where = p.conversation if p is not None and p.conversation is not None else "auto"
    if where not in ("auto", "none"):
        raise ProtocolError(
            INVALID_VALUE,
            f"Invalid value: '{where}'. Supported values are: 'auto' and 'none'.",
            param="response.conversation",
        )
    items = conversation.items
    if p is not None and p.input is not None:
        items = []
        for k, data in enumerate(p.input):
            if isinstance(data, ItemReferenceIn):
                items.append(conversation.get(data.id, param=f"response.input[{k}].id"))
            else:
                items.append(
                    item_from_client(
                        data,
                        new_id=new_id,
                        input_format=cfg.input_format,
                        output_format=cfg.output_format,
                        param=f"response.input[{k}]",
                    )
                )
    output_format, voice = cfg.output_format, cfg.voice
    if p is not None and p.audio is not None and p.audio.output is not None:
        if p.audio.output.format is not None:
            output_format = format_of(p.audio.output.format)
        voice = p.audio.output.voice or voice
    instructions = p.instructions if p is not None and p.instructions is not None else cfg.instructions
    max_tokens = (
        p.max_output_tokens if p is not None and "max_output_tokens" in fields else cfg.max_output_tokens
    )
    settings = ResponseSettings(
        modalities=list(modalities),
        output_format=output_format,
        voice=voice,
        max_output_tokens=max_tokens if max_tokens is not None else "inf",
        metadata=p.metadata if p is not None else None,
        in_conversation=where == "auto",
        frame_ms=frame_ms,
        via_track=via_track,
    )
    return ResponseRequest(settings=settings, instructions=instructions, items=items)
