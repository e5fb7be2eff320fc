"""JSON from clients, checked at parse time: nesting depth and Unicode scalar values.

Python's ``json`` accepts two things the rest of the server cannot keep:

* deep nesting. A 4 KB frame nested ~1,000 levels makes the C scanner raise
  ``RecursionError`` (not ``ValueError``), and ~600 levels parse but break ``copy.deepcopy``
  and pydantic later, after the value was applied to a session's config. Refused here, so
  nothing deeper than :data:`MAX_JSON_DEPTH` ever reaches session state;
* lone surrogates. ``"\\ud800"`` is legal JSON but not a Unicode scalar value: it cannot be
  encoded as UTF-8, so Redis (and any UTF-8 writer) fails on it later, far from the client.

Every endpoint that parses client JSON (the realtime and video WebSockets, the WebRTC
``session`` part, ``client_secrets``) goes through :func:`loads_checked`, which raises
:class:`JsonRejected` with a code the caller turns into its own error shape. The check is one
iterative walk over the decoded value; a surrogate can only sit in a string that is not
ASCII, and ``str.isascii`` costs nothing (CPython keeps it as a flag), so the walk runs the
surrogate search only on such strings. Parsing is :func:`session.json_text.loads` (orjson,
with the ``json`` module for what orjson refuses: lone surrogates among it).
"""

from __future__ import annotations

import re
from typing import Any, Final

from session import json_text

MAX_JSON_DEPTH: Final = 64  # containers inside containers; tool schemas need far fewer
INVALID_JSON: Final = "invalid_json"
INVALID_STRING: Final = "invalid_value"

_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonRejected(ValueError):
    """Client JSON the server will not take; ``code`` is ``invalid_json`` (syntax, depth) or
    ``invalid_value`` (a string that is not valid Unicode), ``param`` the dotted path."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def loads_checked(raw: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that refuses what :func:`check_value` refuses, with :class:`JsonRejected`."""
    data = parse_json(raw, max_depth=max_depth)
    check_value(data, max_depth=max_depth)
    return data


def parse_json(raw: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads``, with its syntax errors and its ``RecursionError`` as :class:`JsonRejected`."""
    try:
        return json_text.loads(raw)
    except RecursionError:
        raise JsonRejected(INVALID_JSON, f"The JSON is nested deeper than {max_depth} levels.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonRejected(INVALID_JSON, f"The JSON is not valid: {exc}.") from None


def check_value(data: Any, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`JsonRejected` if ``data`` nests deeper than ``max_depth`` or holds a key or
    string that is not made of Unicode scalar values."""
    if max_depth > 0 and type(data) is dict and _flat_ascii(data):  # an audio append: nothing to find
        return
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise _bad_string(path)
            continue
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        if depth >= max_depth:
            raise JsonRejected(
                INVALID_JSON, f"The JSON is nested deeper than {max_depth} levels.", _dotted(path) or None
            )
        for key, item in items:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise _bad_string((*path, key))
            if isinstance(item, dict | list | str):
                stack.append((item, depth + 1, (*path, key)))


def _flat_ascii(data: dict[str, Any]) -> bool:
    """Every value a string and every key and string ASCII: nothing nests, nothing can hold a
    surrogate (an audio append, 25 a second per session, skips the walk)."""
    for key, value in data.items():
        if type(value) is not str or not value.isascii() or not key.isascii():
            return False
    return True


def _bad_string(path: tuple[str | int, ...]) -> JsonRejected:
    param = _dotted(path)
    where = f" in '{param}'" if param else ""
    return JsonRejected(
        INVALID_STRING,
        f"Invalid value{where}: the string is not valid Unicode (a lone surrogate such as \\ud800).",
        param or None,
    )


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = _SURROGATE.sub("\ufffd", part)  # the error event must itself be encodable
            out = f"{out}.{part}" if out else part
    return out
