"""The dependency direction of docs/CONTRACTS.md, checked on the source (ast, no imports run).

web -> session -> runtime, engines -> runtime, media is a leaf, nothing imports web, web imports
neither loadtest nor engines (models are found through the registry's entry points), loadtest
(benchmarks of engines too) imports anything but web, and no module imports another module's
private (``_``-prefixed) names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("session", "media", "runtime", "engines", "web", "loadtest")

# package -> the packages of ours it may import (itself always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "media": frozenset(),
    "runtime": frozenset({"media"}),
    "engines": frozenset({"runtime", "media"}),
    "session": frozenset({"runtime", "media"}),
    "web": frozenset({"session", "runtime", "media"}),
    "loadtest": frozenset({"session", "runtime", "media", "engines"}),  # engine benchmarks
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, target] if target else base)
            found.append((node.lineno, target, [alias.name for alias in node.names]))
    return found


def _violations() -> list[str]:
    problems: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT)
            for _line, target, names in _imports(path):
                top = target.split(".")[0]
                if top in PACKAGES and top != package and top not in ALLOWED[package]:
                    problems.append(f"{where}: {package} imports {target}")
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private and target != _module_name(path) and top in PACKAGES:
                    problems.append(f"{where}: private {', '.join(private)} from {target}")
    return problems


def test_the_import_checker_sees_edges() -> None:
    """The checker finds imports at all (a parse that saw nothing would pass vacuously)."""
    edges = [target for _, target, _ in _imports(ROOT / "web" / "app.py")]
    assert any(target.startswith("session") for target in edges)


def test_no_forbidden_import_edge() -> None:
    found = _violations()
    assert not found, "forbidden imports:\n" + "\n".join(found)
