"""The documentation runs: every ``python`` code block of the README and of ``docs/`` is executed, page by page.

A page's blocks run in order in one namespace (a block may use what an earlier one defined), in a
temporary working folder, with ``$OMNIGLOT_DIR`` pointing at the real archives. A block that is
shown but must not run is fenced as another language (``bash``, ``text``). The README stays an
entry page of at most 200 lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import omniglot_root

from maml._src import modes

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
README_LINES = 200


def blocks(page: Path) -> list[str]:
    """The ``python`` blocks of ``page``, in order."""
    return [m.group(1) for m in BLOCK.finditer(page.read_text())]


def test_the_pages_hold_code_to_run():
    counts = {p.relative_to(REPO).as_posix(): len(blocks(p)) for p in PAGES}
    assert sum(counts.values()) >= 10, counts
    assert counts["README.md"] >= 1 and counts["docs/quickstart.md"] >= 3, counts


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    # A page may add a mode to the engine's table (extending.md): it is the page's alone.
    monkeypatch.setattr(modes, "TABLE", dict(modes.TABLE))
    monkeypatch.setattr(modes, "OPTIONS", dict(modes.OPTIONS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNIGLOT_DIR", str(omniglot_root()))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks(page)):
        try:
            exec(compile(code, f"{page.name}, python block {i + 1}", "exec", dont_inherit=True), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(REPO)}: python block {i + 1} failed: {e!r}\n{code}") from e


def test_the_readme_is_an_entry_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_LINES})"
    for page in os.listdir(REPO / "docs"):
        assert page.endswith(".md") or page in ("stylesheets", "img"), page  # img: figures drawn by scripts


def _ci_docs(folder: Path) -> subprocess.CompletedProcess[str]:
    """CI's docs step (``.ci/docs``, as ``.ci/run`` runs it) on the site of ``folder``."""
    env = {**os.environ, "MKDOCS": str(REPO / ".venv" / "bin" / "mkdocs")}
    return subprocess.run(
        ["bash", str(REPO / ".ci" / "docs")], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_ci_docs_build_fails_on_every_warning_and_the_site_has_none(tmp_path):
    """``mkdocs build --strict --quiet`` passed on two griffe warnings: --quiet drops them before --strict counts."""
    site = tmp_path / "site"
    site.mkdir()
    for name in ("mkdocs.yml", "docs", "maml", "tasks"):  # the pages and the packages whose docstrings they show
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, site / name)
    clean = _ci_docs(site)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    functional = site / "maml" / "_src" / "functional.py"
    text = functional.read_text()
    broken = text.replace("        **kwargs: the model's keyword inputs.\n", "        nothing: no such parameter.\n", 1)
    assert broken != text
    functional.write_text(broken)
    failed = _ci_docs(site)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "WARNING" in failed.stdout and "'nothing' does not appear in the function signature" in failed.stdout
    assert "CI: the docs build failed or warned" in failed.stderr
