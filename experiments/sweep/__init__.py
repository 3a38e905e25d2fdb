"""Run a W&B sweep file offline: W&B's own search engine, and what each trial wrote to its folder.

wandb's agent asks a server for each trial, so this module plays both parts: the ``sweeps`` package (grid,
random, bayes), told of every trial so far, picks the next parameters; the trial runs the file's ``command`` as
the agent builds it, plus ``--out OUT/trial-NNN --wandb offline``, and scores by the metric's best value in its
own ``metrics.jsonl``. ``OUT/sweep.json`` records each trial as it starts and ends, for ``--resume``. A trial
the program refuses as a usage error (exit code 2: a parameter it has no flag for, a value it refuses) is named
with its log and the log's last line, and no more trials start.

Usage:
    python -m experiments.sweep experiments/sweeps/sine-seeds.yaml --out runs/seeds [--jobs 2] [--resume]
    python -m experiments.sweep my-bayes.yaml --count 20 --seed 0 --dry-run
    python -m experiments.sweep --summarize runs/seeds

Exit codes: 0 when the sweep ran (failed trials included), 1 when every trial failed, 2 for bad
input (one ``error:`` line), 130 when interrupted (Ctrl-C or SIGTERM: trials stopped, resumable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np

from experiments.harness.folder import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    METRICS_FILE,
    FolderLock,
    UsageError,
    atomic_write,
)
from experiments.sweep.trials import (
    DONE,
    REPO_ROOT,
    Sweep,
    Trial,
    build_command,
    load_sweep,
    next_trial,
    start_trial,
)

__all__ = ["load_sweep", "best_metric", "format_table", "summarize", "dry_run", "main"]

STOPPED = (EXIT_INTERRUPTED, EXIT_TERMINATED)  # our scripts' exit codes when stopped with a checkpoint
SAME_TRIALS = ("method", "parameters", "command", "program")  # what --resume needs unchanged (a grid may add values)


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


def last_line(log: Path) -> str:
    """The last line a trial wrote to its log (a refused command's error), or ``no output``."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1].strip() if lines else "no output"


def run_sweep(
    sweep: Sweep, out: Path, trials: list[Trial], limit: int | None, jobs: int, seed: int, progress: TextIO
) -> None:
    """Runs ``jobs`` trials at a time, the pending ones first, until the limit, the grid's end or the target; writes
    sweep.json as each starts and ends. KeyboardInterrupt stops the running trials (killed: resumed later)."""
    threads = max(1, len(os.sched_getaffinity(0)) // jobs) if jobs > 1 else None
    running: dict[subprocess.Popen[bytes], tuple[Trial, float]] = {}
    target, stop = sweep.config["metric"].get("target"), False

    def note(text: str) -> None:
        print(f"[sweep] {text}", file=progress, flush=True)

    try:
        while True:
            while len(running) < jobs and not stop and (trial := next_trial(sweep, trials, limit)):
                params = " ".join(f"{key}={value}" for key, value in trial.params.items())
                note(f"{trial.name} ({trial.index}{f'/{limit}' if limit else ''}): {params}")
                try:
                    running[start_trial(sweep, trial, out, threads)] = (trial, time.monotonic())
                except OSError as error:
                    trial.state, trial.error = "failed", f"could not start: {error}"
                write_report(out, sweep, trials, seed)
            if not running:
                return
            time.sleep(0.02)
            for process, (trial, started) in list(running.items()):
                if (code := process.poll()) is None:
                    continue
                del running[process]
                trial.exit_code, trial.metric = code, score(sweep, out / trial.name)
                trial.state = "finished" if code == 0 else "killed" if code < 0 or code in STOPPED else "failed"
                trial.error = None if code == 0 else f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                trial.wall_time = time.monotonic() - started
                log = out / trial.name / "output.log"
                why = f" ({trial.error}; its output: {log})" if trial.error else ""
                got = f"no {sweep.metric} logged" if trial.metric is None else f"{sweep.metric}={trial.metric:.6g}"
                note(f"{trial.name} {trial.state}{why} in {trial.wall_time:.1f}s: {got}")
                if code == EXIT_USAGE:  # a flag the program does not take, a value it refuses: the next trials' too
                    refused = f"{trial.name}'s command was refused ({last_line(log)})"
                    note(f"{refused}; starting no more trials: fix the sweep's parameters or command")
                    stop = True
                if code == 0 and target is not None and trial.metric is not None:
                    if trial.metric >= target if sweep.goal == "maximize" else trial.metric <= target:
                        note(f"{trial.name} reached the target {sweep.metric}; starting no more trials")
                        stop = True
                write_report(out, sweep, trials, seed)
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
        write_report(out, sweep, trials, seed)
        raise


def open_out(out: Path | None, sweep: Sweep, resume: bool, lock: FolderLock) -> tuple[Path, list[Trial], int | None]:
    """The sweep's folder, created and taken with ``lock``; on ``--resume`` also its trials (cut ones pending again) and seed."""
    out = (out or Path("runs") / "sweeps" / f"{sweep.name}-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if not resume:
        if (out / "sweep.json").exists() or any(out.glob("trial-*")):
            raise UsageError(f"{out} already holds a sweep; pass --resume to continue it, or a new --out folder")
        out.mkdir(parents=True, exist_ok=True)
        lock.take(out)
        return out, [], None
    if out.is_dir():
        lock.take(out)  # before reading sweep.json: a runner still going there rewrites it
    try:
        report = json.loads((out / "sweep.json").read_text())
    except (OSError, ValueError):
        raise UsageError(f"--resume: no sweep in {out} (no readable sweep.json)") from None
    recorded = report["sweep"]["config"]
    changed = [key for key in SAME_TRIALS if key != "parameters" and recorded.get(key) != sweep.config.get(key)]
    if changed or not _extends(recorded, sweep.config):
        raise UsageError(
            f"--resume: {out} holds another sweep than {sweep.path} ({', '.join(SAME_TRIALS)} differ, "
            f"beyond values added to a grid's parameters)"
        )
    trials = [Trial(**trial) for trial in report["trials"]]
    for trial in trials:
        if trial.state not in DONE or trial.exit_code in STOPPED:  # cut, or it ended before the sweep recorded it
            ended = (out / trial.name / "results.json").is_file()
            trial.state, trial.metric = ("finished", score(sweep, out / trial.name)) if ended else ("pending", None)
    return out, trials, report["sweep"]["seed"]


def _extends(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new``'s parameters are ``old``'s, or a grid's with values added (more seeds): the new points run."""
    before, after = old.get("parameters", {}), new.get("parameters", {})
    if before == after:
        return True
    if new.get("method") != "grid" or set(before) != set(after):
        return False

    def values(spec: dict[str, Any]) -> list[Any]:
        return spec.get("values", [spec.get("value")])

    plain = not any(set(spec) - {"value", "values"} for spec in [*before.values(), *after.values()])
    return plain and all(value in values(after[key]) for key in before for value in values(before[key]))


def write_report(out: Path, sweep: Sweep, trials: Sequence[Trial], seed: int) -> None:
    """Writes ``OUT/sweep.json``: the sweep's file, name, config and seed, and every trial."""

    def portable(arg: str) -> str:  # ``python``, and paths inside the repository from its root: resumable elsewhere
        path = Path(arg)
        if arg == sys.executable:
            return "python"
        return path.relative_to(REPO_ROOT).as_posix() if path.is_absolute() and path.is_relative_to(REPO_ROOT) else arg

    report = {
        "sweep": {"name": sweep.name, "file": portable(str(sweep.path)), "seed": seed, "config": sweep.config},
        "trials": [asdict(trial) | {"command": list(map(portable, trial.command))} for trial in trials],
    }
    atomic_write(out / "sweep.json", lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))


def _show(value: Any, digits: int = 6) -> str:
    """A value for a table: a float to ``digits`` significant digits, None as ``-``."""
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def format_table(trials: Sequence[Trial], sweep: Sweep) -> str:
    """The trials best first (finished ones by their metric, then the rest in order), one line each."""
    sign = -1 if sweep.goal == "maximize" else 1
    scored = sorted(
        (t for t in trials if t.state == "finished" and t.metric is not None), key=lambda t: sign * t.metric
    )
    rows = [["#", "trial", "parameters", f"{sweep.metric} ({sweep.goal[:3]})", "state", "time"]]
    for place, trial in enumerate(scored + [trial for trial in trials if trial not in scored], 1):
        params = " ".join(f"{name}={_show(trial.params.get(name))}" for name in sweep.searched or trial.params)
        wall = "-" if trial.wall_time is None else f"{trial.wall_time:.1f}s"
        rows.append([str(place), trial.name, params, _show(trial.metric), trial.state, wall])
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def summarize(out: Path) -> tuple[dict[str, Any], str]:
    """The trials' test metrics over seeds, grouped by the other parameters, as data and as Markdown: per test
    metric (``results.json``'s ``test`` entries by their first value, e.g. ``5shot mse``) the mean over the seeds
    that finished, their sample std (n - 1), the mean 95 % CI half-width and n; the mean ``train_seconds``."""
    try:
        trials = json.loads((out / "sweep.json").read_text())["trials"]
    except (OSError, ValueError, KeyError):
        raise UsageError(f"no sweep in {out} (no readable sweep.json)") from None
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
            mean, n = statistics.fmean(values), len(values)
            std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1)) if n > 1 else None
            ci95 = statistics.fmean(entry["ci95"] for entry in entries)
            group["metrics"][f"{key} {next(iter(entries[0]))}"] = {"mean": mean, "std": std, "mean_ci95": ci95, "n": n}
        group["train_seconds"] = statistics.fmean(run["train_seconds"] for run in runs) if runs else None
    names = list(dict.fromkeys(name for group in groups.values() for name in group["metrics"]))
    rows = [["parameters", *names, "train s"]]
    for group in groups.values():
        cells = {
            name: f"{_show(m['mean'], 4)} +- {_show(m['std'], 4)} (CI {_show(m['mean_ci95'], 4)}, n={m['n']})"
            for name, m in group["metrics"].items()
        }
        params = " ".join(f"{key}={value}" for key, value in group["params"].items()) or "-"
        rows.append([params, *(cells.get(name, "-") for name in names), _show(group["train_seconds"], 4)])
    lines = [f"| {' | '.join(row)} |" for row in rows]
    lines[1:1] = ["|---" * len(rows[0]) + "|"]
    caption = "mean +- std over seeds (mean 95 % CI of one run, seeds finished)\n\n"
    return {"groups": list(groups.values())}, caption + "\n".join(lines) + "\n"


def dry_run(sweep: Sweep, limit: int | None, seed: int, stdout: TextIO) -> None:
    """Prints the trials the sweep would run (for bayes only the first is sure) and the first one's command."""
    trials: list[Trial] = []
    while trial := next_trial(sweep, trials, limit):
        trial.state = "planned"  # the engine counts it as running
    method = sweep.config["method"]
    later = "; the later trials depend on the results" if method == "bayes" else ""
    plan = f"{method} search, {len(trials)} trial(s), metric {sweep.metric} ({sweep.goal}), seed {seed}{later}"
    print(f"{sweep.name}: {plan}", file=stdout)
    for trial in trials:
        print(trial.name, *(f"{key}={_show(value)}" for key, value in trial.params.items()), file=stdout)
    print("command:", *build_command(sweep, trials[0].params, Path("<out>") / trials[0].name), file=stdout)


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

    def usage(message: str) -> NoReturn:  # argparse's errors as ours: one ``error:`` line, exit code 2
        raise UsageError(message)

    parser.error = usage  # type: ignore[method-assign]
    lock = FolderLock()
    try:
        args = parser.parse_args(argv)
        if args.summarize is not None:
            print(summarize(args.summarize)[1], end="", file=stdout)
            return EXIT_OK
        if args.sweep is None or min(args.jobs, 1 if args.count is None else args.count) < 1:
            raise UsageError("pass a sweep file (or --summarize DIR); --count and --jobs must be >= 1")
        sweep = load_sweep(args.sweep)
        method = sweep.config["method"]
        limit = min(filter(None, (args.count, sweep.config.get("run_cap"))), default=None)
        if limit is None and method != "grid":
            raise UsageError(f"a {method} search does not end by itself: pass --count N or set run_cap")
        out, trials, recorded = (None, [], None) if args.dry_run else open_out(args.out, sweep, args.resume, lock)
        seed = next(s for s in (args.seed, recorded, random.SystemRandom().randrange(2**31)) if s is not None)
        random.seed(seed + len(trials))  # the engine's random source (numpy's for bayes); fresh draws on --resume
        np.random.seed((seed + len(trials)) % 2**32)
        if out is None:
            dry_run(sweep, limit, seed, stdout)
            return EXIT_OK
        print(f"[sweep] {sweep.name}: {method} search, seed {seed}, in {out}", file=stderr, flush=True)
        try:
            run_sweep(sweep, out, trials, limit, args.jobs, seed, stderr)
        except KeyboardInterrupt:
            print(format_table(trials, sweep), file=stdout)
            print("[sweep] interrupted; the same command plus --resume continues it", file=stderr)
            return EXIT_INTERRUPTED
        print(format_table(trials, sweep), file=stdout)
        if "seed" in sweep.config["parameters"]:
            summary, markdown = summarize(out)
            atomic_write(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
            atomic_write(out / "summary.md", lambda tmp: tmp.write_text(markdown))
            print(f"\n{markdown}", end="", file=stdout)
    except UsageError as error:
        print(f"error: {error}", file=stderr)
        return EXIT_USAGE
    finally:
        lock.release()  # the sweep's folder, for a caller that goes on (tests)
    print(f"[sweep] {len(trials)} trial(s) in {out / 'sweep.json'}", file=stderr)
    return EXIT_FAILED if trials and all(trial.state != "finished" for trial in trials) else EXIT_OK
