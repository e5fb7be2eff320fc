"""Session fields a client sets and the server echoes back in `session.created` / `.updated`:
tools, tool_choice, tracing, truncation, prompt.

They reach the client again, so each must be exactly a shape the official SDK parses: a value
it cannot parse (a tool `name` that is a number, a `tracing` list) made every later
`session.updated` fail the client's validation. Each is checked here against the GA shape
(unknown keys refused, as everywhere else) and refused with `invalid_value` before it can
become session state.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from session.realtime.validation import WireModel


class FunctionTool(WireModel):
    type: Literal["function"] = "function"
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class McpTool(WireModel):
    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    server_description: str | None = None
    authorization: str | None = None
    headers: dict[str, str] | None = None
    allowed_tools: list[str] | None = None
    require_approval: Literal["always", "never"] | None = None


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class McpChoice(WireModel):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


class Tracing(WireModel):
    workflow_name: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] | None = None


class TokenLimits(WireModel):
    post_instructions: Annotated[int, Field(ge=0)] | None = None


class RetentionRatio(WireModel):
    type: Literal["retention_ratio"]
    retention_ratio: Annotated[float, Field(ge=0.0, le=1.0)]
    token_limits: TokenLimits | None = None


class Prompt(WireModel):
    id: str
    version: str | None = None
    variables: dict[str, str] | None = None


def _shape(model: type[WireModel], value: Any, what: str) -> dict[str, Any]:
    try:
        return model.model_validate(value).model_dump(exclude_none=True)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"{what}: {where + ': ' if where else ''}{first.get('msg')}") from None


def check_tools(value: Any) -> Any:
    if not isinstance(value, list):
        raise ValueError("expected a list of tools")
    out = []
    for tool in value:
        if not isinstance(tool, dict) or tool.get("type", "function") not in ("function", "mcp"):
            raise ValueError("each tool must be an object with type 'function' or 'mcp'")
        out.append(_shape(McpTool if tool.get("type") == "mcp" else FunctionTool, tool, "tool"))
    return out


def check_tool_choice(value: Any) -> Any:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") in ("function", "mcp"):
        return _shape(McpChoice if value["type"] == "mcp" else FunctionChoice, value, "tool_choice")
    raise ValueError("expected 'auto', 'none', 'required' or a {type: function|mcp, ...} object")


def check_tracing(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if isinstance(value, dict):
        return _shape(Tracing, value, "tracing")
    raise ValueError("expected 'auto' or {workflow_name, group_id, metadata}")


def check_truncation(value: Any) -> Any:
    if value is None or value in ("auto", "disabled"):
        return value
    if isinstance(value, dict):
        return _shape(RetentionRatio, value, "truncation")
    raise ValueError("expected 'auto', 'disabled' or {type: 'retention_ratio', retention_ratio}")


def check_prompt(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, dict):
        return _shape(Prompt, value, "prompt")
    raise ValueError("expected {id, version, variables}")
