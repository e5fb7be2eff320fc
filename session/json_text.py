"""Compact JSON text on the per-event paths: orjson where it can, the ``json`` module where not.

A few hundred sessions make tens of thousands of JSON texts a second (every logged server
event is serialized once, for the log and the wire; every client event is parsed). orjson
does either in a fraction of the ``json`` module's time, but it is stricter about what it
takes: integers past 64 bits, ``NaN``, lone surrogates (``"\\ud800"``), non-string keys,
non-UTF-8 bytes. What it refuses goes through the ``json`` module instead, so what is
accepted, what is refused and with which error stay exactly the ``json`` module's; only the
text differs, in ways JSON does not care about (UTF-8 instead of ``\\u`` escapes for
non-ASCII characters, ``null`` instead of the invalid ``NaN``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "loads"]


def dumps(value: Any) -> str:
    """``json.dumps(value, separators=(",", ":"))``, in orjson when it can encode ``value``."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is one: a type, key or string it does not take
        return json.dumps(value, separators=(",", ":"))


def loads(raw: str | bytes) -> Any:
    """``json.loads(raw)``: what orjson refuses is parsed (or refused) by ``json``."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
