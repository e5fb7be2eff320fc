"""Engines by name.

Installed engines are declared as entry points in the group ``omniduplex.engines``
(``"qwen3_omni.thinker" = "engines.qwen3_omni.stages:ThinkerEngine"``); the class is imported only
when a pipeline actually uses it, so the runtime never imports ``engines`` itself. Tests register
classes directly with :func:`register_engine`.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from runtime.engine import Engine

ENTRY_POINT_GROUP = "omniduplex.engines"

_lock = threading.Lock()
_registered: dict[str, type[Engine]] = {}
_loaded: dict[str, type[Engine]] = {}


class UnknownEngineError(LookupError):
    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown engine {name!r} (registered: {', '.join(available) or 'none'})")


def register_engine(name: str, cls: type[Engine]) -> None:
    """Register (or replace) an engine class under ``name``; wins over entry points."""
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"engine {name!r}: {cls!r} is not an Engine subclass")
    with _lock:
        _registered[name] = cls


def unregister_engine(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def _entry_point_names() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_engines() -> list[str]:
    with _lock:
        names = set(_registered)
    return sorted(names | set(_entry_point_names()))


def engine_class(name: str) -> type[Engine]:
    """The engine class for ``name``, importing its module on first use. A ``module:QualName``
    path works too (an engine not declared as an entry point of the installed metadata yet)."""
    with _lock:
        cls = _registered.get(name) or _loaded.get(name)
    if cls is not None:
        return cls
    target = name if ":" in name else _entry_point_names().get(name)
    if target is None:
        raise UnknownEngineError(name, available_engines())
    cls = load_engine_path(target)
    with _lock:
        _loaded[name] = cls
    return cls


def engine_path(cls: type[Engine]) -> str:
    """``module:QualName`` of a class, so a worker process can import it by itself."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_engine_path(path: str) -> type[Engine]:
    module_name, _, qualname = path.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Engine)):
        raise TypeError(f"{path} is not an Engine subclass")
    return obj
