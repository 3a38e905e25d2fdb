"""The experiment scripts (``python -m experiments.sine``, ``.omniglot``, ``.sweep``).

Importing this package checks that ``maml`` and ``tasks`` are maml-toolkit's own (a researcher's ``tasks/`` folder
would otherwise fail later with an unrelated ``AttributeError``): a shadowed one is one line and exit code 2.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from experiments.harness.folder import EXIT_USAGE


def _shadowing(name: str, home: Path) -> str | None:
    """The one-line error when ``import name`` would not find maml-toolkit's package in ``home``, else None."""
    try:
        spec = importlib.util.find_spec(name)  # locates without importing: a shadowing package's code never runs
    except (ImportError, ValueError):
        return None  # the import itself fails, with Python's own message naming the module
    if spec is None:
        return None
    if spec.submodule_search_locations:
        # A package, or a plain folder without __init__.py: that wins over an editable install's finder too.
        found, kind = Path(list(spec.submodule_search_locations)[0]), "folder"
    elif spec.origin:
        found, kind = Path(spec.origin), "module"
    else:
        return None
    found = found.resolve()
    if found.parent == home:
        return None
    owner = _installed_by(name, found.parent)
    if owner is not None:  # the registry has distributions named maml and tasks
        where = f"installed by the distribution {owner.metadata['Name']} {owner.version}"
        fix = f"Uninstall it (pip uninstall {owner.metadata['Name']}), or give maml-toolkit an environment of its own."
    elif found.parent == Path.cwd().resolve():
        where, fix = "in the working directory", f"Rename that {kind}, or run from another directory."
    else:
        where, fix = "on sys.path", f"Rename that {kind}, or take {found.parent} off sys.path (PYTHONPATH)."
    return (
        f"error: `import {name}` finds {found}, a {kind} {where} that shadows maml-toolkit's "
        f"{name} package ({home / name}). {fix}"
    )


def _installed_by(name: str, folder: Path) -> importlib.metadata.Distribution | None:
    """The distribution installed in the ``sys.path`` entry ``folder`` that provides the top-level ``name``, if any."""
    for dist in importlib.metadata.distributions(path=[str(folder)]):
        owner = dist.metadata["Name"]
        # Another copy of ours, or metadata naming nothing to uninstall: the path-based message covers both.
        if not owner or owner.lower().replace("_", "-") == "maml-toolkit":
            continue
        tops = set((dist.read_text("top_level.txt") or "").split())
        tops.update(Path(f.parts[0]).stem for f in dist.files or [] if f.parts)
        if name in tops:
            return dist
    return None


def _check_siblings() -> None:
    """Exit code 2, after one line on stderr, when ``maml`` or ``tasks`` is shadowed."""
    home = Path(__file__).resolve().parent.parent
    for name in ("maml", "tasks"):
        message = _shadowing(name, home)
        if message is not None:
            print(message, file=sys.stderr)
            raise SystemExit(EXIT_USAGE)


_check_siblings()
