"""Turn pydantic validation errors into OpenAI-style protocol errors with a dotted `param`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from session.realtime.errors import INVALID_VALUE, MISSING_PARAMETER, UNKNOWN_PARAMETER, ProtocolError, clip

# Tag values pydantic puts into error locations of discriminated unions; they are not fields.
_UNION_TAGS = frozenset(
    {
        "server_vad",
        "semantic_vad",
        "message",
        "function_call",
        "function_call_output",
        "item_reference",
        "function",
        "mcp",
        "user",
        "assistant",
        "system",
    }
)
_TYPE_NAMES = frozenset({"int", "str", "float", "bool", "none", "dict", "list", "literal"})


class WireModel(BaseModel):
    """Base of client-sent models: unknown fields are errors (`unknown_parameter`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def format_param(loc: Sequence[int | str], prefix: str = "") -> str:
    """`("item", "content", 0, "type")` → `item.content[0].type` (union bookkeeping dropped)."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if part in _UNION_TAGS or part in _TYPE_NAMES or "[" in part or "-" in part:
            continue
        out = f"{out}.{part}" if out else part
    return out


def protocol_error_from(exc: ValidationError, prefix: str = "") -> ProtocolError:
    """The first validation problem, as a `ProtocolError` the client can act on."""
    err: dict[str, Any] = dict(exc.errors(include_url=False)[0])
    param = format_param(err.get("loc", ()), prefix)
    kind = err.get("type", "")
    if kind == "missing":
        return ProtocolError(MISSING_PARAMETER, f"Missing required parameter: '{param}'.", param=param)
    if kind == "extra_forbidden":
        return ProtocolError(UNKNOWN_PARAMETER, f"Unknown parameter: '{param}'.", param=param)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        param = f"{param}.type" if param else "type"
        if kind == "union_tag_not_found":
            return ProtocolError(MISSING_PARAMETER, f"Missing required parameter: '{param}'.", param=param)
        tag = err.get("ctx", {}).get("tag")
        expected = err.get("ctx", {}).get("expected_tags", "")
        return ProtocolError(
            INVALID_VALUE,
            f"Invalid value: '{tag}'. Supported values are: {expected}.",
            param=param,
        )
    got = err.get("input")
    plain = isinstance(got, str | int | float | bool) or got is None
    shown = clip(repr(got)) if plain else type(got).__name__
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return ProtocolError(INVALID_VALUE, f"Invalid value for '{param}': {shown} ({msg}).", param=param)
