"""Leaving acyclic long-lived objects out of the cyclic garbage collector's scans.

A voice session adds a few objects to its conversation every turn (two items, their content
lists, their parts) and keeps them for the session's life. Reference counting frees them:
none of them refers back to anything that refers to it. But a full collection scans every
tracked object with the event loop stopped: in a null-200 run the collector's oldest
generation grew by ~15,800 objects a minute, and a full collection went from 52 to 102 ms
between minute 1.5 and minute 5 (docs/benchmarks.md, "Conversation state out of the
collector's scans"); one comes after 100 generation-1 collections, every ~8-90 minutes there.

`untrack` takes such an object out of the collector's lists (CPython's public
`PyObject_GC_UnTrack`; a no-op elsewhere). The caller's promise: the object is never part of a
reference cycle, since a cycle through an untracked object is never collected.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import platform
from collections.abc import Callable


@functools.cache
def _untrack_function() -> Callable[[object], None] | None:
    if platform.python_implementation() != "CPython":
        return None
    function = ctypes.pythonapi.PyObject_GC_UnTrack
    function.argtypes = [ctypes.py_object]
    function.restype = None
    return function  # type: ignore[no-any-return]


def untrack(obj: object) -> None:
    """Take `obj` out of the cyclic GC's scans (reference counting still frees it). Only for
    objects that are never part of a reference cycle."""
    function = _untrack_function()
    if function is not None and gc.is_tracked(obj):
        function(obj)
