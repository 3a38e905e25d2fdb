"""Packaging: the built wheel holds every module and runs a meta-step outside the checkout, and a
folder that shadows ``maml`` or ``tasks`` stops the scripts with one line that says so.

The editable install that ``scripts/setup.sh`` makes reads the checkout directly, so the rest of
the suite cannot see what a wheel leaves out; these tests build one and use only it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("maml", "tasks", "experiments")
# What the build must not see from the checkout: outputs of earlier builds and local state.
_NOT_SOURCE = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", "runs", "wandb")

# Run by a Python that sees only the installed wheel and the venv's dependencies.
METASTEP = """
import sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
# -S: no site module, so no .pth file ran and the editable install's finder is not installed.
assert sys.flags.no_site, "expected python -S"
finders = [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]
assert not any("Editable" in f for f in finders), finders
assert not any(m.startswith("__editable__") for m in sys.modules), sorted(sys.modules)

import torch
import maml, tasks, experiments, experiments.harness.fit

for module in (maml, tasks, experiments, experiments.harness.fit, sys.modules["maml._src.learner"]):
    assert Path(module.__file__).resolve().is_relative_to(target), (module.__name__, module.__file__)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
learner = maml.MetaLearner(model, torch.nn.functional.mse_loss, inner_lr=0.1, steps=1)
sine = tasks.Sine().sample(4, shots=5, query=5, generator=torch.Generator().manual_seed(0))
learner.meta_loss(maml.TaskBatch(sine.support_x, sine.support_y, sine.query_x, sine.query_y)).backward()
assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
print("meta-step ok")
"""


def _source_tree(dest: Path) -> Path:
    """Copies the checkout's sources (tracked and new, not ignored) to ``dest``.

    Building from a copy keeps the build's ``build/`` and ``*.egg-info`` out of the checkout and
    makes the wheel depend on the sources only, not on what earlier builds left there.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:  # not a git checkout (an sdist, say): copy all but local state
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _pip(*args: str | Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _source_tree(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, source)
    (built,) = dist.glob("maml_toolkit-*.whl")
    return built


def test_the_wheel_holds_every_python_file_of_the_packages(wheel: Path, source: Path) -> None:
    # A package folder without __init__.py is silently left out by `packages = find:`.
    expected = {p.relative_to(source).as_posix() for name in PACKAGES for p in (source / name).rglob("*.py")}
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    assert "maml/_src/learner.py" in expected  # the comparison below is not vacuous
    assert sorted(expected - shipped) == []


def test_the_wheel_holds_the_product_and_not_the_repository_tooling(wheel: Path, source: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert (source / "tools" / "tables.py").is_file()  # the tooling exists in the checkout, so the check is not vacuous
    assert tops == set(PACKAGES)


def test_the_installed_wheel_runs_a_meta_step_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-index", "--target", target, wheel)
    site = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))  # torch, numpy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *site])}
    work = tmp_path / "elsewhere"  # the working directory: outside the checkout
    work.mkdir()
    assert not work.resolve().is_relative_to(REPO)

    # The control: without the wheel, this Python cannot import maml at all (neither the checkout
    # nor the editable finder stands in for it), so the run below uses the wheel alone.
    control = subprocess.run(
        [sys.executable, "-S", "-c", "import maml"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join(site)},
    )
    assert control.returncode == 1 and "No module named 'maml'" in control.stderr, control.stderr

    run = subprocess.run(
        [sys.executable, "-S", "-c", METASTEP, str(target)], cwd=work, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "meta-step ok\n"


# ---------------------------------------------------------------------- shadowing


def _home() -> Path:
    """The folder holding the installed ``experiments`` (the checkout for the editable install)."""
    spec = importlib.util.find_spec("experiments")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve().parent.parent


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("tasks", "tasks/__init__.py"),  # a researcher's own package
        ("tasks", "tasks/notes.txt"),  # a plain folder: a namespace package shadows an editable install
        ("maml", "maml/__init__.py"),
        ("maml", "maml.py"),
    ],
)
def test_a_shadowing_folder_in_the_working_directory_stops_the_scripts_with_one_line(
    name: str, make: str, tmp_path: Path
) -> None:
    (tmp_path / make).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / make).write_text(
        "raise RuntimeError('the shadowing code must not run')\n" if make.endswith(".py") else ""
    )
    found, kind = (tmp_path / make.split("/")[0]).resolve(), "module" if make == "maml.py" else "folder"
    run = subprocess.run(
        [sys.executable, "-m", "experiments.sine", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (
        f"error: `import {name}` finds {found}, a {kind} in the working directory that shadows maml-toolkit's "
        f"{name} package ({_home() / name}). Rename that {kind}, or run from another directory.\n"
    )
    assert "Traceback" not in run.stderr


def test_a_shadowing_folder_on_the_path_is_named_with_its_path_entry(tmp_path: Path) -> None:
    (tmp_path / "lib" / "tasks").mkdir(parents=True)
    (tmp_path / "lib" / "tasks" / "__init__.py").write_text("")
    (tmp_path / "work").mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "experiments.omniglot", "--help"],
        cwd=tmp_path / "work",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "lib")},
    )
    lib = (tmp_path / "lib").resolve()
    assert run.returncode == 2
    assert run.stderr == (
        f"error: `import tasks` finds {lib / 'tasks'}, a folder on sys.path that shadows maml-toolkit's tasks "
        f"package ({_home() / 'tasks'}). Rename that folder, or take {lib} off sys.path (PYTHONPATH).\n"
    )


def test_a_distribution_of_the_same_name_is_named_with_how_to_remove_it(tmp_path: Path) -> None:
    # The registry has distributions called maml and tasks; one installed where Python looks first wins.
    lib = (tmp_path / "lib").resolve()
    (lib / "maml").mkdir(parents=True)
    (lib / "maml" / "__init__.py").write_text("")
    (lib / "maml-9.9.dist-info").mkdir()
    (lib / "maml-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: maml\nVersion: 9.9\n")
    (lib / "maml-9.9.dist-info" / "top_level.txt").write_text("maml\n")
    run = subprocess.run(
        [sys.executable, "-m", "experiments.sine", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(lib)},
    )
    assert run.returncode == 2
    assert run.stderr == (
        f"error: `import maml` finds {lib / 'maml'}, a folder installed by the distribution maml 9.9 that shadows "
        f"maml-toolkit's maml package ({_home() / 'maml'}). Uninstall it (pip uninstall maml), or give "
        "maml-toolkit an environment of its own.\n"
    )


def test_without_a_shadowing_folder_another_working_directory_is_fine(tmp_path: Path) -> None:
    # find_spec, not import: the check is what runs here, and torch would take seconds to import.
    code = "import experiments, importlib.util as u; print(u.find_spec('maml').origin, u.find_spec('tasks').origin)"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(_home() / "maml" / "__init__.py"), str(_home() / "tasks" / "__init__.py")]
