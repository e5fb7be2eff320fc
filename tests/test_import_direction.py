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


def _module_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (any import statement: TYPE_CHECKING ones and
    imports inside functions count); ``from package import name`` counts as an import of
    ``package.name`` when that is a module, else of ``package``."""
    paths = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges: set[str] = set()
        for _line, target, names in _imports(path):
            for candidate in [f"{target}.{n}" for n in names] or [target]:
                found = owner(candidate)
                if found is not None and found != module and not module.startswith(found + "."):
                    edges.add(found)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert "session.realtime.core" in _module_graph()["session.voice.driver"]


def test_no_import_circle_between_production_modules() -> None:
    circles = _circles(_module_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_production_module_over_600_lines() -> None:
    """Small modules (docs/CONTRACTS.md): split by responsibility before one grows past 600."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 100  # the walk saw the packages
    large = sorted(f"{where}: {lines}" for where, lines in sizes.items() if lines > 600)
    assert not large, "modules over 600 lines:\n" + "\n".join(large)
