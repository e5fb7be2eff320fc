"""Tests by layer: every test is `unit`, `system` or `browser` (registered in pyproject.toml).

Every test module names its layer at module level, ``pytestmark = pytest.mark.unit`` (or
``system``, ``browser``; a list may add other marks, e.g. a timeout). The layer follows from what
the module's tests touch:

- ``browser``: the module drives a real Chromium (Playwright);
- ``system``: its tests start or reach a real server, process, socket, Redis, aiortc peer, SDK
  client, or build a model;
- ``unit``: none of that, only memory.

A module with tests of two layers is two modules. Collection fails, naming the modules, when a
module names no layer, or more than one, or a test names a layer other than its module's
(``LayerNotNamed``): the layer is read from the code, never guessed from its text. The ``unit``
layer is enforced, not just named: while a ``unit`` test (and its fixtures) runs, opening a
network socket, starting a process and building a torch module fail the test
(``_unit_guard``), so a misfiled test is caught the first time ``pytest -m unit`` runs it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

LAYERS = ("unit", "system", "browser")


class LayerNotNamed(pytest.UsageError):
    """A test module names no layer, or two, or a test of it names another one."""


def module_layers(module: ModuleType) -> list[str]:
    """The layers a test module's ``pytestmark`` names."""
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    return [mark.name for mark in marks if getattr(mark, "name", None) in LAYERS]


def layer_problems(items: list[pytest.Item]) -> list[str]:
    """What is wrong with the layers of ``items``' modules, one line each (empty: all named)."""
    problems: dict[str, str] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        where = str(Path(str(item.path)).relative_to(Path(__file__).parent.parent))
        layers = module_layers(module)
        if len(layers) != 1:
            named = layers or "no layer"
            problems.setdefault(where, f"{where}: pytestmark names {named}, not one of {LAYERS}")
            continue
        own = {mark.name for mark in item.own_markers if mark.name in LAYERS} - set(layers)
        if own:
            problems.setdefault(where, f"{where}::{item.name} is {sorted(own)} in a {layers[0]} module")
    return sorted(problems.values())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before ``-m`` deselects anything: every collected module names its one layer."""
    problems = layer_problems(items)
    if problems:
        raise LayerNotNamed("test modules must name their layer (tests/conftest.py):\n" + "\n".join(problems))


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
