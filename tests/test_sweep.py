"""The offline sweep runner (experiments/sweep.py) and the run-file reader (experiments/wandb_runs.py).

The sweeps run tests/sweep_program.py, a tiny program that logs a few rows with offline wandb and
"diverges" (exits 1) for some parameters, so these tests do not depend on the experiment scripts.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from experiments import sweep as sweep_cli
from experiments.wandb_runs import RunFileError, find_runs, read_run

REPO = Path(__file__).resolve().parents[1]
PROGRAM = "tests/sweep_program.py"
SWEEP_FILES = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
GRID_X = [2.0, 1.0, 0.5]
GRID_Y = [1, 2]
FAIL_ABOVE = 3.0  # x * y = 4 > 3 for (2.0, 2): that trial fails


def score(x: float, y: int) -> float:
    """The metric tests/sweep_program.py logs as val/score."""
    return (x - 1.0) ** 2 + 1.0 / (3 * y)


def wandb_env(root: Path) -> dict[str, str]:
    """An environment that keeps wandb offline, fast, and out of $HOME; no stray network calls."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(
        WANDB_BASE_URL="http://127.0.0.1:9",
        WANDB_DIR=str(root / "wandb-dir"),
        WANDB_CACHE_DIR=str(root / "wandb-cache"),
        WANDB_CONFIG_DIR=str(root / "wandb-config"),
        WANDB_DATA_DIR=str(root / "wandb-data"),
        WANDB_X_DISABLE_STATS="true",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    return env


def write_sweep(folder: Path, name: str, **fields: Any) -> Path:
    """Write a sweep YAML for tests/sweep_program.py; ``fields`` replace, add or (as None) drop top-level keys."""
    config: dict[str, Any] = {
        "name": name,
        "program": PROGRAM,
        "method": "grid",
        "metric": {"name": "val/score", "goal": "minimize"},
        "parameters": {"x": {"values": GRID_X}, "y": {"values": GRID_Y}, "fail-above": {"value": FAIL_ABOVE}},
    }
    config.update(fields)
    config = {key: value for key, value in config.items() if value is not None}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_cli(args: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m experiments.sweep ARGS`` from ``root`` (not the repository)."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.sweep", *args], cwd=root, env={**wandb_env(root), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def user_keys(row: dict[str, Any]) -> dict[str, Any]:
    """A logged row without wandb's own entries (``_step``, ``_runtime``, ``_timestamp``)."""
    return {key: value for key, value in row.items() if not key.startswith("_")}


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the final table (after its header), split into cells."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    header = next(index for index, line in enumerate(lines) if line.startswith("#  trial"))
    return [line.split() for line in lines[header + 1 :]]


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A grid sweep of 3 x 2 trials, one of which fails, run once through the command line."""
    root = tmp_path_factory.mktemp("grid")
    path = write_sweep(root, "grid-test")
    result = run_cli([str(path), "--out", str(root / "out"), "--seed", "0"], root)
    assert result.returncode == 0, result.stderr
    report = json.loads((root / "out" / "sweep.json").read_text())
    return {"root": root, "out": root / "out", "result": result, "report": report}


def test_grid_runs_every_combination_once(grid: dict[str, Any]) -> None:
    trials = grid["report"]["trials"]
    combos = sorted((trial["params"]["x"], trial["params"]["y"]) for trial in trials)
    assert combos == sorted(itertools.product(GRID_X, GRID_Y))
    assert all(trial["params"]["fail-above"] == FAIL_ABOVE for trial in trials)
    assert [trial["name"] for trial in trials] == [f"trial-{index:03d}" for index in range(1, 7)]


def test_grid_reads_back_what_each_trial_logged(grid: dict[str, Any]) -> None:
    """History, summary, config and group come from each trial's run files and match what it logged."""
    for trial in grid["report"]["trials"]:
        trial_dir = grid["out"] / trial["name"]
        logged = json.loads((trial_dir / "logged.json").read_text())
        run = read_run(trial_dir)
        assert [user_keys(row) for row in run.history] == logged
        assert [row["_step"] for row in run.history] == list(range(len(logged)))
        assert run.group == "grid-test"
        assert run.name == f"grid-test-{trial['name']}"
        x, y = trial["params"]["x"], trial["params"]["y"]
        assert run.config["x"] == x and run.config["y"] == y
        assert run.config["fail-above"] == FAIL_ABOVE  # from WANDB_SWEEP_PARAM_PATH, as wandb agent passes it
        assert run.summary["loss"] == logged[2]["loss"] and run.summary["train"] == logged[2]["train"]
        assert trial["run_id"] == run.id and Path(trial["run_dir"]) == run.path
        if trial["state"] == "finished":
            assert run.exit_code == 0
            assert run.summary["val/score"] == pytest.approx(score(x, y)) == trial["metric"]
            assert run.summary["best_loss"] == min(row["loss"] for row in logged if "loss" in row)
        else:
            assert run.exit_code == 1 and "val/score" not in run.summary


def test_grid_records_the_failed_trial_and_goes_on(grid: dict[str, Any]) -> None:
    trials = {(trial["params"]["x"], trial["params"]["y"]): trial for trial in grid["report"]["trials"]}
    failed = trials.pop((2.0, 2))
    assert failed["state"] == "failed" and failed["exit_code"] == 1 and failed["metric"] is None
    assert "exit code 1" in failed["error"]
    assert "diverged" in (grid["out"] / failed["name"] / "output.log").read_text()
    assert "diverged" in grid["result"].stderr  # the failed trial's last output is shown
    assert all(trial["state"] == "finished" and trial["wall_time"] > 0 for trial in trials.values())
    assert failed["name"] != grid["report"]["trials"][-1]["name"]  # trials ran after it


def test_grid_table_is_best_first(grid: dict[str, Any]) -> None:
    finished = sorted(
        (score(x, y), f"x={x:g}", f"y={y}") for x, y in itertools.product(GRID_X, GRID_Y) if x * y <= FAIL_ABOVE
    )
    rows = table_rows(grid["result"].stdout)
    assert len(rows) == 6
    assert [(float(row[4]), row[2], row[3]) for row in rows[:5]] == [
        (pytest.approx(s, rel=1e-5), x, y) for s, x, y in finished
    ]
    assert [row[5] for row in rows] == ["finished"] * 5 + ["failed"]
    assert rows[5][2:4] == ["x=2", "y=2"] and rows[5][4] == "-"
    assert [row[0] for row in rows] == [str(rank) for rank in range(1, 7)]
    best = min(grid["report"]["trials"], key=lambda trial: math.inf if trial["metric"] is None else trial["metric"])
    assert grid["report"]["best"] == best["name"] == rows[0][1]


def test_grid_trials_get_the_agent_environment_and_flags(grid: dict[str, Any]) -> None:
    trial = grid["report"]["trials"][0]
    trial_dir = grid["out"] / trial["name"]
    assert trial["command"][0] == sys.executable
    assert trial["command"][1] == str(REPO / PROGRAM)  # tests/ is no package: run as a script path
    flags = [f"--{name}={value}" for name, value in trial["params"].items()]
    assert sorted(flags) == sorted(
        [f"--x={trial['params']['x']}", f"--y={trial['params']['y']}", f"--fail-above={FAIL_ABOVE}"]
    )
    assert trial["command"][2:] == [*flags, "--out", str(trial_dir), "--wandb", "offline"]
    params = yaml.safe_load((trial_dir / "sweep-params.yaml").read_text())
    assert params == {"wandb_version": 1, **{key: {"value": value} for key, value in trial["params"].items()}}
    found = sorted(path.parent for path in find_runs(grid["out"]))
    assert found == sorted(grid["out"] / other["name"] / "wandb" for other in grid["report"]["trials"])
    assert "[sweep] trial-001 (1):" in grid["result"].stderr and "[sweep] trial-006" in grid["result"].stderr


def test_random_sweep_stops_at_count_and_matches_its_dry_run(tmp_path: Path) -> None:
    parameters = {"x": {"distribution": "uniform", "min": 0.0, "max": 1.5}, "y": {"values": [1, 2, 3]}}
    path = write_sweep(tmp_path, "random-test", method="random", parameters=parameters)
    result = run_cli([str(path), "--count", "2", "--seed", "5", "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr
    trials = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert len(trials) == 2 and all(trial["state"] == "finished" for trial in trials)
    for trial in trials:
        x, y = trial["params"]["x"], trial["params"]["y"]
        assert 0.0 <= x <= 1.5 and y in (1, 2, 3)
        assert trial["metric"] == pytest.approx(score(x, y))
        assert read_run(tmp_path / "out" / trial["name"]).summary["val/score"] == trial["metric"]
    stdout = io.StringIO()
    assert sweep_cli.main([str(path), "--count", "2", "--seed", "5", "--dry-run"], stdout, io.StringIO()) == 0
    planned = [line.split()[1:] for line in stdout.getvalue().splitlines() if line.startswith("trial-")]
    assert planned == [[f"x={trial['params']['x']:.6g}", f"y={trial['params']['y']}"] for trial in trials]


def test_bayes_sweep_runs_offline_and_feeds_results_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parameters = {"x": {"distribution": "uniform", "min": 0.0, "max": 2.0}, "y": {"values": [1, 2]}}
    path = write_sweep(tmp_path, "bayes-test", method="bayes", parameters=parameters, run_cap=3)
    seen: list[int] = []
    next_params = sweep_cli.next_params

    def spy(sweep: sweep_cli.Sweep, trials: list[sweep_cli.Trial]) -> dict[str, Any] | None:
        seen.append(sum(trial.state == "finished" and trial.metric is not None for trial in trials))
        return next_params(sweep, trials)

    monkeypatch.setattr(sweep_cli, "next_params", spy)
    for key, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    stdout, stderr = io.StringIO(), io.StringIO()
    assert sweep_cli.main([str(path), "--seed", "1", "--out", str(tmp_path / "out")], stdout, stderr) == 0, (
        stderr.getvalue()
    )
    trials = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert len(trials) == 3  # run_cap
    assert seen == [0, 1, 2]  # each suggestion knew every earlier result, read back from the run files
    for trial in trials:
        assert trial["state"] == "finished"
        assert trial["metric"] == pytest.approx(score(trial["params"]["x"], trial["params"]["y"]))
    ranked = [row[1] for row in table_rows(stdout.getvalue())]
    assert ranked == [trial["name"] for trial in sorted(trials, key=lambda trial: trial["metric"])]


def test_target_ends_the_sweep(tmp_path: Path) -> None:
    metric = {"name": "val/score", "goal": "minimize", "target": 0.5}
    path = write_sweep(tmp_path, "target-test", metric=metric)
    result = run_cli([str(path), "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr
    trials = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert [(trial["params"]["x"], trial["params"]["y"]) for trial in trials] == [(2.0, 1), (2.0, 2), (1.0, 1)]
    assert "reached the target" in result.stderr


def test_command_macros_follow_wandb_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEP_TEST_FLAG", "on")
    command = [
        "${env}",
        "${interpreter}",
        "${program}",
        "--verbose=${envvar:SWEEP_TEST_FLAG}",
        "${args_no_boolean_flags}",
    ]
    parameters = {"fast": {"values": [True, False]}, "lr": {"value": 0.1}}
    sweep = sweep_cli.load_sweep(write_sweep(tmp_path, "macros", program="experiments/sweep.py", command=command,
                                             parameters=parameters))  # fmt: skip
    trial_dir = tmp_path / "trial-001"
    built, module = sweep_cli.build_command(sweep, {"fast": True, "lr": 0.1}, trial_dir)
    assert module == "experiments.sweep"  # a .py file in a package of this repository runs as its module
    tail = ["--out", str(trial_dir), "--wandb", "offline"]
    assert built == [sys.executable, "-m", "experiments.sweep", "--verbose=on", "--fast", "--lr=0.1", *tail]
    built, _ = sweep_cli.build_command(sweep, {"fast": False, "lr": 0.1}, trial_dir)
    assert built == [sys.executable, "-m", "experiments.sweep", "--verbose=on", "--lr=0.1", *tail]
    sweep.command = ["${program}", "${args_no_hyphens}", "${args_json}"]  # no interpreter: a script path
    built, module = sweep_cli.build_command(sweep, {"fast": True, "lr": 0.1}, trial_dir)
    assert module is None
    assert built == [str(REPO / "experiments" / "sweep.py"), "fast=True", "lr=0.1", '{"fast": true, "lr": 0.1}', *tail]


@pytest.mark.parametrize("path", SWEEP_FILES, ids=[path.name for path in SWEEP_FILES])
def test_sweep_files_are_valid_and_plan_their_grids(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    assert sweep_cli._engine().schema_violations_from_proposed_config(config) == []  # as wandb sweep's schema
    sweep = sweep_cli.load_sweep(path)
    assert sweep.program == f"experiments/{path.stem}.py"
    fixed = {name: spec["value"] for name, spec in config["parameters"].items() if "value" in spec}
    searched = {name: spec["values"] for name, spec in config["parameters"].items() if "values" in spec}
    expected = [dict(zip(searched, combo, strict=True), **fixed) for combo in itertools.product(*searched.values())]
    planned = [trial.params for trial in sweep_cli.plan_trials(sweep, sweep_cli.trial_limit(sweep, None))]
    key = lambda params: json.dumps(params, sort_keys=True)  # noqa: E731
    assert sorted(planned, key=key) == sorted(expected, key=key)
    stdout = io.StringIO()
    assert sweep_cli.main([str(path), "--dry-run"], stdout, io.StringIO()) == 0
    command = next(line for line in stdout.getvalue().splitlines() if line.startswith("command: "))
    assert all(f"--{name}=" in command for name in config["parameters"])
    assert command.endswith("--wandb offline")


def test_sine_sweep_searches_inner_lr_and_steps() -> None:
    sweep = sweep_cli.load_sweep(REPO / "experiments" / "sweeps" / "sine.yaml")
    assert (sweep.method, sweep.metric, sweep.goal) == ("grid", "val/mse", "minimize")
    assert sweep.searched == ["inner-lr", "steps"]
    omniglot = sweep_cli.load_sweep(REPO / "experiments" / "sweeps" / "omniglot.yaml")
    assert (omniglot.metric, omniglot.goal) == ("val/accuracy", "maximize")
    assert omniglot.searched == ["mode", "meta-batch"]


BAD_INPUTS = {
    "missing file": (None, "not found"),
    "not yaml": ("method: [grid\n", "not valid YAML"),
    "unknown method": ({"method": "hyperopt"}, "method must be one of"),
    "no metric": ({"metric": None}, "needs a metric"),
    "schema violation": ({"parameters": {"x": {"values": "notalist"}}}, "not a valid sweep config"),
    "unknown key": ({"colour": "blue"}, "not a valid sweep config"),
    "grid over a range": ({"parameters": {"x": {"min": 0.0, "max": 1.0}}}, "cannot use these parameters"),
    "random without count": ({"method": "random"}, "pass --count"),
    "missing program": ({"program": "no/such/program.py"}, "not found"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_a_message(case: str, tmp_path: Path) -> None:
    change, message = BAD_INPUTS[case]
    if change is None:
        path = tmp_path / "absent.yaml"
    elif isinstance(change, str):
        path = tmp_path / "broken.yaml"
        path.write_text(change)
    else:
        path = write_sweep(tmp_path, "bad", **change)
    stderr = io.StringIO()
    assert sweep_cli.main([str(path), "--out", str(tmp_path / "out")], io.StringIO(), stderr) == 2
    assert stderr.getvalue().startswith("error: ") and message in stderr.getvalue()
    assert not (tmp_path / "out" / "sweep.json").exists()


def test_out_folder_holding_a_sweep_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out" / "trial-001").mkdir(parents=True)
    stderr = io.StringIO()
    assert (
        sweep_cli.main([str(write_sweep(tmp_path, "again")), "--out", str(tmp_path / "out")], io.StringIO(), stderr)
        == 2
    )
    assert "already holds a sweep" in stderr.getvalue()


def test_bad_count_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sweep_cli.main([str(write_sweep(tmp_path, "count")), "--count", "0"], io.StringIO(), io.StringIO())
    assert exit_info.value.code == 2


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose 70,000-character row spans three 32 KiB blocks of its .wandb file."""
    root = tmp_path_factory.mktemp("big")
    out = root / "out"
    subprocess.run(
        [sys.executable, str(REPO / PROGRAM), "--out", str(out), "--x=0.75", "--y=3", "--blob=70000"],
        env=wandb_env(root), check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return out


def test_read_run_decodes_records_across_blocks(big_run: Path) -> None:
    run = read_run(big_run)
    (run_file,) = run.path.glob("run-*.wandb")
    assert run_file.stat().st_size > 2 * 32 * 1024
    assert [user_keys(row) for row in run.history] == json.loads((big_run / "logged.json").read_text())
    assert run.summary["blob"] == "b" * 70000 and run.state == "finished" and run.problems == []
    assert read_run(run.path).history == read_run(run_file).history == run.history


@pytest.mark.skipif(shutil.which("wandb", path=str(Path(sys.executable).parent)) is None, reason="no wandb CLI")
def test_read_run_agrees_with_wandb_leet_inspect(big_run: Path) -> None:
    run = read_run(big_run)
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    inspected = json.loads(
        subprocess.run(
            [wandb_cli, "leet", "inspect", "--summary", "--json", str(run.path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout  # fmt: skip
    )
    assert inspected["config"] == run.config
    assert inspected["summary"] == run.summary
    assert (inspected["run_id"], inspected["exit_code"], inspected["step"]) == (run.id, 0, run.history[-1]["_step"])


def test_read_run_survives_damage_and_rejects_other_files(big_run: Path, tmp_path: Path) -> None:
    (run_file,) = read_run(big_run).path.glob("run-*.wandb")
    data = run_file.read_bytes()
    whole = read_run(big_run)

    def damaged(name: str, content: bytes) -> Path:
        folder = tmp_path / name / "wandb" / run_file.parent.name
        folder.mkdir(parents=True)
        (folder / run_file.name).write_bytes(content)
        return folder

    truncated = read_run(damaged("truncated", data[: len(data) - 100]))
    assert truncated.exit_code is None and truncated.state == "running" and truncated.problems
    assert truncated.config == whole.config and truncated.history == whole.history[: len(truncated.history)]

    corrupt = bytearray(data)
    corrupt[40 * 1024] ^= 0xFF  # inside a blob record in the second block: that block is skipped
    corrupted = read_run(damaged("corrupt", bytes(corrupt)))
    assert corrupted.problems and corrupted.exit_code == 0  # the records after the damage are read
    assert corrupted.history[:3] == whole.history[:3]
    assert all(row in whole.history for row in corrupted.history)

    with pytest.raises(RunFileError, match="not a wandb run file"):
        read_run(damaged("other", b"PK\x03\x04" + data[4:]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no wandb run"):
        read_run(tmp_path / "empty")


# ---------------------------------------------------------------------------- issue 11: metric, table, flag names


def test_grid_prints_the_final_table_once(grid: dict[str, Any]) -> None:
    """The full table goes to stdout once; stderr has the standings before each later trial, none after the last."""
    stdout, stderr = grid["result"].stdout, grid["result"].stderr
    assert stdout.count("#  trial") == 1
    assert stderr.count("#  trial") == stderr.count("[sweep] best so far:\n#  trial") == 5
    after_last = stderr.rsplit("[sweep] trial-006 finished", 1)[1]
    assert "#  trial" not in after_last


FALLS_AND_RISES = '''
import argparse

import wandb

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--wandb")
parser.add_argument("--x", type=float)
args = parser.parse_args()
run = wandb.init(dir=args.out, mode=args.wandb, settings=wandb.Settings(x_disable_stats=True, x_disable_machine_info=True))
for value in (3 * args.x, args.x, 2 * args.x):  # falls, then rises: the best is x, the last 2 x
    run.log({"val/score": value})
run.finish()
wandb.teardown()
'''


def test_the_metric_is_its_best_value_over_the_run_not_its_last(tmp_path: Path) -> None:
    program = tmp_path / "falls_and_rises.py"
    program.write_text(FALLS_AND_RISES)
    path = write_sweep(tmp_path, "best", program=str(program), parameters={"x": {"values": [1.5]}})
    result = run_cli([str(path), "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr
    (trial,) = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert trial["metric"] == 1.5 and trial["summary"]["val/score"] == 3.0  # the minimum, not the last value
    header = next(line for line in result.stdout.splitlines() if line.startswith("#  trial"))
    assert "val/score (min)" in header and table_rows(result.stdout)[0][3] == "1.5"
    assert "#  trial" not in result.stderr  # one trial: no standings, and the final table once, on stdout


def test_best_metric_follows_the_goal() -> None:
    history = [{"val/acc": 0.4}, {"loss": 1.0}, {"val/acc": 0.7}, {"val/acc": float("nan")}, {"val/acc": 0.6}]
    assert sweep_cli.best_metric({"val/acc": 0.6}, history, "val/acc", "maximize") == 0.7
    assert sweep_cli.best_metric({"val/acc": 0.6}, history, "val/acc", "minimize") == 0.4
    assert sweep_cli.best_metric({}, [{"loss": 1.0}], "val/acc", "minimize") is None


def test_dry_run_checks_parameter_names_against_the_programs_flags(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, "misspelled", parameters={"x": {"values": [1.0]}, "fail_above": {"value": 3.0}})
    stderr = io.StringIO()
    assert sweep_cli.main([str(path), "--dry-run"], io.StringIO(), stderr) == 2
    assert stderr.getvalue() == (
        f"error: {path}: the parameter 'fail_above' is not a flag of tests/sweep_program.py (did you mean "
        f"--fail-above?); every trial would fail on it. Rename it under parameters (the program's --help lists its "
        f"flags).\n"
    )
    assert not (tmp_path / "out").exists()


def test_dry_run_checks_an_experiment_scripts_flags_which_take_underscores(tmp_path: Path) -> None:
    command = ["${env}", "${interpreter}", "-m", "experiments.sine", "${args}"]
    path = write_sweep(tmp_path, "sine-typo", program="experiments/sine.py", command=command, metric={"name": "val/mse"},
                       parameters={"inner-rl": {"values": [0.01, 0.1]}, "meta_batch": {"value": 5}})  # fmt: skip
    stderr = io.StringIO()
    assert sweep_cli.main([str(path), "--dry-run"], io.StringIO(), stderr) == 2
    assert stderr.getvalue() == (
        f"error: {path}: the parameter 'inner-rl' is not a flag of experiments/sine.py (did you mean --inner-lr, "
        f"--learn-inner-lr, --meta-lr?); every trial would fail on it. Rename it under parameters (the program's "
        f"--help lists its flags).\n"
    )
    fixed = write_sweep(tmp_path, "sine-ok", program="experiments/sine.py", command=command, metric={"name": "val/mse"},
                        parameters={"inner_lr": {"values": [0.01, 0.1]}, "meta_batch": {"value": 5}})  # fmt: skip
    stdout = io.StringIO()
    assert sweep_cli.main([str(fixed), "--dry-run"], stdout, io.StringIO()) == 0  # --inner_lr is --inner-lr there
    assert "--inner_lr=0.01 --meta_batch=5 --out <out>/trial-001 --wandb offline" in stdout.getvalue()
