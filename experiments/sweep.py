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
import functools
import json
import math
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np

from experiments.cli import UsageError
from experiments.files import atomic_write
from experiments.lock import unlock_folders
from experiments.sweep_file import Sweep, Trial, build_command, check_parameters, load_sweep, next_trial
from experiments.sweep_runner import best_metric, open_out, run_sweep, write_report

__all__ = ["format_table", "summarize", "dry_run", "main", "load_sweep", "best_metric"]


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
            mean, n = _mean(values), len(values)
            std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1)) if n > 1 else None
            group["metrics"][f"{key} {next(iter(entries[0]))}"] = {
                "mean": mean,
                "std": std,
                "mean_ci95": _mean([entry["ci95"] for entry in entries]),
                "n": n,
            }
        group["train_seconds"] = _mean([run["train_seconds"] for run in runs])
    names = list(dict.fromkeys(name for group in groups.values() for name in group["metrics"]))
    lines = [
        "mean +- std over seeds (mean 95 % CI of one run, seeds finished)",
        "",
        f"| parameters | {' | '.join(names)} | train s |",
        "|---" * (len(names) + 2) + "|",
    ]
    for group in groups.values():
        cells = [" ".join(f"{key}={value}" for key, value in group["params"].items()) or "-"]
        for name in names:
            m = group["metrics"].get(name)
            cells.append(
                f"{_show(m['mean'], 4)} +- {_show(m['std'], 4)} (CI {_show(m['mean_ci95'], 4)}, n={m['n']})"
                if m
                else "-"
            )
        lines.append(f"| {' | '.join(cells)} | {_show(group['train_seconds'], 4)} |")
    return {"groups": list(groups.values())}, "\n".join(lines) + "\n"


def dry_run(sweep: Sweep, limit: int | None, seed: int, stdout: TextIO) -> None:
    """Prints the trials the sweep would run (for bayes only the first is sure) and the first one's command."""
    trials: list[Trial] = []
    while trial := next_trial(sweep, trials, limit):
        trial.state = "planned"  # the engine counts it as running
    method = sweep.config["method"]
    print(
        f"{sweep.name}: {method} search, {len(trials)} trial(s), metric {sweep.metric} ({sweep.goal}), seed {seed}"
        + ("; the later trials depend on the results" if method == "bayes" else ""),
        file=stdout,
    )
    for trial in trials:
        print(trial.name, *(f"{key}={_show(value)}" for key, value in trial.params.items()), file=stdout)
    print("command:", *build_command(sweep, trials[0].params, Path("<out>") / trials[0].name), file=stdout)


def _usage(message: str) -> NoReturn:
    """argparse's errors as ours: one ``error:`` line, exit code 2."""
    raise UsageError(message)


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
            raise UsageError("pass a sweep file (or --summarize DIR); --count and --jobs must be >= 1")
        sweep = load_sweep(args.sweep)
        limit = min(filter(None, (args.count, sweep.config.get("run_cap"))), default=None)
        if limit is None and sweep.config["method"] != "grid":
            raise UsageError(f"a {sweep.config['method']} search does not end by itself: pass --count N or set run_cap")
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
    except UsageError as error:
        print(f"error: {error}", file=stderr)
        return 2
    finally:
        unlock_folders()  # the sweep's folder, for a caller that goes on (tests)
    print(f"[sweep] {len(trials)} trial(s) in {out / 'sweep.json'}", file=stderr)
    return 1 if trials and all(trial.state != "finished" for trial in trials) else 0


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, a cluster's pre-emption) stops the sweep as Ctrl-C does: trials stopped, resumable."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Ctrl-C stops the sweep even when it was started with SIGINT ignored (a shell's background job passes
    # that on, and Python then installs no KeyboardInterrupt handler): the runner's trials must be stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also ends the import-time handler (experiments/__init__)
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
