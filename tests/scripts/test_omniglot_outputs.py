"""What the Omniglot script writes and prints, read as a user reads it: the data in ``results.json`` (no path of
this machine, the same however ``--data`` is spelled), ``task_grid.png``'s title inside the figure, the training
accuracy logged as the meta-loss is (a mean over the log window), and the test line naming the unit the split
held out. Tiny runs on the real archives in $OMNIGLOT_DIR, in-process, wandb disabled.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, omniglot_root
from matplotlib.backends.backend_agg import FigureCanvasAgg

from experiments import omniglot
from experiments.harness import report
from experiments.harness.lifecycle import main
from experiments.harness.rundir import fingerprint

ITERATIONS = 6


@dataclass
class Run:
    out: Path
    printed: str  # stdout: the test lines
    results: dict[str, Any]
    rows: list[dict[str, Any]]  # metrics.jsonl
    figures: dict[str, Any]  # the matplotlib figures the run saved, by file name


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("cache")  # Omniglot decoded once for the module

    def run(name: str, *extra: str, data: str | None = None, cwd: Path | None = None) -> Run:
        out = tmp_path_factory.mktemp(name) / "run"
        figures: dict[str, Any] = {}
        save = report.save_figure

        def kept(fig: Any, path: Path) -> None:
            save(fig, path)
            figures[path.name] = fig

        args = [
            *("--data", data or str(omniglot_root()), "--iterations", str(ITERATIONS), "--meta-batch", "4"),
            *("--filters", "4", "--query", "2", "--batching", "vmap", "--val-every", str(ITERATIONS)),
            *("--val-tasks", "2", "--eval-tasks", "4", "--eval-chunk", "4", "--out", str(out), "--wandb", "disabled"),
            *extra,
        ]
        printed = io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
            mp.setenv("WANDB_MODE", "disabled")
            mp.setenv("WANDB_DIR", str(out.parent))
            mp.setenv("MAML_CACHE_DIR", str(cache))
            mp.setattr(report, "save_figure", kept)
            if cwd is not None:
                mp.chdir(cwd)
            main(omniglot.run, args)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return Run(out, printed.getvalue(), json.loads((out / "results.json").read_text()), rows, figures)

    return run


@pytest.fixture(scope="module")
def every_iteration(run) -> Run:
    return run("every-iteration", "--log-every", "1")


@pytest.fixture(scope="module")
def every_third(run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same run logged every third iteration, from another folder, with --data relative to it."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return run("every-third", "--log-every", "3", data=os.path.relpath(omniglot_root(), elsewhere), cwd=elsewhere)


def test_results_json_records_the_data_by_name_contents_and_fingerprint_not_by_a_path(every_iteration, every_third):
    root = omniglot_root().resolve()
    record = every_iteration.results["data_files"]["data"]
    holds = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert record == {"name": root.name, "holds": holds, "fingerprint": fingerprint(str(root))}
    assert every_iteration.results["config"]["data"] == root.name
    # Spelled another way from another folder: the same record, as the same data.
    assert every_third.results["data_files"] == every_iteration.results["data_files"]
    assert every_third.results["config"]["data"] == root.name
    for run in (every_iteration, every_third):
        written = json.dumps(run.results)
        for path in (str(root), str(root.parent), os.path.relpath(root), str(run.out)):
            assert path not in written, path


def test_the_task_grid_title_lies_inside_the_figure(every_iteration):
    fig = every_iteration.figures["task_grid.png"]
    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure as saved (closed, it lost pyplot's canvas)
    fig.draw(renderer)
    box = fig.bbox
    titles = [t for t in fig.texts if t.get_text()] + [ax.title for ax in fig.axes if ax.title.get_text()]
    assert fig.texts and titles
    for title in titles:
        extent = title.get_window_extent(renderer)
        inside = box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1
        assert inside, (title.get_text(), extent.bounds, box.bounds)
    assert (every_iteration.out / "task_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_training_accuracy_is_a_mean_over_the_log_window_as_the_meta_loss_is(every_iteration, every_third):
    """Logged every third iteration, a row's accuracy is the mean of the three iterations' (each logged alone in the
    same run logged every iteration), as its meta-loss is: not one meta-batch's, in steps of 1/40."""
    single = {r["iteration"]: r for r in every_iteration.rows}
    assert sorted(single) == list(range(1, ITERATIONS + 1))
    assert [r["iteration"] for r in every_third.rows] == [3, 6]
    for row in every_third.rows:
        window = [single[i] for i in range(row["iteration"] - 2, row["iteration"] + 1)]
        for key in ("train/meta_loss", "train/accuracy"):
            assert row[key] == pytest.approx(sum(r[key] for r in window) / 3, abs=1e-12), (row["iteration"], key)
    accuracies = [r["train/accuracy"] for r in every_iteration.rows]
    assert len(set(accuracies)) > 1  # the windows' means differ from their last iteration's value


@pytest.mark.parametrize("by", ["alphabet", "character"])
def test_the_test_line_names_the_unit_the_split_held_out(run, every_iteration, by):
    done = every_iteration if by == "alphabet" else run("by-character", "--split-by", "character", "--log-every", "6")
    test_part = {
        "alphabet": len(done.results["data"]["alphabets"][2]),
        "character": done.results["data"]["characters"][2],
    }
    count = test_part[by]
    assert count > 1
    assert f"5-way 1-shot test accuracy on 4 tasks of {count} held-out {by}s (last:" in done.printed, done.printed
    other = {"alphabet": "character", "character": "alphabet"}[by]
    assert f"held-out {other}" not in done.printed
    # docs/experiments.md quotes the line on the same data (with the default 600 test tasks).
    assert f"`600 tasks of {count} held-out {by}s`" in (REPO / "docs" / "experiments.md").read_text()
