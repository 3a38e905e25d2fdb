"""Run a W&B sweep file offline: W&B's own search engine, and what each trial wrote to its folder.

The sweep files run online unchanged (``wandb sweep FILE``, then ``wandb agent ID``), but wandb has
no offline sweeps (its agent asks a server for each trial), so this module plays both parts: it
asks W&B's search engine (the ``sweeps`` package: grid, random, bayes) for the next parameters,
telling it every trial so far; runs the trial as the agent would (the file's ``command``, made of
``${env} ${interpreter} ${program} ${args}``) plus ``--out OUT/trial-NNN --wandb offline``; and
scores it by the metric's best value (min or max by its goal, as W&B does) in the trial's own
``metrics.jsonl``, never from wandb's run files. Failed trials are recorded and the sweep goes on;
one reaching ``metric.target`` ends it. ``OUT/sweep.json`` records each trial as it starts and ends,
so ``--resume`` keeps the trials that ran to their end, runs a cut one again (with ``--resume`` if
its folder has a checkpoint, else ``--overwrite``) and lets the engine pick the rest. ``--jobs N``
runs N trials at once on a share of the cores each. With a ``seed`` parameter, the trials' test
metrics (``results.json``) are summarised over seeds in ``OUT/summary.json`` and ``OUT/summary.md``.

Usage:
    python -m experiments.sweep experiments/sweeps/sine-seeds.yaml --out runs/seeds [--jobs 2] [--resume]
    python -m experiments.sweep my-bayes.yaml --count 20 --seed 0 --dry-run
    python -m experiments.sweep --summarize runs/seeds

Exit codes: 0 when the sweep ran (failed trials included), 1 when every trial failed, 2 for bad
input (one ``error:`` line), 130 when interrupted (Ctrl-C or SIGTERM: trials stopped, resumable).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np
import yaml

from experiments.cli import UsageError
from experiments.files import atomic_write
from experiments.rundir import METRICS_FILE

with warnings.catch_warnings():  # the engine's pydantic deprecation warnings
    warnings.simplefilter("ignore")
    import sweeps

REPO_ROOT = Path(__file__).resolve().parents[1]
MACROS = ("${env}", "${interpreter}", "${program}", "${args}")  # wandb's default command; the only forms built
DONE = ("finished", "failed")  # trials that ran to their end: --resume keeps them
SAME_TRIALS = ("method", "parameters", "command", "program")  # what --resume needs unchanged (a grid may add values)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # our scripts' exit codes when stopped with a checkpoint


class SweepError(Exception):
    """Bad input: the message says what to fix (one ``error:`` line, exit code 2)."""


@dataclass
class Sweep:
    """A checked sweep file, and what the runner takes from it."""

    path: Path
    name: str  # also the trials' wandb group
    config: dict[str, Any]  # the YAML as written
    engine: dict[str, Any]  # the config as the engine fills it in
    metric: str
    goal: str  # minimize or maximize
    command: list[str]
    program: Path | None  # the ``program`` file, where found
    ours: bool  # it runs through experiments.fit: has --threads, takes --inner_lr for --inner-lr

    @property
    def searched(self) -> list[str]:
        """The parameters the search varies (not fixed with ``value:``)."""
        return [name for name, spec in self.config["parameters"].items() if "value" not in spec]


@dataclass
class Trial:
    """One trial; ``state``: pending, running, finished (exit 0), failed, or killed (by a signal: re-run on resume)."""

    index: int
    name: str
    params: dict[str, Any]
    state: str = "pending"
    metric: float | None = None
    exit_code: int | None = None
    wall_time: float | None = None
    error: str | None = None
    command: list[str] = field(default_factory=list)


def load_sweep(path: Path) -> Sweep:
    """Reads and checks a sweep file in wandb's format.

    Raises:
        SweepError: An unreadable or invalid file, no metric, a file the engine rejects, an
            unsupported command macro or a missing program.
    """
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise SweepError(f"sweep file {path} not found or not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict) or not isinstance(config.get("metric"), dict) or not config["metric"].get("name"):
        raise SweepError(f"{path} needs a metric to rank its trials, e.g. metric: {{name: val/mse, goal: minimize}}")
    if type(config.get("run_cap", 1)) is not int or config.get("run_cap", 1) < 1:
        raise SweepError(f"{path}: run_cap must be a positive integer (got {config['run_cap']!r})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine_input = {key: value for key, value in config.items() if key != "run_cap"}  # not in the engine's schema
        problems = sweeps.schema_violations_from_proposed_config(engine_input)
        if problems:
            raise SweepError(f"{path} is not a valid sweep config: {'; '.join(problems)}")
        engine = dict(sweeps.SweepConfig(engine_input))
        try:  # what the schema lets through, e.g. a grid over a continuous range
            sweeps.next_run(engine, [])
        except (ValueError, TypeError, KeyError) as error:
            raise SweepError(f"{path}: the {config['method']} search cannot use these parameters: {error}") from None
    command = [str(part) for part in config.get("command") or MACROS]
    for macro in re.findall(r"\$\{[^}]*\}", " ".join(command)):
        if macro not in MACROS or macro not in command:
            raise SweepError(f"{path}: command macro {macro} is not supported offline, only {' '.join(MACROS)}")
    found = [base / config["program"] for base in (Path.cwd(), REPO_ROOT, path.parent) if config.get("program")]
    program = next((file.resolve() for file in found if file.is_file()), None)
    if program is None and "${program}" in command:
        raise SweepError(f"{path}: program {config.get('program')!r} not found from {Path.cwd()} or {REPO_ROOT}")
    ours = program is not None and "fit.fit(" in program.read_text(errors="replace")
    name = re.sub(r"[^\w.-]+", "-", str(config.get("name") or path.stem))
    goal = engine["metric"].get("goal", "minimize")
    return Sweep(path, name, config, engine, config["metric"]["name"], goal, command, program, ours)


def next_trial(sweep: Sweep, trials: list[Trial], limit: int | None) -> Trial | None:
    """The first pending trial, else a new one from the engine (appended); None at the limit or the grid's end.

    The engine hears of every trial: ended ones with their state and score (bayes learns from
    them), the others as running (a grid does not repeat them).
    """
    if pending := [trial for trial in trials if trial.state == "pending"]:
        return pending[0]
    if limit is not None and len(trials) >= limit:
        return None
    runs = [sweeps.SweepRun(name=trial.name, state=trial.state if trial.state in (*DONE, "killed") else "running",
                            config={key: {"value": value} for key, value in trial.params.items()},
                            summaryMetrics={} if trial.metric is None else {sweep.metric: trial.metric})
            for trial in trials]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's, fitting bayes search
        run = sweeps.next_run(sweep.engine, runs)
    if run is None:
        return None
    params = {key: spec["value"].item() if hasattr(spec["value"], "item") else spec["value"]  # numpy scalars
              for key, spec in run.config.items()}  # fmt: skip
    trials.append(Trial(len(trials) + 1, f"trial-{len(trials) + 1:03d}", params))
    return trials[-1]


def build_command(sweep: Sweep, params: dict[str, Any], trial_dir: Path) -> list[str]:
    """A trial's command as ``wandb agent`` builds it, plus ``--out TRIAL_DIR --wandb offline``."""
    args = [f"--{name}={value}" for name, value in params.items()]
    macros = {"${env}": [], "${interpreter}": [sys.executable], "${program}": [str(sweep.program)], "${args}": args}
    command = [arg for part in sweep.command for arg in macros.get(part, [part])]
    return [*command, "--out", str(trial_dir), "--wandb", "offline"]


def trial_env(sweep: Sweep, trial_dir: Path, threads: int | None) -> dict[str, str]:
    """A trial's environment: offline wandb with the sweep as group, this repository importable, its threads."""
    env = {key: value for key, value in os.environ.items() if key not in ("WANDB_SWEEP_ID", "WANDB_RUN_ID")}
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env |= {"WANDB_MODE": "offline", "WANDB_RUN_GROUP": sweep.name, "WANDB_NAME": f"{sweep.name}-{trial_dir.name}",
            "WANDB_DIR": str(trial_dir), "PYTHONPATH": path}  # fmt: skip
    return env | ({"OMP_NUM_THREADS": str(threads)} if threads else {})


def check_parameters(sweep: Sweep) -> None:
    """Checks that a Python program's ``--help`` lists a flag for each parameter; others are not checked.

    Raises:
        SweepError: A parameter that is no flag of the program (every trial would fail on it), with close matches.
    """
    source = sweep.program.read_text(errors="replace") if sweep.program and sweep.program.suffix == ".py" else ""
    if "${args}" not in sweep.command or not (sweep.ours or "argparse" in source):
        return
    command = build_command(sweep, {}, Path("<out>"))[:-4] + ["--help"]  # without --out <out> --wandb offline
    try:
        shown = subprocess.run(command, env=trial_env(sweep, Path("help"), None), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return
    flags = sorted(set(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", shown.stdout))) if shown.returncode == 0 else []
    for name in sweep.config["parameters"] if flags else ():
        if f"--{name}" not in flags and not (sweep.ours and f"--{name.replace('_', '-')}" in flags):
            matches = difflib.get_close_matches(f"--{name}", flags, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(matches)}?)" if matches else ""
            raise SweepError(f"{sweep.path}: the parameter {name!r} is not a flag of {sweep.config['program']}{hint}; "
                             f"every trial would fail on it. Rename it under parameters (the program's --help lists "
                             f"its flags).")  # fmt: skip


def best_metric(rows: Sequence[dict[str, Any]], metric: str, goal: str) -> float | None:
    """The metric's best finite value in the rows (max for ``goal: maximize``, else min); None if it has none."""
    values = [row[metric] for row in rows if type(row.get(metric)) in (int, float) and math.isfinite(row[metric])]
    return float((max if goal == "maximize" else min)(values)) if values else None


def score(sweep: Sweep, trial_dir: Path) -> float | None:
    """The metric's best value in the ``metrics.jsonl`` the trial wrote; None if it logged none."""
    try:  # whole lines only: a line a kill cut short has no newline
        rows = [json.loads(line) for line in (trial_dir / METRICS_FILE).read_text().split("\n")[:-1] if line]
    except (OSError, ValueError):
        return None
    return best_metric(rows, sweep.metric, sweep.goal)


def _show(value: Any, digits: int = 6) -> str:
    """A value for a table: a float to ``digits`` significant digits, None as ``-``."""
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def format_table(trials: Sequence[Trial], sweep: Sweep) -> str:
    """The trials best first (finished ones by their metric, then the rest in order), one line each."""
    sign = -1 if sweep.goal == "maximize" else 1
    scored = [trial for trial in trials if trial.state == "finished" and trial.metric is not None]
    scored.sort(key=lambda trial: sign * trial.metric)
    rows = [["#", "trial", "parameters", f"{sweep.metric} ({sweep.goal[:3]})", "state", "time"]]
    for place, trial in enumerate(scored + [trial for trial in trials if trial not in scored], 1):
        params = " ".join(f"{name}={_show(trial.params.get(name))}" for name in sweep.searched or trial.params)
        wall = "-" if trial.wall_time is None else f"{trial.wall_time:.1f}s"
        rows.append([str(place), trial.name, params, _show(trial.metric), trial.state, wall])
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def start_trial(sweep: Sweep, trial: Trial, out: Path, threads: int | None) -> subprocess.Popen[bytes]:
    """Starts a trial's process, its output in ``output.log``; a cut trial's again with --resume or --overwrite."""
    folder = out / trial.name
    again = (("checkpoint.pt", "--resume"), ("config.yaml", "--overwrite"))  # a cut trial's folder, by what it holds
    cut = [flag for file, flag in again if (folder / file).exists()]
    share = ["--threads", str(threads)] if threads and sweep.ours and "threads" not in trial.params else []
    trial.command = build_command(sweep, trial.params, folder) + cut[:1] + share
    trial.state, trial.exit_code, trial.error = "running", None, None
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "output.log", "ab") as log:
        return subprocess.Popen(trial.command, env=trial_env(sweep, folder, threads), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def end_trial(sweep: Sweep, trial: Trial, out: Path, code: int, note: Callable[[str], None]) -> bool:
    """Records how a trial's process ended and says so; returns whether it reached the metric's target."""
    trial.exit_code, trial.metric = code, score(sweep, out / trial.name)
    stopped = code < 0 or code in STOPPED
    trial.state = "finished" if code == 0 else "killed" if stopped else "failed"
    trial.error = None if code == 0 else f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    scored = f"{sweep.metric}={trial.metric:.6g}" if trial.metric is not None else f"no {sweep.metric} logged"
    why = f" ({trial.error}; its output: {out / trial.name / 'output.log'})" if trial.error else ""
    note(f"{trial.name} {trial.state}{why} in {trial.wall_time:.1f}s: {scored}")
    target = sweep.config["metric"].get("target")
    if code != 0 or target is None or trial.metric is None:
        return False
    return trial.metric >= target if sweep.goal == "maximize" else trial.metric <= target


def run_sweep(sweep: Sweep, out: Path, trials: list[Trial], limit: int | None, jobs: int, save: Callable[[], None],
              progress: TextIO) -> None:  # fmt: skip
    """Runs ``jobs`` trials at a time, the pending ones of ``trials`` first, until the limit, grid or target.

    ``trials`` grows as they start, in the engine's order whatever ``jobs`` is; ``save`` runs
    whenever one starts or ends.

    Raises:
        KeyboardInterrupt: After stopping the running trials (recorded as killed, to run again on --resume).
    """
    threads = max(1, len(os.sched_getaffinity(0)) // jobs) if jobs > 1 else None
    running: dict[subprocess.Popen[bytes], tuple[Trial, float]] = {}
    stop = False

    def note(text: str) -> None:
        print(f"[sweep] {text}", file=progress, flush=True)

    try:
        while True:
            while len(running) < jobs and not stop and (trial := next_trial(sweep, trials, limit)):
                note(f"{trial.name} ({trial.index}{f'/{limit}' if limit else ''}): "
                     + " ".join(f"{key}={value}" for key, value in trial.params.items()))  # fmt: skip
                try:
                    running[start_trial(sweep, trial, out, threads)] = (trial, time.monotonic())
                except OSError as error:
                    trial.state, trial.error = "failed", f"could not start: {error}"
                save()
            if not running:
                return
            time.sleep(0.02)
            for process, (trial, started) in list(running.items()):
                if process.poll() is not None:
                    del running[process]
                    trial.wall_time = time.monotonic() - started
                    if end_trial(sweep, trial, out, process.returncode, note):
                        note(f"{trial.name} reached the target {sweep.metric}; starting no more trials")
                        stop = True
                    save()
    except KeyboardInterrupt:  # Ctrl-C reaches the trials too (they stop with a checkpoint); kill may not have
        grace = time.monotonic() + 5
        for process in running:
            try:
                process.wait(timeout=max(0.0, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()  # one signal: a second one stops our scripts at once
        for process, (trial, started) in running.items():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            trial.state, trial.error, trial.wall_time = "killed", "interrupted", time.monotonic() - started
        save()
        raise


def _mean(values: Sequence[float]) -> float | None:
    """The mean (NaN with a NaN among them: a diverged run shows), None for no values."""
    return sum(values) / len(values) if values else None


def summarize(out: Path) -> tuple[dict[str, Any], str]:
    """The trials' test metrics over seeds, grouped by the other parameters, as data and as Markdown.

    Per group and test metric (each entry of ``results.json``'s ``test`` by its first value, e.g.
    ``5shot_1step mse``): the mean over the seeds that finished, their sample standard deviation
    (n - 1), the mean of the runs' 95 % CI half-widths and n; per group the mean ``train_seconds``.
    """
    try:
        trials = json.loads((out / "sweep.json").read_text())["trials"]
    except (OSError, ValueError, KeyError):
        raise SweepError(f"no sweep in {out} (no readable sweep.json)") from None
    groups: dict[str, dict[str, Any]] = {}
    for trial in trials:
        others = {key: value for key, value in trial["params"].items() if key != "seed"}
        group = groups.setdefault(json.dumps(others), {"params": others, "seeds": [], "metrics": {}, "runs": []})
        group["seeds"].append(trial["params"].get("seed"))
        if (path := out / trial["name"] / "results.json").is_file():
            group["runs"].append(json.loads(path.read_text()))
    for group in groups.values():
        runs = group.pop("runs")
        for key in dict.fromkeys(key for run in runs for key in run["test"]):
            entries = [run["test"][key] for run in runs if key in run["test"]]
            values = [float(next(iter(entry.values()))) for entry in entries]
            mean, n = _mean(values), len(values)
            std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1)) if n > 1 else None
            group["metrics"][f"{key} {next(iter(entries[0]))}"] = {
                "mean": mean, "std": std, "mean_ci95": _mean([entry["ci95"] for entry in entries]), "n": n}
        group["train_seconds"] = _mean([run["train_seconds"] for run in runs])
    names = list(dict.fromkeys(name for group in groups.values() for name in group["metrics"]))
    lines = ["mean +- std over seeds (mean 95 % CI of one run, seeds finished)", "",
             f"| parameters | {' | '.join(names)} | train s |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for group in groups.values():
        cells = [" ".join(f"{key}={value}" for key, value in group["params"].items()) or "-"]
        for name in names:
            m = group["metrics"].get(name)
            cells.append(f"{_show(m['mean'], 4)} +- {_show(m['std'], 4)} (CI {_show(m['mean_ci95'], 4)}, n={m['n']})"
                         if m else "-")  # fmt: skip
        lines.append(f"| {' | '.join(cells)} | {_show(group['train_seconds'], 4)} |")
    return {"groups": list(groups.values())}, "\n".join(lines) + "\n"


def open_out(out: Path | None, sweep: Sweep, resume: bool) -> tuple[Path, list[Trial], int | None]:
    """The sweep's folder, created; on ``--resume`` also its trials (cut ones pending again) and its seed."""
    out = (out or Path("runs") / "sweeps" / f"{sweep.name}-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if not resume:
        if (out / "sweep.json").exists() or any(out.glob("trial-*")):
            raise SweepError(f"{out} already holds a sweep; pass --resume to continue it, or a new --out folder")
        out.mkdir(parents=True, exist_ok=True)
        return out, [], None
    try:
        report = json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError):
        raise SweepError(f"--resume: no sweep in {out} (no readable sweep.json)") from None
    recorded = report["sweep"]["config"]
    changed = [key for key in SAME_TRIALS if key != "parameters" and recorded.get(key) != sweep.config.get(key)]
    if changed or not _extends(recorded, sweep.config):
        raise SweepError(f"--resume: {out} holds another sweep than {sweep.path} ({', '.join(SAME_TRIALS)} differ, "
                         f"beyond values added to a grid's parameters)")  # fmt: skip
    trials = [Trial(**trial) for trial in report["trials"]]
    for trial in trials:
        if trial.state not in DONE or trial.exit_code in STOPPED:  # cut, or it ended before the sweep recorded it
            ended = (out / trial.name / "results.json").is_file()
            trial.state, trial.metric = ("finished", score(sweep, out / trial.name)) if ended else ("pending", None)
    return out, trials, report["sweep"]["seed"]


def _extends(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new``'s parameters are ``old``'s, or a grid's with values added (more seeds): then the new points run."""
    before, after = old.get("parameters", {}), new.get("parameters", {})
    if before == after:
        return True
    if new.get("method") != "grid" or set(before) != set(after):
        return False

    def values(spec: dict[str, Any]) -> list[Any] | None:
        """A grid parameter's values; None for a spec with more than ``value``/``values``."""
        return None if set(spec) - {"value", "values"} else spec.get("values", [spec.get("value")])

    for key in before:
        was, now = values(before[key]), values(after[key])
        if was is None or now is None or any(v not in now for v in was):
            return False
    return True


def write_report(out: Path, sweep: Sweep, trials: Sequence[Trial], seed: int) -> None:
    """Writes ``OUT/sweep.json``: the sweep's file, name, config and seed, and every trial."""
    settings = {"name": sweep.name, "file": _portable(str(sweep.path)), "seed": seed, "config": sweep.config}
    report = {"sweep": settings, "trials": [asdict(trial) | {"command": list(map(_portable, trial.command))}
                                            for trial in trials]}  # fmt: skip
    atomic_write(out / "sweep.json", lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))


def _portable(arg: str) -> str:
    """A command word as it reads on any machine: ``python`` for this interpreter, paths inside the repository
    relative to its root (a sweep's folder is then committable and resumes from another clone)."""
    if arg == sys.executable:
        return "python"
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(REPO_ROOT):
        return path.relative_to(REPO_ROOT).as_posix()
    return arg


def dry_run(sweep: Sweep, limit: int | None, seed: int, stdout: TextIO) -> None:
    """Prints the trials the sweep would run (for bayes only the first is sure) and the first one's command."""
    trials: list[Trial] = []
    while trial := next_trial(sweep, trials, limit):
        trial.state = "planned"  # the engine counts it as running
    method = sweep.config["method"]
    print(f"{sweep.name}: {method} search, {len(trials)} trial(s), metric {sweep.metric} ({sweep.goal}), seed {seed}"
          + ("; the later trials depend on the results" if method == "bayes" else ""), file=stdout)  # fmt: skip
    for trial in trials:
        print(trial.name, *(f"{key}={_show(value)}" for key, value in trial.params.items()), file=stdout)
    print("command:", *build_command(sweep, trials[0].params, Path("<out>") / trials[0].name), file=stdout)


def _usage(message: str) -> NoReturn:
    """argparse's errors as ours: one ``error:`` line, exit code 2."""
    raise SweepError(message)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Runs the command line (see the module docstring) and returns the exit code."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, nargs="?", help="sweep YAML in wandb's format")
    parser.add_argument("--out", type=Path, help="the sweep's folder (default: runs/sweeps/NAME-TIME)")
    parser.add_argument("--count", type=int, help="at most N trials in all (random and bayes need it, or run_cap)")
    parser.add_argument("--seed", type=int, help="seed of the engine's random choices (default: a fresh one)")
    parser.add_argument("--jobs", type=int, default=1, help="trials run at once, each on its share of the cores")
    parser.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    parser.add_argument("--dry-run", action="store_true", help="list the trials and the first command; run nothing")
    parser.add_argument("--summarize", type=Path, metavar="DIR", help="print the summary over seeds of a sweep")
    parser.error = _usage  # type: ignore[method-assign]
    try:
        args = parser.parse_args(argv)
        if args.summarize is not None:
            print(summarize(args.summarize)[1], end="", file=stdout)
            return 0
        if args.sweep is None or min(args.jobs, 1 if args.count is None else args.count) < 1:
            raise SweepError("pass a sweep file (or --summarize DIR); --count and --jobs must be >= 1")
        sweep = load_sweep(args.sweep)
        limit = min(filter(None, (args.count, sweep.config.get("run_cap"))), default=None)
        if limit is None and sweep.config["method"] != "grid":
            raise SweepError(f"a {sweep.config['method']} search does not end by itself: pass --count N or set run_cap")
        check_parameters(sweep)
        out, trials, recorded = (None, [], None) if args.dry_run else open_out(args.out, sweep, args.resume)
        seed = next(s for s in (args.seed, recorded, random.SystemRandom().randrange(2**31)) if s is not None)
        random.seed(seed + len(trials))  # the engine's random source (numpy's for bayes); fresh draws on --resume
        np.random.seed((seed + len(trials)) % 2**32)
        if out is None:
            dry_run(sweep, limit, seed, stdout)
            return 0
        print(f"[sweep] {sweep.name}: {sweep.config['method']} search, seed {seed}, in {out}", file=stderr, flush=True)
        try:
            save = functools.partial(write_report, out, sweep, trials, seed)
            run_sweep(sweep, out, trials, limit, args.jobs, save, stderr)
        except KeyboardInterrupt:
            print(format_table(trials, sweep), file=stdout)
            print("[sweep] interrupted; the same command plus --resume continues it", file=stderr)
            return 130
        print(format_table(trials, sweep), file=stdout)
        if "seed" in sweep.config["parameters"]:
            summary, markdown = summarize(out)
            atomic_write(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
            atomic_write(out / "summary.md", lambda tmp: tmp.write_text(markdown))
            print(f"\n{markdown}", end="", file=stdout)
    except (SweepError, UsageError) as error:
        print(f"error: {error}", file=stderr)
        return 2
    print(f"[sweep] {len(trials)} trial(s) in {out / 'sweep.json'}", file=stderr)
    return 1 if trials and all(trial.state != "finished" for trial in trials) else 0


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, a cluster's pre-emption) stops the sweep as Ctrl-C does: trials stopped, resumable."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Ctrl-C stops the sweep even when it was started with SIGINT ignored (a shell's background job passes
    # that on, and Python then installs no KeyboardInterrupt handler): the runner's trials must be stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
