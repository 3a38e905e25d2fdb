"""The README's result tables are rendered from the committed result files, and those files hold no machine path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import REPO

from tools import tables


def test_every_page_is_the_rendering_of_its_tables():
    names: set[str] = set()
    for page in tables.pages():
        text = page.read_text()
        names |= {m.group("name") for m in tables.BLOCK.finditer(text)}
        assert tables.render(text, page.name) == text, f"{page.name} is stale: run python -m tools.tables"
    assert names == set(tables.RENDERERS)  # every renderer has its page


def test_a_committed_table_edited_by_hand_fails_the_check(tmp_path, capsys):
    for page in tables.pages():
        text = page.read_text()
        blocks = list(tables.BLOCK.finditer(text))
        if not blocks:
            continue
        body = blocks[0].group("body")
        edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), body, count=1)
        copy = tmp_path / page.name
        copy.write_text(text.replace(body, edited, 1))
        assert tables.main(["--check", "--page", str(copy)]) == 1, page
        assert "is stale from line" in capsys.readouterr().err


def test_committed_results_hold_no_path_of_a_machine():
    files = [p for p in (REPO / "results").rglob("*") if p.suffix in (".json", ".jsonl")]
    assert files
    for path in files:
        assert not re.search(r'"/(work|tmp|home|root|Users)/', path.read_text()), path


def trial(
    folder: Path, algorithm: str, seed: int, accuracy: float, best: float, engine: str = "maml", ways: int = 5
) -> dict:
    results = {
        "experiment": "omniglot",
        "config": {
            "algorithm": algorithm,
            "seed": seed,
            "engine": engine,
            "iterations": 2000,
            "ways": ways,
            "shots": 1,
            "val_every": 100,
        },
        "iterations": 2000,
        "train_seconds": 600.0,
        "device": "cpu",
        "threads": 1,
        "date": "2026-11-24",
        "git_commit": "0123456789abcdef",
        "git_dirty": False,
        "best_val": {"iteration": 1500, "val/accuracy": 0.7},
        "test": {s: {"accuracy": accuracy, "ci95": 0.01, "tasks": 600} for s in tables.STEPS},
        "test_best": {s: {"accuracy": best, "ci95": 0.01, "tasks": 600} for s in tables.STEPS},
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    return results


def sweep_file(sweep: Path, algorithms: list[str], seeds: list[int]) -> list[str]:
    """A ``sweep.json`` with the grid ``algorithms`` x ``seeds``; its trials' folder names."""
    params = [{"algorithm": a, "seed": s} for a in algorithms for s in seeds]
    names = [f"trial-{i:03d}" for i in range(1, len(params) + 1)]
    sweep.mkdir(parents=True)
    grid = {"parameters": {"algorithm": {"values": algorithms}, "seed": {"values": seeds}}}
    report = {
        "sweep": {"file": "experiments/sweeps/x.yaml", "config": grid},
        "trials": [{"name": n, "params": p} for n, p in zip(names, params)],
    }
    (sweep / "sweep.json").write_text(json.dumps(report))
    return names


def test_the_seed_table_gives_mean_and_std_over_finished_seeds_and_names_the_pending_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "REPO", tmp_path)
    sweep = tmp_path / "results" / "seeds"
    names = sweep_file(sweep, ["maml", "anil"], [0, 1])
    trial(sweep / names[0], "maml", 0, accuracy=0.80, best=0.90)
    trial(sweep / names[1], "maml", 1, accuracy=0.60, best=0.70)
    text = tables.omniglot_seeds([sweep])
    row = next(line for line in text.splitlines() if line.startswith("| `maml`"))
    # best validation: mean 80.0, std sqrt(2) * 10 = 14.1; last parameters: 70.0 +- 14.1
    assert (
        row
        == "| `maml` | 2 of 2 (0, 1) | 2000 | 80.0 +- 14.1 | 80.0 +- 14.1 | 80.0 +- 14.1 | 70.0 +- 14.1 | 1500, 1500 | 10 |"
    )
    assert "Without results here: `anil` (2 seeds) (trials of the sweeps; `--resume` runs them)." in text
    assert "Sweeps: `python -m experiments.sweep experiments/sweeps/x.yaml --out results/seeds`" in text
    assert "commit 0123456789; device cpu" not in text and "2026-11-24; commit 0123456789" in text
    assert "5-way 1-shot test accuracy % on 600 tasks" in text and "(every 100 iterations, `best.pt`)" in text


def test_the_seed_table_names_the_runs_task_and_shows_one_seed_without_a_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "REPO", tmp_path)
    sweep = tmp_path / "results" / "20way"
    (name,) = sweep_file(sweep, ["maml"], [0])
    trial(sweep / name, "maml", 0, accuracy=0.60, best=0.65, ways=20)
    text = tables.omniglot_seeds([sweep])
    assert "| `maml` | 1 of 1 (0) | 2000 | 65.0 | 65.0 | 65.0 | 60.0 | 1500 | 10 |" in text.splitlines()
    assert "\n20-way 1-shot test accuracy % on 600 tasks" in text and "5-way" not in text


def test_check_says_which_line_is_stale_and_bad_blocks_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(tables.RENDERERS, "demo", lambda: "fresh\n")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- table: demo -->\nold\n<!-- /table -->\n")
    assert tables.main(["--check", "--page", str(readme)], root=tmp_path) == 1
    assert capsys.readouterr().err == "README.md is stale from line 3: run python -m tools.tables\n"
    assert tables.main(["--page", str(readme)], root=tmp_path) == 0
    assert readme.read_text() == "# x\n<!-- table: demo -->\nfresh\n<!-- /table -->\n"
    assert tables.main(["--check", "--page", str(readme)], root=tmp_path) == 0
    readme.write_text("<!-- table: nope -->\n<!-- /table -->\n")
    assert tables.main(["--page", str(readme)], root=tmp_path) == 2
    assert capsys.readouterr().err.startswith("error: README.md:1: no renderer for the table block 'nope' (known: ")


def copy_pages(root: Path) -> dict[Path, bytes]:
    """Copies the repository's pages (README.md, docs/*.md) under ``root``: each copy and its bytes."""
    copies = {}
    for page in tables.pages():
        copy = root / page.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(page.read_bytes())
        copies[copy] = copy.read_bytes()
    return copies


def markers(lines: list[str]) -> list[int]:
    """The 0-based indices of ``lines`` that are table markers, opening or closing."""
    return [i for i, line in enumerate(lines) if tables.OPEN.fullmatch(line) or line == tables.CLOSE]


def damaged(tmp_path: Path, edit) -> tuple[dict[Path, bytes], list[str]]:
    """The pages copied under ``tmp_path`` with README.md's lines passed through ``edit``; the README's old lines."""
    copies = copy_pages(tmp_path)
    readme = tmp_path / "README.md"
    lines = readme.read_text().split("\n")
    readme.write_text("\n".join(edit(list(lines))))
    copies[readme] = readme.read_bytes()
    return copies, lines


def refused(tmp_path: Path, copies: dict[Path, bytes], capsys, check: list[str]) -> str:
    """Runs the tables on the copied pages, expects exit 2 and every page as it was; the one error line."""
    assert tables.main(check, root=tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for page, before in copies.items():
        assert page.read_bytes() == before, page
    return err


CHECK = pytest.mark.parametrize("check", [[], ["--check"]], ids=["write", "check"])


@CHECK
def test_a_deleted_end_marker_names_its_block_and_writes_nothing(tmp_path, capsys, check):
    def edit(lines: list[str]) -> list[str]:
        del lines[markers(lines)[1]]  # the first block's end
        return lines

    copies, lines = damaged(tmp_path, edit)
    opening, _, following = markers(lines)[:3]
    first, second = (tables.OPEN.fullmatch(lines[i]).group("name") for i in (opening, following))
    # Line numbers are 1-based; the next block's opening moved up a line with the deleted end.
    assert refused(tmp_path, copies, capsys, check) == (
        f"error: README.md:{opening + 1}: the table block {first!r} has no end before line {following} opens the "
        f"block {second!r}: write `<!-- /table -->` alone on the line after its table (blocks do not nest)\n"
    )


@CHECK
@pytest.mark.parametrize(
    ("which", "spelt", "meant"),
    [
        (1, "<!-- /table-->", "`<!-- /table -->`"),
        (1, "<!-- /Table -->", "`<!-- /table -->`"),
        (1, "text <!-- /table -->", "`<!-- /table -->`"),
        (0, "<!--table: {name}-->", "`<!-- table: {name} -->`"),
        (0, "<!-- TABLE: {name} -->", "`<!-- table: {name} -->`"),
    ],
)
def test_a_misspelt_marker_is_named_with_what_to_write_and_writes_nothing(tmp_path, capsys, check, which, spelt, meant):
    def edit(lines: list[str]) -> list[str]:
        at = markers(lines)[which]
        lines[at] = spelt.format(name=tables.OPEN.fullmatch(lines[markers(lines)[0]]).group("name"))
        return lines

    copies, lines = damaged(tmp_path, edit)
    at, name = markers(lines)[which], tables.OPEN.fullmatch(lines[markers(lines)[0]]).group("name")
    assert refused(tmp_path, copies, capsys, check) == (
        f"error: README.md:{at + 1}: {spelt.format(name=name)!r} is not a table marker: write "
        f"{meant.format(name=name)} alone on the line\n"
    )


@CHECK
def test_an_unknown_table_name_is_named_with_the_known_ones_and_writes_nothing(tmp_path, capsys, check):
    def edit(lines: list[str]) -> list[str]:
        lines[markers(lines)[0]] = "<!-- table: no-such-table -->"
        return lines

    copies, lines = damaged(tmp_path, edit)
    assert refused(tmp_path, copies, capsys, check) == (
        f"error: README.md:{markers(lines)[0] + 1}: no renderer for the table block 'no-such-table' (known: "
        f"{', '.join(tables.RENDERERS)}): write `<!-- table: NAME -->` with one of those names\n"
    )


@CHECK
def test_a_block_opened_inside_another_is_an_error_and_writes_nothing(tmp_path, capsys, check):
    def edit(lines: list[str]) -> list[str]:
        lines.insert(markers(lines)[0] + 1, "<!-- table: recipes -->")
        return lines

    copies, lines = damaged(tmp_path, edit)
    opening = markers(lines)[0]
    name = tables.OPEN.fullmatch(lines[opening]).group("name")
    assert refused(tmp_path, copies, capsys, check) == (
        f"error: README.md:{opening + 1}: the table block {name!r} has no end before line {opening + 2} opens the "
        f"block 'recipes': write `<!-- /table -->` alone on the line after its table (blocks do not nest)\n"
    )


@CHECK
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            "<!-- /table -->",
            "error: docs/a.md:2: `<!-- /table -->` ends no table block: delete it, or write "
            "`<!-- table: NAME -->` alone on a line where its table starts\n",
        ),
        (
            "<!-- table: demo -->",
            "error: docs/a.md:2: the table block 'demo' has no end: write `<!-- /table -->` "
            "alone on the line after its table\n",
        ),
        ("<!-- table: broken -->\n<!-- /table -->", "error: results/broken.json: missing\n"),
    ],
)
def test_an_error_on_one_page_leaves_the_sound_stale_pages_unwritten(tmp_path, capsys, monkeypatch, check, bad, error):
    def broken() -> str:
        raise tables.TableError("results/broken.json: missing")

    monkeypatch.setitem(tables.RENDERERS, "demo", lambda: "fresh\n")
    monkeypatch.setitem(tables.RENDERERS, "broken", broken)
    monkeypatch.setattr(tables, "PAGES", ("README.md", "docs"))
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "a.md"
    page.parent.mkdir()
    readme.write_text("# x\n<!-- table: demo -->\nold\n<!-- /table -->\n")  # stale, and sound
    page.write_text(f"# a\n{bad}\n")
    copies = {readme: readme.read_bytes(), page: page.read_bytes()}
    assert refused(tmp_path, copies, capsys, check) == error
    page.write_text("# a\n")
    assert tables.main([], root=tmp_path) == 0  # once the other page is sound, the stale one is rendered
    assert readme.read_text() == "# x\n<!-- table: demo -->\nfresh\n<!-- /table -->\n"


def test_the_command_names_only_the_flags_that_differ_from_the_recipes_defaults():
    from experiments import omniglot

    cfg = json.loads(
        json.dumps(
            omniglot.OmniglotConfig(algorithm="mamlpp", iterations=2000, val_every=100, data="x").resolved().__dict__
        )
    )
    cfg.update(
        {
            "steps": 5,
            "learn_inner_lr": "per_layer_per_step",
            "loss": "mean",
            "inner_lr": 0.1,
            "meta_batch": 8,
            "msl_fraction": 0.1,
            "first_order_fraction": 0.5,
            "meta_lr_schedule": "cosine",
            "per_step_bn": True,
        }
    )  # the recipe's
    assert tables.command({"experiment": "omniglot", "config": cfg}) == (
        "python -m experiments.omniglot --iterations 2000 --algorithm mamlpp --val-every 100 --data DIR"
    )


def test_the_learning_curve_averages_each_window_and_skips_windows_without_a_validation(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "REPO", tmp_path)
    run = tmp_path / "results" / "gpu" / "maml-seed0"
    run.mkdir(parents=True)
    config = {"algorithm": "maml", "ways": 5, "shots": 1, "seed": 0, "val_tasks": 100, "val_every": 10}
    (run / "results.json").write_text(json.dumps({"config": config, "iterations": 45}))
    rows = [{"iteration": i, "train/meta_loss": i / 10} for i in range(5, 50, 5)]
    for row, accuracy in zip(rows[1::2], (0.5, 0.7, 0.9, 0.8)):  # validations at 10, 20, 30, 40
        row["val/accuracy"] = accuracy
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tables.learning_curve(tmp_path / "results" / "gpu", window=20).splitlines()
    assert table[-2:] == ["| 1-20 | 2 | 60.0 | 70.0 | 1.250 |", "| 21-40 | 2 | 85.0 | 90.0 | 3.250 |"]
    assert "results/gpu/maml-seed0/metrics.jsonl" in table[0]  # 41-45 has no validation: no row


def memory_run(path: Path, cells: dict[tuple[str, int], float | str], *, complete: bool, commit: str) -> Path:
    """A ``benchmarks/memory.py --device cuda --json`` file with one result per (method, steps) of ``cells``."""
    results = [
        {"method": m, "steps": n, "tasks": 8, "error": v}
        if isinstance(v, str)
        else {"method": m, "steps": n, "tasks": 8, "tensor_mib": v, "extra_mib": v, "seconds": 1.0}
        for (m, n), v in cells.items()
    ]
    report = {
        "command": f"python -m benchmarks.memory --json {path.name}",
        "device": "cuda",
        "gpu": "GPU",
        "versions": {"torch": "2.0"},
        "git_commit": commit,
        "git_dirty": False,
        "threads": 1,
        "date": "2026-11-26",
        "setting": {
            "tasks": 8,
            "ways": 5,
            "shots": 5,
            "query": 15,
            "batching": "auto",
            "repeats": 0,
            "limit_gib": 10.0,
        },
        "methods": ["a", "b"],
        "steps": sorted({n for _, n in cells}),
        "complete": complete,
        "results": results,
    }
    path.write_text(json.dumps(report))
    return path


def test_the_memory_table_fills_a_stopped_runs_cells_from_later_runs_and_names_each(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "REPO", tmp_path)
    main = memory_run(tmp_path / "main.json", {("a", 20): 100.0, ("b", 20): 200.0}, complete=False, commit="1" * 40)
    five = memory_run(
        tmp_path / "five.json", {("a", 5): 10.0, ("b", 5): 20.0, ("a", 20): 999.0}, complete=False, commit="2" * 40
    )
    text = tables.memory(main, [five])
    assert "| `a` | 10 MiB, 1.0 s | 100 MiB, 1.0 s |" in text  # the main run's cell wins over a later one's
    assert "| `b` | 20 MiB, 1.0 s | 200 MiB, 1.0 s |" in text
    assert "The cells of 5 steps not in the first run: `python -m benchmarks.memory --json five.json`" in text
    # a run that fills no cell is not named; a part that does not exist is skipped
    assert tables.memory(main, [five, five, tmp_path / "absent.json"]) == text
    assert "commit 1111111111" in text and "commit 2222222222" in text
    assert "stopped" not in text  # every cell is filled
    late = memory_run(tmp_path / "late.json", {("b", 80): "ImportError: no module"}, complete=True, commit="3" * 40)
    text = tables.memory(main, [late])
    assert "| `a` | 100 MiB, 1.0 s | - |" in text and "| `b` | 200 MiB, 1.0 s | error (ImportError) |" in text
    assert "The run was stopped before its last configurations: - did not run." in text  # (a, 80) is missing
    other = memory_run(tmp_path / "other.json", {("a", 5): 1.0}, complete=True, commit="4" * 40)
    other.write_text(other.read_text().replace('"ways": 5', '"ways": 20'))
    with pytest.raises(tables.TableError, match="other.json: another setting than main.json's"):
        tables.memory(main, [other])


def test_a_run_from_a_tree_with_uncommitted_changes_is_refused_by_every_table():
    run = {"command": "python -m experiments.sine", "device": "cpu", "git_commit": "0" * 40, "git_dirty": True}
    with pytest.raises(tables.TableError, match="'python -m experiments.sine' ran in a tree with uncommitted changes"):
        tables.provenance([{**run, "git_dirty": False}, run])
    assert "0000000000" in tables.provenance([{**run, "git_dirty": False}])


START = {"at": "start", "iteration": 0, "git_commit": "b" * 40, "git_dirty": False, "git_changes": None}


@pytest.mark.parametrize(
    ("history", "refusal"),
    [
        ([{**START, "git_dirty": True, "git_changes": "0123"}], "started in a tree with uncommitted changes"),
        ([{**START, "git_commit": "a" * 40}], "started at commit aaaaaaaaaa and ended at bbbbbbbbbb"),
        (
            [START, {**START, "at": "resume", "iteration": 4, "git_commit": "a" * 40}],
            "was resumed at commit aaaaaaaaaa and ended at bbbbbbbbbb",
        ),
    ],
    ids=["started dirty, ended clean", "started at A, ended at B", "resumed at A, ended at B"],
)
def test_a_run_whose_code_at_start_or_resume_is_not_its_end_is_refused(history, refusal):
    run = {"command": "python -m experiments.sine", "device": "cpu", "git_commit": "b" * 40, "git_dirty": False}
    with pytest.raises(tables.TableError, match=f"^'python -m experiments.sine' {refusal}: run it again"):
        tables.provenance([{**run, "git_history": history}])
    # One commit from start to end: only the commit, which is the start's as well.
    assert tables.provenance([{**run, "git_history": [START]}]).endswith("; commit bbbbbbbbbb")


@pytest.mark.parametrize("commit", [{"git_commit": None, "git_dirty": None}, {}], ids=["None", "missing"])
def test_a_run_without_a_commit_is_refused(commit):
    run = {"command": "python -m experiments.sine", "device": "cpu", **commit}
    with pytest.raises(tables.TableError, match="^'python -m experiments.sine' records no git commit"):
        tables.provenance([run])


def test_results_from_before_the_start_was_recorded_say_their_commit_is_the_ends():
    run = {"command": "python -m experiments.sine", "device": "cpu", "date": "2026-11-24", "git_commit": "b" * 40}
    run["git_dirty"] = False
    assert tables.provenance([run]).endswith("; commit bbbbbbbbbb (taken at the run's end; its start was not recorded)")
    assert tables.provenance([run, run]).endswith("(taken at each run's end; its start was not recorded)")
    assert tables.provenance([run, {**run, "git_history": [START]}]).endswith(
        "; commit bbbbbbbbbb (taken at the end for 1 of the 2 runs, whose start was not recorded)"
    )
    with pytest.raises(tables.TableError, match="ran in a tree with uncommitted changes"):
        tables.provenance([{**run, "git_dirty": True}])


@pytest.mark.parametrize(
    ("fence", "inside", "end"),
    [("```", "", "```"), ("~~~", "```\n", "~~~"), ("````markdown", "```\n", "````")],
    ids=["backticks", "tildes around backticks", "four backticks around three"],
)
def test_markers_in_a_fenced_code_block_are_text(tmp_path, monkeypatch, fence, inside, end):
    """A page that shows the marker syntax in a code block: nothing is rendered into it, nor is a misspelt marker
    there an error; the blocks outside it are rendered (the second copy: a fence indented in a list item)."""
    monkeypatch.setitem(tables.RENDERERS, "demo", lambda: "fresh\n")
    shown = f"{fence}\n<!-- table: demo -->\nold\n<!-- /table -->\n<!-- Table: misspelt -->\n{inside}{end}\n"
    page = tmp_path / "README.md"
    page.write_text(f"# x\n{shown}<!-- table: demo -->\nold\n<!-- /table -->\n- a list item:\n  {shown}")
    assert tables.main(["--page", str(page)], root=tmp_path) == 0
    assert page.read_text() == f"# x\n{shown}<!-- table: demo -->\nfresh\n<!-- /table -->\n- a list item:\n  {shown}"
