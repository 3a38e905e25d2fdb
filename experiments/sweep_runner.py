"""Running a sweep's trials, each a process writing to its own folder, and the sweep's folder: scores, sweep.json, --resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from experiments.cli import UsageError
from experiments.files import atomic_write
from experiments.lock import lock_folder
from experiments.rundir import METRICS_FILE
from experiments.sweep_file import DONE, REPO_ROOT, Sweep, Trial, build_command, next_trial, trial_env

__all__ = ["best_metric", "run_sweep", "open_out", "write_report"]

SAME_TRIALS = ("method", "parameters", "command", "program")  # what --resume needs unchanged (a grid may add values)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # our scripts' exit codes when stopped with a checkpoint


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
        return subprocess.Popen(
            trial.command,
            env=trial_env(sweep, folder, threads),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )


def _stop_with_parent() -> None:
    """In a trial's process before it runs: SIGTERM when the runner dies, however it dies (``kill -9`` too).

    Our scripts stop on SIGTERM after the iteration, with a checkpoint, so no trial goes on as an
    orphan writing into a sweep that a resumed runner is about to run again.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


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


def run_sweep(
    sweep: Sweep,
    out: Path,
    trials: list[Trial],
    limit: int | None,
    jobs: int,
    save: Callable[[], None],
    progress: TextIO,
) -> None:
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
                note(
                    f"{trial.name} ({trial.index}{f'/{limit}' if limit else ''}): "
                    + " ".join(f"{key}={value}" for key, value in trial.params.items())
                )
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


def open_out(out: Path | None, sweep: Sweep, resume: bool) -> tuple[Path, list[Trial], int | None]:
    """The sweep's folder, created; on ``--resume`` also its trials (cut ones pending again) and its seed."""
    out = (out or Path("runs") / "sweeps" / f"{sweep.name}-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if not resume:
        if (out / "sweep.json").exists() or any(out.glob("trial-*")):
            raise UsageError(f"{out} already holds a sweep; pass --resume to continue it, or a new --out folder")
        out.mkdir(parents=True, exist_ok=True)
        lock_folder(out, "the sweep folder")
        return out, [], None
    if out.is_dir():
        lock_folder(out, "the sweep folder")  # before reading sweep.json: a runner still going there rewrites it
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
    report = {
        "sweep": settings,
        "trials": [asdict(trial) | {"command": list(map(_portable, trial.command))} for trial in trials],
    }
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
