"""The packages' layout: who imports whom (every import statement, annotations and functions included), and module size."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("maml", "tasks", "experiments")  # what the wheel installs
# Who may import whom: the engine stands alone, the task distributions on the engine, the scripts on both.
ALLOWED = {"maml": {"maml"}, "tasks": {"maml", "tasks"}, "experiments": {"maml", "tasks", "experiments"}}
LONGEST_SCRIPT_MODULE = 350  # lines


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_imports(path: Path) -> set[str]:
    """The first-party modules ``path`` imports anywhere (a name imported from a package counts as its module
    where one exists: ``from experiments.harness import cli`` is ``experiments.harness.cli``)."""
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
def test_no_module_of_the_scripts_is_longer_than_its_bound(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= LONGEST_SCRIPT_MODULE, f"{path.name}: {lines} lines; split what it holds by idea"


# ---------------------------------------------------------------------- the reading path

FIT_SCRIPTS = ("experiments.sine", "experiments.omniglot", "experiments.images")
# The harness modules a fit script's run reads in (its import closure within experiments.harness): 22 flat modules
# before the harness existed; a bound that only ever goes down.
HARNESS_CLOSURE = 10


def closure(start: str) -> set[str]:
    """The first-party modules importing ``start`` runs: its imports, theirs, and the packages above each."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b runs a first
        todo += sorted(graph().get(module, ()))
    return seen


@pytest.mark.parametrize("script", FIT_SCRIPTS)
def test_a_fit_script_reads_few_harness_modules(script: str):
    harness = sorted(m for m in closure(script) if m.startswith("experiments.harness."))
    assert len(harness) <= HARNESS_CLOSURE, f"{script} reads {len(harness)} harness modules: {', '.join(harness)}"


def test_the_sweep_imports_no_torch_by_its_imports():
    crossed = sorted(m for m in closure("experiments.sweep") if m.split(".")[0] in ("maml", "tasks"))
    assert not crossed, crossed  # the engine imports torch
    run = subprocess.run(
        [sys.executable, "-c", "import experiments.sweep, sys; assert 'torch' not in sys.modules, 'torch'"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_the_exit_codes_are_defined_in_one_module():
    """No other module of experiments/ spells an exit code as a number: SystemExit(2), sys.exit(130), os._exit(143),
    ``== 143``; they name folder.EXIT_* or folder.exit_code(signum)."""
    home = ROOT / "experiments" / "harness" / "folder.py"
    codes, stops = {0, 1, 2, 130, 143}, {130, 143}
    found = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "SystemExit",
                "exit",
                "_exit",
                "_exit_skipping_teardown",
            ):
                # A number passed as the code, or inside the expression that computes it (130 if ... else 143).
                spelled = [a for a in node.args if isinstance(a, ast.Constant) and a.value in codes]
                spelled += [
                    c for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant) and c.value in stops
                ]
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for _ in spelled[:1]]
            elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in stops for k in node.comparators for c in ast.walk(k)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_no_engine_module_but_the_mode_table_compares_a_mode_name():
    """What a mode is lives in its row of ``maml._src.modes.TABLE`` (and its options in its class): no other module
    of the engine tests ``mode == "reptile"`` or ``mode in ("first_order", ...)``; they read the row."""
    names = {"second_order", "first_order", "checkpointed", "reptile", "implicit"}
    found = []
    for path in sorted((ROOT / "maml").rglob("*.py")):
        if path.name == "modes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in names
                for side in [node.left, *node.comparators]
                for c in ast.walk(side)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
