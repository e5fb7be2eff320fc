"""Tests by layer: every test is `unit`, `system` or `browser` (registered in pyproject.toml).

Why a hook rather than a marker in every file: the layer of a test follows from what it touches,
and most files touch one thing throughout. The rule, per test module:

- ``browser``: the module drives a real Chromium (Playwright);
- ``system``: the module's source names a real server, process, socket, Redis, aiortc peer,
  SDK client or model (see ``_SYSTEM_WORDS``), or it lives under a directory whose conftest
  starts one for every test (``_SYSTEM_DIRS``);
- ``unit``: everything else.

A test that carries one of the three markers itself keeps it (that is how a mixed file says
which of its tests are which). The ``unit`` layer is enforced, not just named: while a ``unit``
test (and its fixtures) runs, opening a network socket, starting a process and building a
torch module fail the test (``_unit_guard``), so a misfiled test is caught the first time
``pytest -m unit`` runs it.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LAYERS = ("unit", "system", "browser")

_HERE = Path(__file__).parent

# Words in a module's source that mean it reaches outside the process's memory, or loads a model.
_SYSTEM_WORDS = re.compile(
    r"\b(live_server|LiveServer|redis\w*|Redis\w*|subprocess|Popen|uvicorn|websockets|aiortc|RTCPeer\w*"
    r"|httpx|openai|socket|Orchestrator|torch|from_pretrained|multiprocessing"
    r"|world_server|stall_server|module_redis|fresh_db|two_replicas|db_url"
    r"|robot_server|session_server|tts|asr|speak16k|sentence16k|run_engine"
    r"|fake_engines|openpi_\w+|load_engine)\b"
)
_BROWSER_WORDS = re.compile(r"\b(playwright|chromium)\b")
# Directories whose conftest gives every test a live server or process.
_SYSTEM_DIRS: frozenset[str] = frozenset()


def _layer_of(path: Path, cache: dict[Path, str]) -> str:
    if path not in cache:
        source = path.read_text(encoding="utf-8")
        if _BROWSER_WORDS.search(source):
            cache[path] = "browser"
        elif _SYSTEM_WORDS.search(source) or path.parent.name in _SYSTEM_DIRS:
            cache[path] = "system"
        else:
            cache[path] = "unit"
    return cache[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict[Path, str] = {}
    for item in items:
        if any(item.get_closest_marker(layer) for layer in LAYERS):
            continue
        item.add_marker(getattr(pytest.mark, _layer_of(Path(str(item.path)), cache)))


class UnitLayerViolation(AssertionError):
    """A `unit` test touched a socket, a process or a model: it belongs in `system`."""


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UnitLayerViolation(f"a unit test may not {what}: mark it `system` (tests/conftest.py)")

    return refused


def _guards() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for everything a unit test may not do."""
    guards: list[tuple[Any, str, Any]] = []
    for name in ("connect", "connect_ex", "bind"):
        guards.append((socket.socket, name, _refuse(f"open a network socket (socket.{name})")))
    guards.append((socket, "create_connection", _refuse("open a network connection")))
    guards.append((subprocess.Popen, "__init__", _refuse("start a process")))
    import multiprocessing.process

    guards.append((multiprocessing.process.BaseProcess, "start", _refuse("start a process")))
    torch = sys.modules.get("torch")
    if torch is not None:
        guards.append((torch.nn.Module, "__init__", _refuse("build a model (torch.nn.Module)")))
    return guards


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _unit_guard(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _unit_guard(item):
        yield


class _unit_guard:
    """Install the refusals for a `unit` item; a no-op for the other layers."""

    def __init__(self, item: pytest.Item) -> None:
        self.active = item.get_closest_marker("unit") is not None
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        if not self.active:
            return
        for owner, name, replacement in _guards():
            self.saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, replacement)

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self.saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_MISSING = object()
