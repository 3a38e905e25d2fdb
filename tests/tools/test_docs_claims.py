"""What the pages say of the tests' data and of the tasks API is true: the Omniglot archives the tests read, and
``tasks.from_learn2learn``'s examples (in its docstring and on the tasks page) run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from helpers import omniglot_root
from test_docs import REPO, blocks
from test_docs_shapes import docstring_blocks

import tasks

ZIP = re.compile(r"`([\w.-]+\.zip)`")


def archives_the_tests_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The archives the tests require, as their one gate on the data (``helpers.omniglot_root``) names them."""
    monkeypatch.setenv("OMNIGLOT_DIR", str(tmp_path))  # a folder without them: the gate lists what it misses
    with pytest.raises(pytest.fail.Exception) as missing:
        omniglot_root()
    return ast.literal_eval(re.search(r"archives (\[.*?\])", str(missing.value)).group(1))


def archives_named_for_the_tests(page: Path) -> set[str]:
    """The archives ``page`` names, in its sentences about the tests and ``$OMNIGLOT_DIR``, after the word tests."""
    text = " ".join(page.read_text().split())
    named = set()
    for sentence in re.split(r"(?<=[.;])\s(?=[A-Z`])", text):
        if "`$OMNIGLOT_DIR`" in sentence and (at := re.search(r"\b[Tt]he tests\b", sentence)):
            named |= set(ZIP.findall(sentence[at.end() :]))
    return named


def test_the_readme_and_the_quickstart_name_the_archives_the_tests_read(tmp_path, monkeypatch):
    truth = set(archives_the_tests_read(tmp_path, monkeypatch))
    assert truth == {"images_background_small1.zip", "images_background_small2.zip"}
    for page in ("README.md", "docs/quickstart.md"):
        assert archives_named_for_the_tests(REPO / page) == truth, page


def test_from_learn2learn_has_an_example_in_its_docstring_that_runs():
    (code,) = docstring_blocks(tasks.from_learn2learn)
    namespace: dict[str, object] = {"__name__": "__docstring__"}
    exec(compile(code, "tasks.from_learn2learn's example", "exec", dont_inherit=True), namespace)
    batch = namespace["batch"]
    assert batch.support_x.shape == (4, 5, 1, 28, 28) and batch.query_x.shape == (4, 75, 1, 28, 28)
    assert torch.equal(batch.support_y, torch.arange(5).expand(4, 5))
    assert torch.equal(batch.query_y, torch.arange(5).repeat_interleave(15).expand(4, 75))


def test_the_tasks_page_shows_from_learn2learn_in_a_block_the_docs_test_runs():
    """A ``python`` block (``test_docs.py`` runs it, with the page's blocks before it) calls it, on the page that
    describes the tasks API, below the section's heading."""
    page = REPO / "docs" / "concepts.md"
    assert "## Tasks" in page.read_text()
    tasks_section = page.read_text().split("## Tasks", 1)[1]
    calls = [code for code in blocks(page) if "tasks.from_learn2learn(" in code and code in tasks_section]
    assert calls, "docs/concepts.md#tasks has no python block calling tasks.from_learn2learn"
