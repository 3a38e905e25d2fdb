"""The packages' layout: who imports whom (every import statement, annotations and functions included), and module size."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("maml", "tasks", "experiments")  # what the wheel installs
# Who may import whom: the engine stands alone, the task distributions on the engine, the scripts on both.
ALLOWED = {"maml": {"maml"}, "tasks": {"maml", "tasks"}, "experiments": {"maml", "tasks", "experiments"}}
LONGEST_SCRIPT_MODULE = 350  # lines
# The installed scripts' lines in all: a bound that only ever goes down (the goal is 3,500).
SCRIPT_PACKAGE_LINES = 4_600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_imports(path: Path) -> set[str]:
    """The first-party modules ``path`` imports anywhere (a name imported from a package counts as its module
    where one exists: ``from experiments import cli`` is ``experiments.cli``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found & first_party_modules()


@functools.cache
def first_party_modules() -> frozenset[str]:
    return frozenset(module_name(p) for name in (*PACKAGES, "tools", "benchmarks") for p in (ROOT / name).rglob("*.py"))


@functools.cache
def graph() -> dict[str, set[str]]:
    return {
        module_name(path): first_party_imports(path) - {module_name(path)}
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }


def test_the_installed_packages_import_only_what_they_may():
    wrong = {
        (module, imported)
        for module, imports in graph().items()
        for imported in imports
        if imported.split(".")[0] not in ALLOWED[module.split(".")[0]]
    }
    assert not wrong, sorted(wrong)


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle among ``edges`` (module -> modules it imports), or None. A package's ``__init__`` is
    left out: importing ``a.b`` runs ``a`` first by construction, which is no circle of the code's making."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_circle_even_through_annotations():
    packages = {module for module in graph() if (ROOT / module.replace(".", "/") / "__init__.py").is_file()}
    edges = {module: imports - packages for module, imports in graph().items()}
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def test_the_circle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").rglob("*.py")), ids=lambda p: p.name)
def test_no_script_module_is_longer_than_its_bound(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= LONGEST_SCRIPT_MODULE, f"{path.name}: {lines} lines; split what it holds by idea"


def test_the_script_package_stays_within_its_line_budget():
    lines = sum(len(path.read_text().splitlines()) for path in (ROOT / "experiments").rglob("*.py"))
    assert lines <= SCRIPT_PACKAGE_LINES, f"experiments/: {lines} lines, above {SCRIPT_PACKAGE_LINES}; make room first"
