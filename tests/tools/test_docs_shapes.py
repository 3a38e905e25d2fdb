"""The shapes the code comments of a page (or a docstring's example) give are the shapes its code makes.

A comment on an assignment may give shapes: ``# (5, 3)`` at its start is the shape of what is assigned (one
shape for each target of a tuple, or one for all of them), and ``name (32, 5, 1, 28, 28)`` the shape of the
assigned value's ``name`` (``support_x`` of a ``TaskBatch``). On the checked pages every shape in a code
comment is concrete (numbers, not ``T`` or ``5*16``) and names what it is the shape of, so that each is
checked: the page's blocks run as ``test_docs.py`` runs them, each commented assignment followed by a check
of its value.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import omniglot_root
from test_docs import REPO, blocks

import tasks
from maml._src import modes


def docstring_blocks(function: object) -> list[str]:
    """The fenced ``python`` blocks of ``function``'s docstring, dedented."""
    doc = inspect.getdoc(function) or ""
    return [textwrap.dedent(m.group(2)) for m in re.finditer(r"^( *)```python\n(.*?)^\1```", doc, re.S | re.M)]


# The pages and docstrings whose every shape comment must be concrete and true, and their python blocks.
CHECKED: dict[str, Callable[[], list[str]]] = {
    "docs/concepts.md": lambda: blocks(REPO / "docs" / "concepts.md"),
    "tasks.from_learn2learn": lambda: docstring_blocks(tasks.from_learn2learn),
}
GROUP = re.compile(r"\(([^()]*)\)")  # a parenthesised group in a comment
TOKEN = re.compile(r"^(?:[\w*.+-]+|\.\.\.)$")  # a dimension, concrete (32) or not (T, 5*16, ...)
NAMED = re.compile(r"(\w+(?:, \w+)*) $")  # the names just before a shape: "support_x (" or "x, y ("
CHECK = "__shape_check__"


def shape_groups(comment: str) -> list[re.Match[str]]:
    """The groups of ``comment`` that read as shapes: ``()``, ``(8,)``, ``(T, n, 1)``, not ``(see below)``."""
    found = []
    for m in GROUP.finditer(comment):
        inner = m.group(1).strip()
        dims = [d.strip() for d in inner.rstrip(",").split(",")] if inner else []
        if not inner or ((len(dims) > 1 or inner.endswith(",")) and all(TOKEN.match(d) for d in dims)):
            found.append(m)
    return found


def dims(group: re.Match[str]) -> tuple[int, ...] | None:
    """The shape a group gives, or None where a dimension is not a number."""
    inner = group.group(1).strip().rstrip(",")
    parts = [d.strip() for d in inner.split(",")] if inner else []
    return tuple(int(d) for d in parts) if all(d.isdigit() for d in parts) else None


@dataclass
class Claim:
    line: int  # in its block
    what: str  # what the comment says has the shape
    said: tuple[int, ...]
    made: tuple[int, ...] | None  # what the code made (None: no such value)


def comments(code: str) -> dict[int, str]:
    """The comment on each line of ``code``, by line number."""
    return {
        t.start[0]: t.string.lstrip("#").strip()
        for t in tokenize.generate_tokens(io.StringIO(code).readline)
        if t.type == tokenize.COMMENT
    }


def target_names(node: ast.Assign) -> list[str] | None:
    """The names an assignment binds, in order (None for other targets: attributes, subscripts)."""
    (target,) = node.targets if len(node.targets) == 1 else (None,)
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        return [e.id for e in target.elts]
    return None


class Instrument(ast.NodeTransformer):
    """Follows every assignment whose lines hold a comment with a shape by a call checking its value."""

    def __init__(self, notes: dict[int, str]) -> None:
        self.notes = notes

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                setattr(node, field, [s for stmt in statements for s in self._checked(stmt)])
        return node

    def _checked(self, stmt: ast.stmt) -> list[ast.stmt]:
        lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
        note = next((self.notes[i] for i in lines if i in self.notes), "")
        if not isinstance(stmt, ast.Assign) or not shape_groups(note):
            return [stmt]
        names = target_names(stmt)
        if names is None:
            return [stmt]
        values = ast.Tuple([ast.Name(n, ast.Load()) for n in names], ast.Load())
        arguments = [ast.Constant(stmt.lineno), ast.Constant(note), ast.Constant(tuple(names)), values]
        call = ast.Call(ast.Name(CHECK, ast.Load()), arguments, [])
        return [stmt, ast.copy_location(ast.Expr(call), stmt)]


def check_comment(note: str, line: int, names: list[str], values: tuple[Any, ...]) -> tuple[list[Claim], list[str]]:
    """The claims of one comment against the values its assignment made, and what in it cannot be checked."""
    claims: list[Claim] = []
    problems: list[str] = []
    groups = shape_groups(note)
    leading: list[re.Match[str]] = []  # the bare shapes the comment starts with: the targets'
    for group in groups:
        if note[leading[-1].end() if leading else 0 : group.start()].strip(" ,"):
            break
        leading.append(group)
    if leading:
        if len(leading) not in (1, len(names)):
            problems.append(f"line {line}: {len(leading)} leading shapes for the {len(names)} names {names}: {note!r}")
        for name, value, group in zip(names, values, leading * len(names) if len(leading) == 1 else leading):
            said = dims(group)
            if said is None:
                problems.append(f"line {line}: {name} {group.group(0)} is not a concrete shape: {note!r}")
            else:
                claims.append(Claim(line, name, said, shape(value)))
    for group in groups[len(leading) :]:
        said, before = dims(group), NAMED.search(note[: group.start()])
        if said is None:
            problems.append(f"line {line}: {group.group(0)} is not a concrete shape: {note!r}")
        elif before is None or len(values) != 1:
            problems.append(f"line {line}: {group.group(0)} names nothing of {names} it is the shape of: {note!r}")
        else:
            for field in before.group(1).split(", "):
                claims.append(Claim(line, field, said, shape(getattr(values[0], field, None))))
    return claims, problems


def shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def run_blocks(name: str, codes: list[str]) -> tuple[list[tuple[int, Claim]], list[str]]:
    """Runs python blocks in order in one namespace, checking each shape comment; the claims (by block) and the
    problems, each naming ``name`` (where the blocks are)."""
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    claims: list[tuple[int, Claim]] = []
    problems: list[str] = []
    for index, code in enumerate(codes, start=1):
        notes = comments(code)

        def check(line: int, note: str, names: tuple[str, ...], values: tuple[Any, ...], index=index) -> None:
            found, wrong = check_comment(note, line, list(names), values)
            claims.extend((index, c) for c in found)
            problems.extend(f"{name}, python block {index}, {w}" for w in wrong)

        namespace[CHECK] = check
        tree = ast.fix_missing_locations(Instrument(notes).visit(ast.parse(code)))
        exec(compile(tree, f"{name}, python block {index}", "exec", dont_inherit=True), namespace)
    for index, c in claims:
        if c.made != c.said:
            problems.append(f"{name}, python block {index}, line {c.line}: {c.what} is {c.made}, not {c.said}")
    return claims, problems


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[tuple[int, Claim]], list[str]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modes, "TABLE", dict(modes.TABLE))
        mp.setattr(modes, "OPTIONS", dict(modes.OPTIONS))
        mp.chdir(tmp_path_factory.mktemp("docs"))
        mp.setenv("OMNIGLOT_DIR", str(omniglot_root()))
        mp.setenv("WANDB_MODE", "disabled")
        return {name: run_blocks(name, codes()) for name, codes in CHECKED.items()}


@pytest.mark.parametrize("where", CHECKED)
def test_every_shape_comment_is_concrete_named_and_true(ran, where):
    claims, problems = ran[where]
    assert not problems, "\n".join(problems)
    assert claims, f"{where}: no shape comment was checked"


def test_the_few_shot_sampler_comment_gives_the_batch_it_draws(ran):
    """concepts.md's ``sampler.sample(32, ...)`` is 5-way 1-shot with 15 query images a class: its comment gives the
    support and query shapes the sampler makes, ``(32, 5, 1, 28, 28)`` and ``(32, 75, 1, 28, 28)``, not one ``x``."""
    claims, _ = ran["docs/concepts.md"]
    code = next(c for c in blocks(REPO / "docs/concepts.md") if "sampler.sample(32" in c)
    index = blocks(REPO / "docs/concepts.md").index(code) + 1
    lines = code.splitlines()
    line = next(i for i, text in enumerate(lines, start=1) if "sampler.sample(32" in text)
    said = {c.what: c.said for i, c in claims if i == index and c.line in (line, line + 1)}
    assert said == {
        "support_x": (32, 5, 1, 28, 28),
        "query_x": (32, 75, 1, 28, 28),
        "support_y": (32, 5),
        "query_y": (32, 75),
    }, said
