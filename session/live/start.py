"""What a ``session.start`` must satisfy before a GPT-Live session starts (all of it fixed for
the session's life): the model, the text it brings (bytes and items), the delegation target."""

from __future__ import annotations

from session.live import events as ev
from session.live.events import DelegationTarget, LiveLimits, LiveProtocolError, SessionStart


def check_start(
    event: SessionStart, *, pipeline: str, targets: frozenset[DelegationTarget], limits: LiveLimits
) -> tuple[DelegationTarget, int]:
    """The session's delegation target and the bytes of text it starts with; raises
    :class:`LiveProtocolError` with the code of what is refused."""
    config = event.config
    eid = event.event_id
    if config.model != pipeline and not config.model.startswith("gpt-live"):
        raise LiveProtocolError(
            ev.MODEL_NOT_FOUND,
            f"The model '{config.model[:64]}' is not served here; this server's duplex model is "
            f"'{pipeline}' (gpt-live names are taken as it).",
            param="session.model",
            event_id=eid,
        )
    instructions = len(config.instructions.encode())
    if instructions > limits.max_instructions_bytes:
        raise LiveProtocolError(
            ev.TEXT_TOO_LARGE,
            f"session.instructions may be at most {limits.max_instructions_bytes} bytes.",
            param="session.instructions",
            event_id=eid,
        )
    if len(config.history) > limits.max_input_items:
        raise LiveProtocolError(
            ev.INVALID_VALUE,
            f"session.input may hold at most {limits.max_input_items} items.",
            param="session.input",
            event_id=eid,
        )
    size = instructions + sum(len(item.text.encode()) for item in config.history)
    if size > limits.max_context_bytes:
        raise LiveProtocolError(
            ev.CONTEXT_FULL,
            f"session.instructions and session.input may hold at most {limits.max_context_bytes} "
            "bytes together.",
            param="session.input",
            event_id=eid,
        )
    target = config.delegation or ("responses" if "responses" in targets else "client")
    if target not in targets:
        raise LiveProtocolError(
            ev.DELEGATION_UNAVAILABLE,
            f"The pipeline '{pipeline}' has no text model stage to run 'responses' delegation; "
            'start the session with delegation {"type": "client"}.',
            param="session.delegation.type",
            event_id=eid,
        )
    return target, size
