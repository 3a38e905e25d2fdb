"""What the Omniglot script says about its splits: a split too small for the flags is a one-line usage error
(exit code 2) naming the flag and the split, with nothing written; an empty validation or test share is a
note, and the run trains without it. The runs are in-process and tiny, with wandb disabled.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, exits, omniglot_root, says

import tasks
from experiments import omniglot
from experiments.harness.lifecycle import main


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # Omniglot decoded once for the module


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MAML_CACHE_DIR", str(cache))


def omniglot_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--data",
        str(omniglot_root()),
        "--iterations",
        "1",
        "--meta-batch",
        "1",
        "--filters",
        "4",
        "--query",
        "2",
        "--log-every",
        "1",
        "--val-every",
        "1",
        "--val-tasks",
        "2",
        "--eval-tasks",
        "2",
        "--eval-steps",
        "1",
        "--out",
        str(tmp_path / "run"),
        "--wandb",
        "disabled",
        *extra,
    ]


SPLIT_FIX = "e.g. 0.6,0.15,0.25"  # the shares a message suggests


@pytest.mark.parametrize(
    ("extra", "lead", "fixes"),
    [
        (
            ["--ways", "120"],  # every split in 4 rotations (the reference's): 26 validation characters are 104 classes
            "--ways 120",
            ("validation split", "104 classes", "lower --ways to at most 104", "--split-fractions"),
        ),
        (
            ["--split-fractions", "0.99,0.01,0"],
            "--split-by alphabet --split-fractions 0.99,0.01,0",
            ("8 alphabets", "set its fraction to 0", "split by a finer unit"),
        ),
        (["--split-fractions", "0,0.5,0.5"], "--split-fractions 0,0.5,0.5", ("train split", SPLIT_FIX)),
        (["--split-fractions", "0.5,0.6,0"], "--split-fractions 0.5,0.6,0", ("1.1", "sum to 1", SPLIT_FIX)),
        (["--split-fractions", "0.5,0.5"], "--split-fractions 0.5,0.5", ("three shares", SPLIT_FIX)),
    ],
    ids=["ways-on-validation", "too-few-alphabets", "no-train", "sum", "two-shares"],
)
def test_a_split_problem_names_the_flag_and_the_split(capsys, tmp_path, extra, lead, fixes):
    err = exits(capsys, omniglot.run, omniglot_args(tmp_path, *extra), 2)
    says(err, lead, *fixes)
    assert not (tmp_path / "run").exists()


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("meta-train")]  # without the progress lines


def test_a_zero_test_share_trains_validates_and_skips_the_test(capsys, tmp_path):
    main(omniglot.run, omniglot_args(tmp_path, "--split-fractions", "0.75,0.25,0"))
    captured = capsys.readouterr()
    assert notes(captured.err) == [
        "note: --split-fractions 0.75,0.25,0 gives the test split no characters; the run skips the final test."
    ]
    assert captured.out == (
        f"no final test: --split-fractions 0.75,0.25,0 gives the test split no characters "
        f"(results.json has test: {{}}); the model is in {tmp_path / 'run' / 'checkpoint.pt'}.\n"
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["test"] == {}
    assert results["test_skipped"] == "--split-fractions 0.75,0.25,0 gives the test split no characters"
    assert results["data"]["characters"][2] == 0 and "val/accuracy" in results["final_val"]
    assert not (tmp_path / "run" / "task_grid.png").exists()


def test_a_zero_validation_share_trains_without_validation(capsys, tmp_path):
    main(omniglot.run, omniglot_args(tmp_path, "--split-fractions", "1,0,0"))
    captured = capsys.readouterr()
    assert notes(captured.err) == [
        "note: --split-fractions 1,0,0 gives the validation split no characters; the run trains without validation.",
        "note: --split-fractions 1,0,0 gives the test split no characters; the run skips the final test.",
    ]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["final_val"] == {} and results["test"] == {} and results["data"]["characters"] == [242, 0, 0]
    history = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["history"]
    assert len(history) == 1 and not any(key.startswith("val/") for key in history[0])


def split_calls(text: str) -> list[str]:
    """The arguments of every ``.split("...", ...)`` call written in ``text``, as written."""
    found, start = [], 0
    while (at := text.find('.split("', start)) >= 0:
        depth, end = 0, at + len(".split")
        for end in range(at + len(".split"), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        found.append(text[at + len(".split(") : end])
        start = end
    return found


def test_the_documented_call_gives_the_scripts_split_which_is_not_the_apis_default():
    """split()'s docstring and docs/experiments.md say that its defaults are not the script's, and give the call that
    makes the script's split: it holds the same classes in each part as the script's ``load``."""
    documented = {
        "tasks.Omniglot.split's docstring": split_calls(inspect.getdoc(tasks.Omniglot.split) or ""),
        "docs/experiments.md": split_calls((REPO / "docs" / "experiments.md").read_text()),
    }
    assert all(documented.values()), documented
    cfg = omniglot.OmniglotConfig(data=str(omniglot_root())).resolved()
    assert (cfg.split_by, cfg.split_fractions, cfg.split_seed, cfg.rotations) == (
        "alphabet",
        (0.6, 0.15, 0.25),
        0,
        "all",
    )
    script, _ = omniglot.load(cfg)
    omni = tasks.Omniglot(omniglot_root())
    for where, calls in documented.items():
        for arguments in calls:
            parts = eval(f"omni.split({arguments})", {"omni": omni})  # noqa: S307 - the docs' own text
            for name, part, theirs in zip(omniglot.SPLITS, parts, script, strict=True):
                assert part.classes == theirs.classes, (where, arguments, name)
                assert torch.equal(part.labels, theirs.labels) and torch.equal(part.images, theirs.images)
    # The API's defaults, which the docs contrast with the script's: by character, 0.7/0.15/0.15, train rotated.
    defaults = inspect.signature(tasks.Omniglot.split).parameters
    assert (defaults["by"].default, defaults["fractions"].default) == ("character", (0.7, 0.15, 0.15))
    by_default = omni.split()
    assert [p.rotations for p in by_default] == [True, False, False]
    assert [len(p.characters) for p in by_default] != [len(p.characters) for p in script]
