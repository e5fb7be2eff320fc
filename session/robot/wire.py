"""openpi's msgpack-numpy wire, sans-I/O: bytes in, checked Python values out, and back.

An array travels as ``{b"__ndarray__": True, b"data": bytes, b"dtype": str, b"shape": [...]}``
and a numpy scalar as ``{b"__npgeneric__": True, b"data": item, b"dtype": str}`` (openpi's
``openpi_client/msgpack_numpy.py``). Decoding here is stricter than openpi's own, because the
bytes come from the network: the dtype string must parse, its kind must not be object (``O``),
void/structured (``V``) or complex (``c``), the shape must be a list of non-negative ints whose
product times the item size equals the data length exactly, and arrays come out read-only
views of the received buffer (no copy). Anything else raises :class:`WireError` with a message
that says what was expected and what came. Nothing here touches a socket.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # vLLM-Omni's cap on one observation frame
MAX_DIMS = 8
REFUSED_KINDS = {"O": "object", "V": "void/structured", "c": "complex"}


def _msgpack() -> ModuleType:
    """msgpack, imported at the first robot frame rather than with the app: a server (or a test
    environment) that never serves a robot does not need it."""
    import msgpack

    return msgpack


class WireError(ValueError):
    """A frame that is not a valid openpi message; ``code`` names the kind of problem."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _dtype(raw: Any) -> np.dtype[Any]:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", errors="replace")
    if not isinstance(raw, str):
        raise WireError("invalid_array", f"array dtype must be a string, got {type(raw).__name__}")
    try:
        dtype = np.dtype(raw)
    except (TypeError, ValueError) as exc:
        raise WireError("invalid_array", f"unknown array dtype {raw!r}") from exc
    if dtype.kind in REFUSED_KINDS:
        raise WireError(
            "unsupported_dtype", f"unsupported dtype {raw!r}: {REFUSED_KINDS[dtype.kind]} arrays are refused"
        )
    return dtype


def _array(obj: dict[Any, Any]) -> np.ndarray:
    dtype = _dtype(obj.get(b"dtype"))
    data = obj.get(b"data")
    if not isinstance(data, bytes):
        raise WireError("invalid_array", "array data must be bytes")
    shape = obj.get(b"shape")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_DIMS:
        raise WireError("invalid_array", f"array shape must be a list of at most {MAX_DIMS} ints")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError("invalid_array", f"array shape must hold non-negative ints, got {list(shape)!r}")
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(data):
        raise WireError(
            "invalid_array",
            f"array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes, got {len(data)}",
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)  # read-only: a view of the frame


def _generic(obj: dict[Any, Any]) -> np.generic:
    dtype = _dtype(obj.get(b"dtype"))
    try:
        value: np.generic = dtype.type(obj.get(b"data"))
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError("invalid_array", f"numpy scalar does not fit {dtype.str}: {exc}") from exc
    return value


def _object_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _generic(obj)
    return obj


def unpack(data: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Any:
    """One frame's value. Raises :class:`WireError` (``payload_too_large``, ``invalid_msgpack``,
    ``unsupported_dtype``, ``invalid_array``)."""
    if len(data) > max_bytes:
        raise WireError(
            "payload_too_large", f"payload of {len(data)} bytes is over the {max_bytes}-byte limit"
        )
    msgpack = _msgpack()
    try:
        return msgpack.unpackb(
            data, object_hook=_object_hook, raw=False, strict_map_key=False, max_bin_len=max_bytes
        )
    except WireError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise WireError("invalid_msgpack", f"the frame is not a msgpack message: {exc}") from exc


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in REFUSED_KINDS:
            raise TypeError(f"unsupported dtype {obj.dtype}")
        return {
            b"__ndarray__": True,
            b"data": obj.tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(value: Any) -> bytes:
    """A frame for ``value`` (maps, lists, str, numbers, numpy arrays and scalars)."""
    data: bytes = _msgpack().packb(value, default=_default, use_bin_type=True)
    return data
