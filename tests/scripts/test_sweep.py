"""The offline sweep runner (experiments/sweep.py).

The sweeps run tests/scripts/sweep_program.py, a tiny program that writes metrics.jsonl and results.json
the way the experiment scripts do and "diverges" (exits 1) for some parameters, so these tests do
not depend on the experiment scripts, and each trial is a short process without wandb.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from experiments import sweep as sweep_cli
from experiments.sweep import trials as sweep_file

REPO = Path(__file__).resolve().parents[2]
PROGRAM = "tests/scripts/sweep_program.py"
SWEEP_FILES = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
GRID_X = [2.0, 1.0, 0.5]
GRID_Y = [1, 2]
FAIL_ABOVE = 3.0  # x * y = 4 > 3 for (2.0, 2): that trial fails


def score(x: float, y: int) -> float:
    """The best val/score tests/scripts/sweep_program.py logs."""
    return (x - 1.0) ** 2 + 1.0 / (3 * y)


def quiet_env(root: Path, **extra: str) -> dict[str, str]:
    """An environment that keeps wandb offline, out of $HOME and off the network, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "SWEEP_PROGRAM_"))}
    env.update(
        WANDB_BASE_URL="http://127.0.0.1:9",
        WANDB_CACHE_DIR=str(root / "wandb-cache"),
        WANDB_CONFIG_DIR=str(root / "wandb-config"),
        WANDB_DATA_DIR=str(root / "wandb-data"),
        WANDB_X_DISABLE_STATS="true",
        PYTHONPATH=str(REPO),
        PYTHONWARNINGS="ignore::DeprecationWarning",
        **extra,
    )
    return env


def write_sweep(folder: Path, name: str, **fields: Any) -> Path:
    """Write a sweep YAML for tests/scripts/sweep_program.py; ``fields`` replace, add or (as None) drop top-level keys."""
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


def run_cli(args: list[str], root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m experiments.sweep ARGS`` from ``root`` (not the repository); ``env`` adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.sweep", *args],
        cwd=root,
        env=quiet_env(root, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def launches(log: Path) -> list[dict[str, Any]]:
    """The starts tests/scripts/sweep_program.py logged, each with its trial's folder name as ``trial``."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [event for event in events if event["event"] == "start"]
    for event in starts:
        event["trial"] = Path(event["argv"][event["argv"].index("--out") + 1]).name
    return starts


def trial_names(first: int, last: int) -> list[str]:
    """The folder names of trials ``first`` to ``last``."""
    return [f"trial-{index:03d}" for index in range(first, last + 1)]


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the final table (after its header, up to a blank line), split into cells."""
    lines = stdout.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("#  trial"))
    rows = list(itertools.takewhile(str.strip, lines[header + 1 :]))
    return [line.split() for line in rows]


def report(out: Path) -> list[dict[str, Any]]:
    """The trials recorded in ``out/sweep.json``."""
    return json.loads((out / "sweep.json").read_text())["trials"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A grid sweep of 3 x 2 trials, one of which fails, run once through the command line."""
    root = tmp_path_factory.mktemp("grid")
    path = write_sweep(root, "grid-test")
    result = run_cli([str(path), "--out", str(root / "out"), "--seed", "0"], root, SWEEP_PROGRAM_LOG=str(root / "log"))
    assert result.returncode == 0, result.stderr
    return {"root": root, "out": root / "out", "result": result, "trials": report(root / "out")}


def test_grid_runs_every_combination_once(grid: dict[str, Any]) -> None:
    trials = grid["trials"]
    combos = sorted((trial["params"]["x"], trial["params"]["y"]) for trial in trials)
    assert combos == sorted(itertools.product(GRID_X, GRID_Y))
    assert all(trial["params"]["fail-above"] == FAIL_ABOVE for trial in trials)
    assert [trial["name"] for trial in trials] == trial_names(1, 6)
    assert [start["trial"] for start in launches(grid["root"] / "log")] == [trial["name"] for trial in trials]


def test_grid_scores_each_trial_by_its_best_value_in_its_metrics_jsonl(grid: dict[str, Any]) -> None:
    """The metric is the best val/score the trial wrote to its own metrics.jsonl, not the last one."""
    for trial in grid["trials"]:
        folder = grid["out"] / trial["name"]
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        scores = [row["val/score"] for row in rows if "val/score" in row]
        if trial["state"] == "finished":
            assert trial["metric"] == min(scores) == pytest.approx(score(trial["params"]["x"], trial["params"]["y"]))
            assert scores[-1] > trial["metric"] and (folder / "results.json").is_file()
        else:
            assert trial["metric"] is None and scores == [] and not (folder / "results.json").exists()


def test_grid_records_the_failed_trial_and_goes_on(grid: dict[str, Any]) -> None:
    trials = {(trial["params"]["x"], trial["params"]["y"]): trial for trial in grid["trials"]}
    failed = trials.pop((2.0, 2))
    assert failed["state"] == "failed" and failed["exit_code"] == 1 and failed["error"] == "exit code 1"
    log = grid["out"] / failed["name"] / "output.log"
    assert "diverged" in log.read_text()
    assert f"{failed['name']} failed (exit code 1; its output: {log})" in grid["result"].stderr
    assert all(trial["state"] == "finished" and trial["wall_time"] > 0 for trial in trials.values())
    assert failed["name"] != grid["trials"][-1]["name"]  # trials ran after it


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


def test_grid_trials_get_the_agent_command_and_environment(grid: dict[str, Any]) -> None:
    trial = grid["trials"][0]
    # sweep.json holds no path of this machine: "python" for the interpreter, the program relative to the repository
    assert trial["command"][0] == "python"
    assert trial["command"][1] == PROGRAM  # ${program}: the file, found from the repository root
    flags = [f"--{name}={value}" for name, value in trial["params"].items()]
    x, y = trial["params"]["x"], trial["params"]["y"]
    assert sorted(flags) == sorted([f"--x={x}", f"--y={y}", f"--fail-above={FAIL_ABOVE}"])
    assert trial["command"][2:] == [*flags, "--out", str(grid["out"] / trial["name"]), "--wandb", "offline"]
    for start in launches(grid["root"] / "log"):
        # --jobs 1 sets no OMP_NUM_THREADS: a trial has the runner's own (none, unless the caller set one)
        omp = os.environ.get("OMP_NUM_THREADS")
        assert (start["group"], start["mode"], start["omp"]) == ("grid-test", "offline", omp)
    assert "[sweep] trial-001 (1):" in grid["result"].stderr and "[sweep] trial-006" in grid["result"].stderr


def test_grid_prints_the_final_table_once(grid: dict[str, Any]) -> None:
    """The table goes to stdout once, at the end; stderr has one line as each trial starts and ends."""
    stdout, stderr = grid["result"].stdout, grid["result"].stderr
    assert stdout.count("#  trial") == 1 and "#  trial" not in stderr
    assert "val/score (min)" in stdout and "over seeds" not in stdout  # no seed parameter: no summary
    assert all(stderr.count(f"[sweep] trial-00{index} ") == 2 for index in range(1, 7))


def test_jobs_2_runs_trials_at_once_with_the_same_table(grid: dict[str, Any], tmp_path: Path) -> None:
    parameters = {**yaml.safe_load(write_sweep(tmp_path, "probe").read_text())["parameters"], "sleep": {"value": 0.3}}
    path = write_sweep(tmp_path, "jobs-test", parameters=parameters)
    log = str(tmp_path / "log")
    result = run_cli([str(path), "--out", str(tmp_path / "out"), "--jobs", "2"], tmp_path, SWEEP_PROGRAM_LOG=log)
    assert result.returncode == 0, result.stderr
    without_time = lambda rows: [row[:-1] for row in rows]  # noqa: E731
    assert without_time(table_rows(result.stdout)) == without_time(table_rows(grid["result"].stdout))
    trials = report(tmp_path / "out")
    assert [(t["name"], t["params"]["x"], t["params"]["y"], t["state"]) for t in trials] == [
        (t["name"], t["params"]["x"], t["params"]["y"], t["state"]) for t in grid["trials"]
    ]
    events = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    assert any(first["event"] == second["event"] == "start" for first, second in itertools.pairwise(events))
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert {event["omp"] for event in events} == {threads}
    assert all("--threads" not in event["argv"] for event in events)  # not one of our scripts: OMP_NUM_THREADS only


CUTS = {"killed, checkpoint kept": "--resume", "killed, no checkpoint": "--overwrite", "Ctrl-C": "--resume"}


@pytest.mark.parametrize("cut", CUTS)
def test_interrupted_sweep_resumes_and_runs_only_the_rest(grid: dict[str, Any], tmp_path: Path, cut: str) -> None:
    """The runner is stopped while trial 2 runs; --resume re-runs trial 2 (from its checkpoint) and runs 3 to 6 only."""
    path, out, log = write_sweep(tmp_path, "grid-test"), tmp_path / "out", tmp_path / "log"
    runner = subprocess.Popen(
        [sys.executable, "-m", "experiments.sweep", str(path), "--out", str(out), "--seed", "0"],
        cwd=tmp_path,
        env=quiet_env(tmp_path, SWEEP_PROGRAM_LOG=str(log), SWEEP_PROGRAM_HANG="2"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not ((out / "trial-002" / "checkpoint.pt").exists() and "trial-002" in (out / "sweep.json").read_text()):
        assert time.monotonic() < deadline and runner.poll() is None, "trial 2 never started"
        time.sleep(0.05)
    # SIGKILL: the runner and its trial die at once, as on a lost node; SIGINT: Ctrl-C in a terminal.
    os.killpg(runner.pid, signal.SIGINT if cut == "Ctrl-C" else signal.SIGKILL)
    assert runner.wait(timeout=300) == (130 if cut == "Ctrl-C" else -signal.SIGKILL)
    assert [trial["state"] for trial in report(out)] == ["finished", "killed" if cut == "Ctrl-C" else "running"]
    if cut == "killed, no checkpoint":
        (out / "trial-002" / "checkpoint.pt").unlink()

    stderr = io.StringIO()
    assert sweep_cli.main([str(path), "--out", str(out)], io.StringIO(), stderr) == 2
    assert "already holds a sweep; pass --resume" in stderr.getvalue()
    result = run_cli([str(path), "--out", str(out), "--resume"], tmp_path, SWEEP_PROGRAM_LOG=str(log))
    assert result.returncode == 0, result.stderr
    starts = launches(log)
    assert [start["trial"] for start in starts] == ["trial-001", "trial-002", "trial-002", *trial_names(3, 6)]
    assert starts[2]["argv"][-1] == CUTS[cut] and starts[1]["argv"][-1] == "offline"
    keep = lambda trials: [(t["name"], t["params"], t["state"], t["metric"]) for t in trials]  # noqa: E731
    assert keep(report(out)) == keep(grid["trials"])
    rows = lambda stdout: [row[:-1] for row in table_rows(stdout)]  # noqa: E731
    assert rows(result.stdout) == rows(grid["result"].stdout)


def test_a_trial_stopped_by_sigterm_is_killed_not_failed_and_resumed(grid: dict[str, Any], tmp_path: Path) -> None:
    """A trial stopped alone (SIGTERM: our scripts checkpoint, exit 143) is killed, not failed; --resume continues it."""
    path, out, log = write_sweep(tmp_path, "grid-test"), tmp_path / "out", tmp_path / "log"
    runner = subprocess.Popen(
        [sys.executable, "-m", "experiments.sweep", str(path), "--out", str(out), "--seed", "0"],
        cwd=tmp_path,
        env=quiet_env(tmp_path, SWEEP_PROGRAM_LOG=str(log), SWEEP_PROGRAM_HANG="2"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (out / "trial-002" / "checkpoint.pt").exists():
        assert time.monotonic() < deadline and runner.poll() is None, "trial 2 never started"
        time.sleep(0.05)
    os.kill(launches(log)[1]["pid"], signal.SIGTERM)
    assert runner.wait(timeout=300) == 0
    stopped = report(out)[1]
    assert (stopped["state"], stopped["exit_code"], stopped["metric"]) == ("killed", 143, None)
    assert [trial["state"] for trial in report(out)[2:]] == [trial["state"] for trial in grid["trials"][2:]]
    result = run_cli([str(path), "--out", str(out), "--resume"], tmp_path, SWEEP_PROGRAM_LOG=str(log))
    assert result.returncode == 0, result.stderr
    starts = launches(log)
    assert len(starts) == 7 and starts[-1]["trial"] == "trial-002" and starts[-1]["argv"][-1] == "--resume"
    keep = lambda trials: [(t["name"], t["params"], t["state"], t["metric"]) for t in trials]  # noqa: E731
    assert keep(report(out)) == keep(grid["trials"])


def test_random_sweep_resumes_up_to_count_with_the_engine_told_of_the_trials(tmp_path: Path) -> None:
    parameters = {"x": {"distribution": "uniform", "min": 0.0, "max": 1.5}, "y": {"values": [1, 2, 3]}}
    path = write_sweep(tmp_path, "random-test", method="random", parameters=parameters)
    log, out = str(tmp_path / "log"), str(tmp_path / "out")
    result = run_cli([str(path), "--count", "2", "--seed", "5", "--out", out], tmp_path, SWEEP_PROGRAM_LOG=log)
    assert result.returncode == 0, result.stderr
    first = report(tmp_path / "out")
    assert len(first) == 2 and all(trial["state"] == "finished" for trial in first)
    for trial in first:
        x, y = trial["params"]["x"], trial["params"]["y"]
        assert 0.0 <= x <= 1.5 and y in (1, 2, 3) and trial["metric"] == pytest.approx(score(x, y))
    stdout = io.StringIO()
    assert sweep_cli.main([str(path), "--count", "2", "--seed", "5", "--dry-run"], stdout, io.StringIO()) == 0
    planned = [line.split()[1:] for line in stdout.getvalue().splitlines() if line.startswith("trial-")]
    assert planned == [[f"x={trial['params']['x']:.6g}", f"y={trial['params']['y']}"] for trial in first]

    result = run_cli([str(path), "--count", "3", "--resume", "--out", out], tmp_path, SWEEP_PROGRAM_LOG=log)
    assert result.returncode == 0, result.stderr
    trials = report(tmp_path / "out")
    assert trials[:2] == first and len(trials) == 3 and trials[2]["params"] != trials[1]["params"]
    assert [start["trial"] for start in launches(tmp_path / "log")] == ["trial-001", "trial-002", "trial-003"]
    assert len(table_rows(result.stdout)) == 3


def test_bayes_sweep_feeds_every_result_back_to_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parameters = {"x": {"distribution": "uniform", "min": 0.0, "max": 2.0}, "y": {"values": [1, 2]}}
    path = write_sweep(tmp_path, "bayes-test", method="bayes", parameters=parameters, run_cap=3)
    seen: list[list[float]] = []
    next_run = sweep_file.sweeps.next_run

    def spy(config: dict[str, Any], runs: list[Any]) -> Any:
        seen.append([run.summary_metrics["val/score"] for run in runs if run.state == "finished"])
        return next_run(config, runs)

    monkeypatch.setattr(sweep_file.sweeps, "next_run", spy)
    for key, value in quiet_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    stdout, stderr = io.StringIO(), io.StringIO()
    code = sweep_cli.main([str(path), "--seed", "1", "--out", str(tmp_path / "out")], stdout, stderr)
    assert code == 0, stderr.getvalue()
    trials = report(tmp_path / "out")
    assert len(trials) == 3  # run_cap
    assert seen[1:] == [[trial["metric"] for trial in trials[:done]] for done in range(3)]  # seen[0]: load_sweep checks
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
    trials = report(tmp_path / "out")
    assert [(trial["params"]["x"], trial["params"]["y"]) for trial in trials] == [(2.0, 1), (2.0, 2), (1.0, 1)]
    assert "reached the target" in result.stderr


def test_seed_summary_matches_a_hand_computation(tmp_path: Path) -> None:
    """2 settings of x, 3 seeds each: mean, sample std (n - 1) and mean CI per test metric, and mean train time."""
    seeds, xs, y = [0, 1, 2], [0.5, 1.5], 2
    parameters = {"x": {"values": xs}, "seed": {"values": seeds}, "y": {"value": y}}
    path = write_sweep(tmp_path, "seeds-test", parameters=parameters)
    out = tmp_path / "out"
    result = run_cli([str(path), "--out", str(out), "--jobs", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [group["params"] for group in summary["groups"]] == [{"x": x, "y": y} for x in xs]
    for group, x in zip(summary["groups"], xs, strict=True):
        assert group["seeds"] == seeds
        one = [score(x, y) + 0.1 * seed for seed in seeds]
        five = [score(x, y) / 2 + 0.05 * seed**2 for seed in seeds]
        assert group["metrics"]["1step score"] == {
            "mean": pytest.approx(sum(one) / 3),
            "n": 3,
            "mean_ci95": pytest.approx((0.01 + 0.02 + 0.03) / 3),
            "std": pytest.approx((sum((v - sum(one) / 3) ** 2 for v in one) / 2) ** 0.5),
        }
        assert group["metrics"]["5step score"] == {
            "mean": pytest.approx(sum(five) / 3),
            "n": 3,
            "mean_ci95": pytest.approx(0.02 + 0.001 * x),
            "std": pytest.approx(statistics.stdev(five)),
        }
        assert group["train_seconds"] == pytest.approx(x + 1)  # x + seed, averaged
    markdown = (out / "summary.md").read_text()
    assert markdown in result.stdout and "| x=0.5 y=2 | 0.5167 +- 0.1 (CI 0.02, n=3) |" in markdown
    shown = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--summarize", str(out)],
        cwd=tmp_path,
        env=quiet_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0 and shown.stdout == markdown


def test_seed_summary_shows_a_diverged_run_as_nan(tmp_path: Path) -> None:
    trials = [{"name": f"trial-00{seed}", "params": {"a": 1, "seed": seed}} for seed in (1, 2, 3)]
    (tmp_path / "sweep.json").write_text(json.dumps({"trials": trials}))
    for seed, mse in ((1, 0.5), (2, float("nan")), (3, float("inf"))):
        (tmp_path / f"trial-00{seed}").mkdir()
        results = {"test": {"5shot": {"mse": mse, "ci95": 0.1}}, "train_seconds": 2.0}
        (tmp_path / f"trial-00{seed}" / "results.json").write_text(json.dumps(results))
    summary, markdown = sweep_cli.summarize(tmp_path)
    metric = summary["groups"][0]["metrics"]["5shot mse"]
    assert (
        metric["n"] == 3
        and math.isnan(metric["mean"])
        and math.isnan(metric["std"])
        and metric["mean_ci95"] == pytest.approx(0.1)
    )
    assert "| a=1 | nan +- nan (CI 0.1, n=3) | 2 |" in markdown


@pytest.mark.parametrize("path", SWEEP_FILES, ids=[path.name for path in SWEEP_FILES])
def test_sweep_files_are_valid_and_plan_their_grids(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    assert sweep_file.sweeps.schema_violations_from_proposed_config(config) == []  # as wandb sweep's schema
    sweep = sweep_cli.load_sweep(path)
    assert sweep.config["program"] == f"experiments/{path.stem.split('-')[0]}.py"
    fixed = {name: spec["value"] for name, spec in config["parameters"].items() if "value" in spec}
    searched = {name: spec["values"] for name, spec in config["parameters"].items() if "values" in spec}
    expected = [dict(zip(searched, combo, strict=True), **fixed) for combo in itertools.product(*searched.values())]
    stdout, stderr = io.StringIO(), io.StringIO()
    code = sweep_cli.main([str(path), "--dry-run", "--seed", "0"], stdout, stderr)
    assert code == 0, stderr.getvalue()
    planned = [sorted(line.split()[1:]) for line in stdout.getvalue().splitlines() if line.startswith("trial-")]
    assert sorted(planned) == sorted(sorted(f"{key}={value}" for key, value in params.items()) for params in expected)
    command = next(line for line in stdout.getvalue().splitlines() if line.startswith("command: "))
    assert command.startswith(f"command: {sys.executable} -m experiments.{path.stem.split('-')[0]} ")
    assert all(f"--{name}=" in command for name in config["parameters"])
    assert command.endswith("--out <out>/trial-001 --wandb offline")


def test_the_sweep_files_search_what_they_say() -> None:
    searched = {path.name: sweep_cli.load_sweep(path) for path in SWEEP_FILES}
    assert {name: (s.metric, s.goal, sorted(s.searched)) for name, s in searched.items()} == {
        "sine.yaml": ("val/mse", "minimize", ["inner-lr", "steps"]),
        "omniglot.yaml": ("val/accuracy", "maximize", ["meta-batch", "mode"]),
        "sine-seeds.yaml": ("val/mse", "minimize", ["algorithm", "seed"]),
        "omniglot-seeds.yaml": ("val/accuracy", "maximize", ["algorithm", "seed"]),
        "omniglot-learn2learn.yaml": ("val/accuracy", "maximize", ["seed"]),
        "omniglot-20way.yaml": ("val/accuracy", "maximize", ["seed"]),
    }
    sine, omniglot = (searched[f"{name}-seeds.yaml"].config["parameters"] for name in ("sine", "omniglot"))
    assert (sine["algorithm"]["values"], sine["seed"]["values"]) == (["maml", "metasgd", "mamlpp"], [0, 1, 2, 3, 4])
    assert omniglot["algorithm"]["values"] == ["maml", "fomaml", "anil", "metasgd", "mamlpp"]
    # The reference protocol's own meta-batch (no override), and the same budget and seeds for the learn2learn row.
    peer = searched["omniglot-learn2learn.yaml"].config["parameters"]
    assert (
        omniglot["seed"]["values"] == peer["seed"]["values"] == [0, 1, 2] and peer["engine"]["value"] == "learn2learn"
    )
    assert omniglot["iterations"] == peer["iterations"] and omniglot["val-every"] == peer["val-every"]
    assert "meta-batch" not in omniglot and "data" not in omniglot
    # 20-way at the reference's own 20-way settings: --ways 20 alone picks its steps, inner lr and meta-batch.
    twenty = searched["omniglot-20way.yaml"].config["parameters"]
    assert twenty["ways"] == {"value": 20} and not {"steps", "inner-lr", "meta-batch", "data"} & set(twenty)


BAD_INPUTS = {
    "missing file": (None, [], "not found"),
    "not yaml": ("method: [grid\n", [], "not valid YAML"),
    "unknown method": ({"method": "hyperopt"}, [], "'hyperopt' is not one of"),
    "no metric": ({"metric": None}, [], "needs a metric"),
    "schema violation": ({"parameters": {"x": {"values": "notalist"}}}, [], "not a valid sweep config"),
    "unknown key": ({"colour": "blue"}, [], "not a valid sweep config"),
    "grid over a range": ({"parameters": {"x": {"min": 0.0, "max": 1.0}}}, [], "cannot use these parameters"),
    "random without count": ({"method": "random"}, [], "pass --count"),
    "missing program": ({"program": "no/such/program.py"}, [], "not found"),
    "unsupported macro": (
        {"command": ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}"]},
        [],
        "command macro ${args_no_hyphens} is not supported",
    ),
    "macro inside an argument": (
        {"command": ["${interpreter}", "${program}", "--a=${envvar:HOME}", "${args}"]},
        [],
        "command macro ${envvar:HOME} is not supported",
    ),
    "count 0": ({}, ["--count", "0"], "--count and --jobs must be >= 1"),
    "jobs 0": ({}, ["--jobs", "0"], "--count and --jobs must be >= 1"),
    "count not a number": ({}, ["--count", "many"], "invalid int value: 'many'"),
    "resume of nothing": ({}, ["--resume"], "--resume: no sweep in"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_exit_2(case: str, tmp_path: Path) -> None:
    change, args, message = BAD_INPUTS[case]
    if change is None:
        path = tmp_path / "absent.yaml"
    elif isinstance(change, str):
        path = tmp_path / "broken.yaml"
        path.write_text(change)
    else:
        path = write_sweep(tmp_path, "bad", **change)
    stderr = io.StringIO()
    assert sweep_cli.main([str(path), "--out", str(tmp_path / "out"), *args], io.StringIO(), stderr) == 2
    assert stderr.getvalue().startswith("error: ") and stderr.getvalue().count("\n") == 1
    assert message in stderr.getvalue()
    assert not (tmp_path / "out" / "sweep.json").exists()


def test_resume_refuses_another_sweep(grid: dict[str, Any], tmp_path: Path) -> None:
    other = write_sweep(tmp_path, "grid-test", parameters={"x": {"values": [3.0]}})
    stderr = io.StringIO()
    assert sweep_cli.main([str(other), "--out", str(grid["out"]), "--resume"], io.StringIO(), stderr) == 2
    assert "holds another sweep" in stderr.getvalue()


def test_a_grid_given_more_values_resumes_with_only_the_new_points(grid: dict[str, Any], tmp_path: Path) -> None:
    """More seeds for a finished sweep: --resume keeps its 6 trials and runs the 3 points with y = 3 only."""
    out, log = tmp_path / "out", tmp_path / "log"
    for trial in grid["trials"]:  # a copy of the finished sweep, so the module's stays as it is
        (out / trial["name"]).mkdir(parents=True)
        (out / trial["name"] / "results.json").write_text("{}")
    (out / "sweep.json").write_text((grid["out"] / "sweep.json").read_text())
    more = write_sweep(
        tmp_path,
        "grid-test",
        parameters={"x": {"values": GRID_X}, "y": {"values": [*GRID_Y, 3]}, "fail-above": {"value": 10.0**9}},
    )
    stderr = io.StringIO()
    assert sweep_cli.main([str(more), "--out", str(out), "--resume"], io.StringIO(), stderr) == 2  # fail-above changed
    assert "holds another sweep" in stderr.getvalue() and "beyond values added to a grid" in stderr.getvalue()
    moved = write_sweep(tmp_path, "grid-test", program="tests/other_program.py")
    assert (
        sweep_cli.main([str(moved), "--out", str(out), "--resume"], io.StringIO(), io.StringIO()) == 2
    )  # program changed
    more = write_sweep(
        tmp_path,
        "grid-test",
        parameters={"x": {"values": GRID_X}, "y": {"values": [*GRID_Y, 3]}, "fail-above": {"value": FAIL_ABOVE}},
    )
    result = run_cli([str(more), "--out", str(out), "--resume"], tmp_path, SWEEP_PROGRAM_LOG=str(log))
    assert result.returncode == 0, result.stderr
    assert [(start["trial"], start["argv"][1:3]) for start in launches(log)] == [
        (f"trial-{i:03d}", [f"--x={x}", "--y=3"]) for i, x in zip(range(7, 10), GRID_X)
    ]
    trials = report(out)
    assert [t["params"] for t in trials[:6]] == [t["params"] for t in grid["trials"]] and len(trials) == 9


def test_out_folder_holding_a_sweep_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out" / "trial-001").mkdir(parents=True)
    stderr = io.StringIO()
    path = write_sweep(tmp_path, "again")
    assert sweep_cli.main([str(path), "--out", str(tmp_path / "out")], io.StringIO(), stderr) == 2
    assert "already holds a sweep" in stderr.getvalue()


def test_best_metric_follows_the_goal() -> None:
    rows = [{"val/acc": 0.4}, {"loss": 1.0}, {"val/acc": 0.7}, {"val/acc": float("nan")}, {"val/acc": 0.6}]
    assert sweep_cli.best_metric(rows, "val/acc", "maximize") == 0.7
    assert sweep_cli.best_metric(rows, "val/acc", "minimize") == 0.4
    assert sweep_cli.best_metric([{"loss": 1.0}], "val/acc", "minimize") is None


def refusal(stderr: str, out: Path, error: str) -> None:
    """The sweep stopped after its first trial, refused by the program: the runner names the trial's log and quotes
    the program's one-line error from it, in one line."""
    log = out / "trial-001" / "output.log"
    assert f"[sweep] trial-001 failed (exit code 2; its output: {log}) in " in stderr
    lines = [line for line in stderr.splitlines() if "was refused" in line]
    assert lines == [
        f"[sweep] trial-001's command was refused ({error}); starting no more trials: fix the sweep's parameters or "
        "command"
    ], stderr
    assert log.read_text().strip().splitlines()[-1] == error
    assert [trial["name"] for trial in report(out)] == ["trial-001"] and not (out / "trial-002").exists()


def test_an_unknown_parameter_fails_in_its_trial_whose_log_the_runner_names(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, "misspelled", parameters={"x": {"values": [1.0, 2.0]}, "fail_above": {"value": 3.0}})
    result = run_cli([str(path), "--out", str(tmp_path / "out")], tmp_path, SWEEP_PROGRAM_LOG=str(tmp_path / "log"))
    assert result.returncode == 1, result.stderr  # every trial (the one) failed
    refusal(result.stderr, tmp_path / "out", "sweep_program.py: error: unrecognized arguments: --fail_above=3.0")
    assert not (tmp_path / "log").exists()  # the program refused the command before it started


def test_an_experiment_script_names_the_unknown_parameter_and_its_close_flags_in_the_runners_line(
    tmp_path: Path,
) -> None:
    command = ["${env}", "${interpreter}", "-m", "experiments.sine", "${args}"]
    path = write_sweep(
        tmp_path,
        "sine-typo",
        program="experiments/sine.py",
        command=command,
        metric={"name": "val/mse"},
        parameters={"inner-rl": {"values": [0.01, 0.1]}, "meta_batch": {"value": 5}},
    )
    result = run_cli([str(path), "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 1, result.stderr
    log = (tmp_path / "out" / "trial-001" / "output.log").read_text().strip().splitlines()
    assert log[-1].startswith("error: unknown flag --inner-rl (did you mean --inner-lr, "), log
    refusal(result.stderr, tmp_path / "out", log[-1])
    fixed = write_sweep(
        tmp_path,
        "sine-ok",
        program="experiments/sine.py",
        command=command,
        metric={"name": "val/mse"},
        parameters={"inner_lr": {"values": [0.01, 0.1]}, "meta_batch": {"value": 5}},
    )
    stdout = io.StringIO()
    assert sweep_cli.main([str(fixed), "--dry-run"], stdout, io.StringIO()) == 0  # --inner_lr is --inner-lr there
    assert "--inner_lr=0.01 --meta_batch=5 --out <out>/trial-001 --wandb offline" in stdout.getvalue()
