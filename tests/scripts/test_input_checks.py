"""Inputs the scripts check before running: each is one line naming the flag, the value and the fix (exit 2,
nothing written), or a note where the input is kept but overridden."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from helpers import omniglot_root, one_error, run_sine, says

from experiments import omniglot, sine
from experiments import sweep as sweep_cli
from experiments.harness import failures as memory
from experiments.harness.config import parse_args
from experiments.harness.folder import UsageError


@pytest.mark.parametrize(
    "args, lead, fixes",
    [
        (["--rate-meta-lr", "0.1"], "--rate-meta-lr 0.1", ("drop it", "--learn-inner-lr")),
        (
            ["--meta-lr-schedule", "cosine", "--min-meta-lr", "0.01"],
            "--min-meta-lr 0.01",
            ("--meta-lr 0.001", "pass a --min-meta-lr below --meta-lr"),
        ),
    ],
)
def test_flags_that_would_do_nothing_or_the_opposite_are_refused(capsys, tmp_path, args, lead, fixes):
    out = tmp_path / "run"
    says(one_error(run_sine(capsys, [*args, "--out", str(out)], code=2)), lead, *fixes)
    assert not out.exists()


def test_one_way_tasks_are_refused(capsys, tmp_path):
    out = tmp_path / "run"
    err = run_sine(capsys, ["--ways", "1", "--out", str(out)], code=2, module=omniglot)
    says(one_error(err), "--ways 1", "pass --ways 2 or more")
    assert not out.exists()


TRILLION = "1000000000000"


@pytest.mark.parametrize(
    "flag, needs",
    [
        ("--hidden", "--hidden: the network's weights, meta-gradient, and one task's support gradient and fast weights "
         "need more than PyTorch can count"),
        ("--meta-batch", "--meta-batch, --shots, --query, --hidden: the training meta-batch's points and one task's "
         "first hidden layer need at least 160.0 TB"),
        ("--shots", "--val-tasks, --shots, --query: the validation tasks' points need at least 800.0 TB"),
        ("--query", "--val-tasks, --shots, --query: the validation tasks' points need at least 800.0 TB"),
        ("--val-tasks", "--val-tasks, --shots, --query: the validation tasks' points need at least 160.0 TB"),
        ("--eval-tasks", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 840.0 TB"),
        ("--eval-shots", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 4.8 PB"),
        ("--eval-query", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 4.8 PB"),
    ],
)  # fmt: skip  # one flag and its line per row
def test_a_size_whose_tensors_cannot_fit_is_one_line_with_its_estimate(capsys, tmp_path, flag, needs):
    out = tmp_path / "run"
    # The defaults of the sine script, with one size at 10^12 (the tests' small sizes would change the estimates).
    args = ["--hidden", "40", "--meta-batch", "25", "--val-tasks", "100", "--eval-tasks", "600", "--eval-query", "100"]
    line = one_error(run_sine(capsys, [*args, flag, TRILLION, "--out", str(out)], code=2))
    assert line.startswith(f"error: {needs}, and this machine has "), line
    assert line.endswith(" of memory free; lower " + ("it." if flag == "--hidden" else "the one set too high."))
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--filters", "--meta-batch", "--eval-tasks"])
def test_an_omniglot_size_whose_tensors_cannot_fit_is_one_line(capsys, tmp_path, flag):
    out = tmp_path / "run"
    args = ["--data", str(omniglot_root()), flag, TRILLION, "--out", str(out)]
    line = one_error(run_sine(capsys, args, code=2, module=omniglot))
    assert line.startswith(f"error: {flag}") and "of memory free; lower the one set too high." in line, line
    assert not out.exists()


def test_more_threads_than_cpus_are_refused(capsys, tmp_path):
    out = tmp_path / "run"
    cpus = len(os.sched_getaffinity(0))
    line = one_error(run_sine(capsys, ["--threads", TRILLION, "--out", str(out)], code=2))
    says(line, f"--threads {TRILLION}", f"{cpus} CPUs", f"pass 1 to {cpus}")
    assert not out.exists()


@pytest.mark.parametrize("where", ["training", "the final test"])
def test_an_allocation_that_fails_all_the_same_is_one_line_naming_the_size_flags(capsys, tmp_path, monkeypatch, where):
    """What the lower bounds let through (a model's activations, say) and PyTorch then cannot allocate: PyTorch's own
    error, caught where it happens, is one line with the bytes it asked for, the size flags and the checkpoint kept."""

    def allocate(*args: object, **kwargs: object) -> None:
        torch.empty(1 << 60, dtype=torch.uint8)  # an exabyte: PyTorch's allocator refuses it, as it would any too big

    from experiments.harness.trainer import Trainer

    monkeypatch.setattr(*((Trainer, "run") if where == "training" else (sine, "evaluate")), allocate)
    out = tmp_path / "run"
    line = one_error(run_sine(capsys, ["--iterations", "2", "--out", str(out)], code=1))
    says(line, "out of memory", f"{1 << 60} bytes", "lower --hidden, --meta-batch, --shots, --query", "--memory-budget")
    kept = "no checkpoint was written" if where == "training" else f"{out / 'checkpoint.pt'} keeps meta-iteration 2"
    assert line.endswith(f"The run stopped; {kept}."), line
    assert not (out / "results.json").exists()


def test_the_memory_check_refuses_only_what_cannot_fit():
    free = memory.free_bytes(torch.device("cpu"))
    assert free is not None and free > 0
    memory.check_fits([memory.Need("a small thing", "--small", free // 2)], torch.device("cpu"))
    with pytest.raises(UsageError, match=r"^--big: a big thing need at least .*; lower it\.$"):
        memory.check_fits([memory.Need("a big thing", "--big", 2 * free)], torch.device("cpu"))


def test_a_key_given_twice_in_a_config_file_is_refused(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("iterations: 2\nhidden: 8\niterations: 3\n")
    line = one_error(run_sine(capsys, ["--config", str(config), "--out", str(tmp_path / "run")], code=2))
    says(line, f"--config {config}", "line 3", "'iterations'", "keep one")


def test_resume_says_that_a_hand_edited_config_yaml_is_not_what_it_continues(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["--iterations", "2", "--eval-tasks", "2", "--out", str(out)]
    run_sine(capsys, args)
    path = out / "config.yaml"
    path.write_text(path.read_text().replace("hidden: 8", "hidden: 9"))
    err = run_sine(capsys, [*args[:1], "3", *args[2:], "--resume"])
    assert (
        f"note: {path} was edited (hidden); --resume continues with the run's config, kept in its checkpoint, "
        f"and writes config.yaml anew (a resumable key changes by its flag)"
    ) in err.splitlines()
    assert "hidden: 8" in path.read_text()


# ---------------------------------------------------------------------------- sizes, counts and modes that cannot run


def parse_sine(tmp_path: Path, argv: list[str]) -> sine.SineConfig:
    """The sine config that ``argv`` makes, checked as the script checks it (nothing is written)."""
    cfg, _ = parse_args("sine", sine.SineConfig, [*argv, "--out", str(tmp_path / "run")], "", sine.validate_config)
    return cfg


@pytest.mark.parametrize(
    "args, lead, fix",
    [
        (["--algorithm", "imaml", "--cg-iterations", TRILLION], f"--cg-iterations {TRILLION}", "pass at most 1000"),
        (["--steps", TRILLION], f"--steps {TRILLION}", "pass at most 10000"),
        (["--eval-steps", f"1,{TRILLION}"], f"--eval-steps 1,{TRILLION}", "pass values up to 10000"),
    ],
    ids=["cg-iterations", "steps", "eval-steps"],
)
def test_counts_whose_loops_cannot_finish_are_refused(capsys, tmp_path, args, lead, fix):
    # Unchecked, each would run its first meta-iteration (or the evaluation) for hours: --cg-iterations 10^12 is
    # still in its first iteration after 11 minutes.
    out = tmp_path / "run"
    says(one_error(run_sine(capsys, [*args, "--iterations", "20", "--out", str(out)], code=2)), lead, fix)
    assert not out.exists()


def test_the_bounds_refuse_no_published_protocol_and_iterations_stay_unbounded(tmp_path):
    # MAML++ 5 steps, iMAML 16-25 steps and 5-20 CG iterations, Reptile's evaluation at 50 steps: all pass,
    # and so does the bound itself; --iterations is a Python integer, which overflows nothing.
    cfg = parse_sine(tmp_path, ["--algorithm", "imaml", "--steps", "25", "--cg-iterations", "20"])
    assert (cfg.steps, cfg.cg_iterations) == (25, 20)
    cfg = parse_sine(tmp_path, ["--steps", "10000", "--eval-steps", "1,50,10000"])
    assert (cfg.steps, cfg.eval_steps) == (10_000, (1, 50, 10_000))
    assert parse_sine(tmp_path, ["--algorithm", "imaml", "--cg-iterations", "1000"]).cg_iterations == 1000
    assert parse_sine(tmp_path, ["--iterations", str(10**30)]).iterations == 10**30


@pytest.mark.parametrize(
    "args, mode",
    [
        (["--algorithm", "reptile"], "reptile"),
        (["--algorithm", "imaml"], "implicit"),
        (["--mode", "reptile"], "reptile"),
        (["--mode", "implicit"], "implicit"),
    ],
)
def test_first_order_fraction_without_an_unrolled_inner_loop_is_refused(capsys, tmp_path, args, mode):
    out = tmp_path / "run"
    err = run_sine(capsys, [*args, "--first-order-fraction", "0.5", "--iterations", "2", "--out", str(out)], code=2)
    says(one_error(err), "--first-order-fraction 0.5", f"--mode {mode}", "drop it", "pick another --mode")
    assert not out.exists()


@pytest.mark.parametrize(
    "args, lead, mode",
    [
        (["--cg-iterations", "10"], "--cg-iterations 10", "second_order"),
        (["--algorithm", "reptile", "--implicit-lam", "2"], "--implicit-lam 2", "reptile"),
        (  # a value the user passed is refused even where it equals the default
            ["--algorithm", "imaml", "--mode", "first_order", "--cg-iterations", "5"],
            "--cg-iterations 5",
            "first_order",
        ),
    ],
    ids=["cg-iterations", "implicit-lam-reptile", "recipe-overridden"],
)
def test_implicit_keys_given_with_another_mode_are_refused(capsys, tmp_path, args, lead, mode):
    out = tmp_path / "run"
    line = one_error(run_sine(capsys, [*args, "--iterations", "2", "--out", str(out)], code=2))
    says(line, lead, f"--mode {mode}", "drop it", "pass --mode implicit")
    assert not out.exists()


def test_implicit_keys_in_a_config_file_are_refused_only_where_they_differ_from_the_recipe(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("mode: reptile\nimplicit_lam: 0.5\niterations: 2\n")
    err = run_sine(capsys, ["--config", str(config), "--out", str(tmp_path / "run")], code=2)
    says(one_error(err), f"--config {config}: implicit_lam 0.5", "--mode reptile", "drop it", "pass --mode implicit")
    assert not (tmp_path / "run").exists()
    # A run's own config.yaml holds every key, at the default or the recipe's value: it is read back as it was.
    config.write_text("algorithm: imaml\nmode: first_order\nimplicit_lam: 2.0\ncg_iterations: 5\n")
    assert parse_sine(tmp_path, ["--config", str(config)]).implicit_lam == 2.0
    # The recipe's values, left alone, are no user's: --algorithm imaml with another mode passes.
    assert parse_sine(tmp_path, ["--algorithm", "imaml", "--mode", "second_order"]).mode == "second_order"


@pytest.mark.parametrize(
    "args, mode",
    [(["--algorithm", "reptile"], "reptile"), (["--mode", "implicit"], "implicit")],
    ids=["reptile", "implicit"],
)
def test_zero_steps_where_the_meta_gradient_needs_inner_steps_are_refused(capsys, tmp_path, args, mode):
    out = tmp_path / "run"
    line = one_error(run_sine(capsys, [*args, "--steps", "0", "--iterations", "2", "--out", str(out)], code=2))
    says(line, f"--steps 0 with --mode {mode}", "pass --steps 1 or more")
    assert not out.exists()
    # MAML's meta-gradient at 0 steps is the query loss's gradient at the meta-parameters (joint training): kept.
    assert parse_sine(tmp_path, ["--steps", "0"]).steps == 0


@pytest.mark.parametrize(
    "args, named",
    [
        (["--shots", "30"], "--shots 30 --query 30"),  # --train-shots defaults to --shots: the user set --shots
        (["--train-shots", "30"], "--train-shots 30 --query 1"),
    ],
    ids=["shots", "train-shots"],
)
def test_an_omniglot_size_error_names_the_flag_the_user_set(capsys, tmp_path, monkeypatch, args, named):
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--data", str(omniglot_root()), *args, "--iterations", "1", "--eval-tasks", "2", "--out", str(out)]
    line = one_error(run_sine(capsys, argv, code=2, module=omniglot))
    assert line.startswith(f"error: {named}, the train split: shots + query = "), line
    assert not out.exists()


def write_sweep(path: Path, parameters: str) -> None:
    """A grid sweep of tests/scripts/sweep_program.py whose ``parameters:`` block is ``parameters`` (YAML, indented)."""
    path.write_text(
        "name: t\nprogram: tests/scripts/sweep_program.py\nmethod: grid\nmetric: {name: val/score, goal: minimize}\n"
        f"parameters:\n{parameters}"
    )


SCALAR = "give it a number, a string or a bool"  # the fix for a mapping where a flag's value goes


@pytest.mark.parametrize(
    "parameters, line, fixes",
    [
        ("  x:\n    values: [1.0, 2.0]\n  x:\n    values: [3.0]\n", 8, ("'x'", "keep one")),
        ("  x:\n    values: [1.0]\n    values: [2.0]\n", 8, ("'values'", "keep one")),
        (
            "  y:\n    values: [1]\n  x:\n    parameters:\n      lr: {values: [0.1, 0.01]}\n",
            9,
            ("'x'", "give each flag its own entry under parameters"),
        ),
        ("  x:\n    values: [1.0]\n  y:\n    value: {a: 1}\n", 9, ("'y'", "{'a': 1}", "--y=VALUE", SCALAR)),
        ("  x:\n    values: [1.0, {b: 2}]\n", 7, ("'x'", "{'b': 2}", "--x=VALUE", SCALAR)),
    ],
    ids=["duplicate-parameter", "duplicate-values", "nested-parameters", "mapping-value", "mapping-among-values"],
)
def test_a_sweep_file_key_that_would_be_dropped_is_refused_with_its_line(tmp_path, parameters, line, fixes):
    path = tmp_path / "sweep.yaml"
    write_sweep(path, parameters)
    stdout, stderr = io.StringIO(), io.StringIO()
    assert sweep_cli.main([str(path), "--dry-run"], stdout, stderr) == 2
    says(stderr.getvalue(), str(path), f"line {line}", *fixes)
    assert stdout.getvalue() == ""


def test_a_folder_without_a_checkpoint_names_overwrite_not_a_loop_of_resume_and_no_resume(capsys, tmp_path):
    # What a run of another config leaves when it is stopped before its first checkpoint.
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 7\n")
    line = one_error(run_sine(capsys, ["--iterations", "2", "--out", str(out)], code=2))
    says(line, f"--out {out}", "config.yaml", "pass --overwrite", "another --out")
    line = one_error(run_sine(capsys, ["--iterations", "2", "--out", str(out), "--resume"], code=2))
    says(line, "--resume", str(out / "checkpoint.pt"), "pass --overwrite instead of --resume", "another --out")
    assert (out / "config.yaml").read_text() == "seed: 7\n"
    run_sine(capsys, ["--iterations", "2", "--eval-tasks", "2", "--out", str(out), "--overwrite"])  # what both name
    assert (out / "results.json").is_file()
