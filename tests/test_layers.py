"""Every test module names its layer in its source (tests/conftest.py checks the collected ones;
this checks every file, collected in this run or not, e.g. a directory skipped for a missing
extra), and the collection check refuses a module that does not."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import LAYERS, module_layers

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def _named_layers(path: Path) -> list[str]:
    """The layers a module-level ``pytestmark = ...`` assignment in ``path`` names."""
    found: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and sub.attr in LAYERS:
                    found.append(sub.attr)
    return found


def test_every_test_module_names_one_layer() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 100  # the walk saw the suite
    wrong = [f"{p.relative_to(TESTS)}: {_named_layers(p)}" for p in modules if len(_named_layers(p)) != 1]
    assert not wrong, "modules without exactly one layer in pytestmark:\n" + "\n".join(wrong)


def test_module_layers_reads_a_mark_or_a_list() -> None:
    one, listed, none = ModuleType("one"), ModuleType("listed"), ModuleType("none")
    one.pytestmark = pytest.mark.system  # type: ignore[attr-defined]
    listed.pytestmark = [pytest.mark.timeout(30), pytest.mark.unit]  # type: ignore[attr-defined]
    assert module_layers(one) == ["system"]
    assert module_layers(listed) == ["unit"]
    assert module_layers(none) == []
