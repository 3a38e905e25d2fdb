"""The experiment scripts (``python -m experiments.sine``, ``.omniglot``, ``.sweep``).

Importing this package first checks that ``maml`` and ``tasks`` are maml-toolkit's own: the
three top-level names are generic, and a researcher's ``tasks/`` or ``maml/`` folder in the
working directory (or anywhere earlier on ``sys.path``) would otherwise be imported instead and
fail later with an unrelated ``AttributeError``. A shadowed package ends the program with one
line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

_FIT_SCRIPTS = (
    "experiments.sine",
    "experiments.omniglot",
    "experiments.images",
)  # their fit.main takes the signals over
STARTING = "stopped during start-up, before training: nothing to resume; run the same command again."


def _stop_while_importing(signum: int, frame: Any) -> None:
    print(f"\n{STARTING}", file=sys.stderr, flush=True)
    os._exit(143 if signum == signal.SIGTERM else 130)  # nothing is written yet; no traceback to unwind


def _catch_stops_while_importing() -> None:
    """Ctrl-C or SIGTERM in a script's first seconds (importing torch) ends with one line, not a traceback.

    Only for ``python -m experiments.sine`` (or ``.omniglot``) itself, while Python imports it; the script's entry
    point (:func:`release_start_up_signals`) then hands Ctrl-C back to ``KeyboardInterrupt``.
    """
    argv = getattr(sys, "orig_argv", [])
    run = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if run not in _FIT_SCRIPTS or sys.argv[:1] != ["-m"]:
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):  # not ignored (nohup, &)
            signal.signal(sig, _stop_while_importing)


def release_start_up_signals() -> None:
    """Gives Ctrl-C back to ``KeyboardInterrupt`` and SIGTERM to its default, where the import-time handler holds them."""
    if signal.getsignal(signal.SIGINT) is _stop_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is _stop_while_importing:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_catch_stops_while_importing()

# The packages the scripts import; maml-toolkit installs them beside this one.
_SIBLINGS = ("maml", "tasks")


def _shadowing(name: str, home: Path) -> str | None:
    """Why ``import name`` would not give maml-toolkit's package, or ``None`` when it would.

    Args:
        name: a top-level package maml-toolkit installs beside ``experiments``.
        home: the folder holding maml-toolkit's ``experiments`` (and so its ``name``): the
            checkout for an editable install, ``site-packages`` (or a ``--target``) for a wheel.

    Returns:
        The one-line error message, or ``None``.
    """
    try:
        # find_spec locates without importing, so a shadowing package's own code never runs.
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None  # the import itself fails, with Python's own message naming the module
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        # A regular package, or a namespace one: a plain folder without __init__.py is enough
        # to win over an editable install, whose finder runs after the path-based one.
        found, kind = Path(locations[0]), "folder"
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
    """The distribution installed in ``folder`` that provides the top-level ``name``, if any.

    Args:
        name: a top-level package or module name.
        folder: the ``sys.path`` entry it was found in.
    """
    for dist in importlib.metadata.distributions(path=[str(folder)]):
        owner = dist.metadata["Name"]
        # Skip another copy of ours (a second checkout's egg-info), and broken metadata that
        # names nothing to uninstall: the path-based message covers both.
        if not owner or owner.lower().replace("_", "-") == "maml-toolkit":
            continue
        tops = set((dist.read_text("top_level.txt") or "").split())
        tops.update(Path(f.parts[0]).stem for f in dist.files or [] if f.parts)
        if name in tops:
            return dist
    return None


def _check_siblings() -> None:
    """Ends the program (exit 2, one line on stderr) when ``maml`` or ``tasks`` is shadowed.

    Raises:
        SystemExit: with code 2, after printing which package is found where and what to do.
    """
    home = Path(__file__).resolve().parent.parent
    for name in _SIBLINGS:
        message = _shadowing(name, home)
        if message is not None:
            print(message, file=sys.stderr)
            raise SystemExit(2)


_check_siblings()
