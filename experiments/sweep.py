"""Run a W&B sweep file locally, with no server: each trial is its own offline wandb run.

The sweep files under ``experiments/sweeps/`` are in wandb's sweep format and work online
unchanged (``wandb sweep experiments/sweeps/sine.yaml`` then ``wandb agent <id>``). Upstream
wandb has no offline sweeps, so this runner plays the agent and the server's part itself:

1. It asks W&B's own search engine (the ``sweeps`` package: grid, random or bayes) for the next
   parameter set, telling it about every finished trial.
2. It runs the trial as a subprocess, the way ``wandb agent`` does: the YAML ``command`` (by
   default ``${env} ${interpreter} ${program} ${args}``) with the parameters as ``--name=value``
   flags, then ``--out <out>/<trial> --wandb offline``; environment ``WANDB_MODE=offline``,
   ``WANDB_RUN_GROUP=<sweep name>`` (the trials of a sweep form one group) and
   ``WANDB_SWEEP_PARAM_PATH`` (a YAML file of the trial's parameters, which ``wandb.init`` merges
   into the run's config). A ``program`` ending in ``.py`` inside this repository, in folders that
   are Python packages, runs as that module from the repository root
   (``experiments/sine.py`` -> ``python -m experiments.sine``); any other runs as a script path.
3. It reads back what the trial logged from its offline run files (``experiments.wandb_runs``),
   not from its output, and scores it by the metric's best value over the run (its minimum, or
   its maximum for ``goal: maximize``, over the logged history and the summary), as W&B's search
   engine does: a trial whose validation loss fell and rose again keeps its best value.

Grid search ends when its grid is used up; random and bayes search need ``--count`` or the
YAML's ``run_cap``. A failed trial (non-zero exit) is recorded as failed and the sweep goes on.
After each trial its result goes to stderr, and before the next one the best trials so far; at
the end the table of all trials, best first, goes to stdout (once) and ``<out>/sweep.json`` holds
every trial. Before the first trial (and in ``--dry-run``) the parameter names are checked
against the flags that the program's ``--help`` lists, where the program is a Python script that
takes ``--name=value`` flags: a misspelled parameter stops the sweep with a close match.

Usage:
    python -m experiments.sweep experiments/sweeps/sine.yaml --out runs/sine-sweep
    python -m experiments.sweep experiments/sweeps/omniglot.yaml --dry-run
    python -m experiments.sweep my-bayes.yaml --count 20 --seed 0

Exit codes: 0 when the sweep ran (failed trials included), 1 when every trial failed, 2 for bad
input (missing or invalid sweep file, unknown method, no metric, no count for random or bayes,
a parameter the program has no flag for, an --out folder that already holds a sweep), 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from numbers import Real
from pathlib import Path
from typing import Any, TextIO

import yaml

from experiments.wandb_runs import OfflineRun, RunFileError, read_run

__all__ = [
    "Sweep",
    "SweepError",
    "Trial",
    "build_command",
    "format_table",
    "load_sweep",
    "main",
    "plan_trials",
    "rank_trials",
    "run_sweep",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = ("grid", "random", "bayes")
DEFAULT_COMMAND = ("${env}", "${interpreter}", "${program}", "${args}")
# Keys wandb's server accepts that the engine's schema (sweeps 0.2.0) rejects; the runner reads them itself.
RUNNER_ONLY_KEYS = ("run_cap",)
_MACRO = re.compile(r"^\$\{(\w+)\}$")
_ENVVAR = re.compile(r"\$\{envvar:([A-Za-z0-9_]*)\}")
_LOG_TAIL_LINES = 15
_READ_BACK_WAIT_S = 5.0


class SweepError(Exception):
    """Bad input to the runner: the message says what to fix."""


@dataclass
class Sweep:
    """A validated sweep file.

    Attributes:
        name: The sweep's name (its ``name``, else the file's stem); also the trials' wandb group.
        path: The YAML file.
        config: The YAML as written.
        engine_config: The config handed to the ``sweeps`` engine: validated against its schema
            with its defaults filled in, without the keys only the runner reads (``run_cap``).
        method: ``grid``, ``random`` or ``bayes``.
        metric: The metric's name, e.g. ``val/mse``.
        goal: ``minimize`` or ``maximize``.
        target: Stop once a trial reaches this metric value (``metric.target``), or None.
        run_cap: The YAML's ``run_cap``, or None.
        program: The YAML's ``program``, or None.
        command: The YAML's ``command``, or wandb's default.
    """

    name: str
    path: Path
    config: dict[str, Any]
    engine_config: dict[str, Any]
    method: str
    metric: str
    goal: str
    target: float | None
    run_cap: int | None
    program: str | None
    command: list[str]

    @property
    def searched(self) -> list[str]:
        """The parameters the search varies (those not fixed with ``value:``)."""
        return [name for name, spec in self.config["parameters"].items() if "value" not in spec]


@dataclass
class Trial:
    """One trial of a sweep and, once it ran, what came of it.

    Attributes:
        index: 1-based position in the sweep.
        name: Its folder name under the sweep's ``--out``, e.g. ``trial-003``.
        params: The parameter values it ran with.
        state: ``pending``, ``running``, ``finished``, ``failed`` or ``killed``.
        metric: The sweep metric's best value over the run (min or max by the goal), or None if it logged none.
        exit_code: The process's exit code (negative: killed by that signal).
        wall_time: Seconds the process ran.
        run_dir: The wandb run directory it wrote.
        run_id: The wandb run id.
        error: Why it failed, if it did.
        command: The command line it ran.
        summary: The run's summary (last value of each logged key).
        history: The logged rows, kept for the search engine; not written to ``sweep.json``.
    """

    index: int
    name: str
    params: dict[str, Any]
    state: str = "pending"
    metric: float | None = None
    exit_code: int | None = None
    wall_time: float | None = None
    run_dir: str | None = None
    run_id: str | None = None
    error: str | None = None
    command: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The trial as written to ``sweep.json`` (without its history)."""
        data = asdict(self)
        del data["history"]
        return data


@contextmanager
def _quiet_engine() -> Iterator[None]:
    """Silence the ``sweeps`` engine's pydantic deprecation and scikit-learn fitting warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _engine() -> Any:
    """Import the ``sweeps`` package quietly."""
    with _quiet_engine():
        try:
            import sweeps
        except ImportError as error:
            raise SweepError(
                "the offline sweep runner needs W&B's search engine: pip install 'sweeps==0.2.0' "
                "(or pip install -e '.[experiments]')"
            ) from error
    return sweeps


# ----------------------------------------------------------------------------------------------
# Reading and checking a sweep file


def _read_yaml(path: Path) -> dict[str, Any]:
    """Read a sweep file into a dict."""
    if not path.is_file():
        raise SweepError(f"sweep file {path} not found")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise SweepError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(config, dict):
        raise SweepError(f"{path} must hold a mapping with program, method, metric and parameters")
    return config


def _check_basics(config: dict[str, Any], path: Path) -> None:
    """Check what the runner needs beyond the engine's schema, with messages that say what to do."""
    method = config.get("method")
    if method not in METHODS:
        raise SweepError(f"{path}: method must be one of {', '.join(METHODS)} (got {method!r})")
    metric = config.get("metric")
    if not isinstance(metric, dict) or not isinstance(metric.get("name"), str) or not metric["name"]:
        raise SweepError(f"{path} needs a metric to rank its trials, e.g.\nmetric:\n  name: val/mse\n  goal: minimize")
    if not isinstance(config.get("parameters"), dict) or not config["parameters"]:
        raise SweepError(f"{path} needs a parameters mapping with at least one parameter")
    run_cap = config.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or isinstance(run_cap, bool) or run_cap < 1):
        raise SweepError(f"{path}: run_cap must be a positive integer (got {run_cap!r})")
    command = config.get("command")
    if command is not None and (not isinstance(command, list) or not command):
        example = '["${env}", "${interpreter}", "${program}", "${args}"]'
        raise SweepError(f"{path}: command must be a non-empty list, e.g. {example}")
    if "program" not in config and "${program}" in (command or DEFAULT_COMMAND):
        raise SweepError(f"{path} needs a program (the training script), e.g. program: experiments/sine.py")


def _engine_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Validate a sweep config against the engine's schema and fill in its defaults."""
    sweeps = _engine()
    engine_input = {key: value for key, value in config.items() if key not in RUNNER_ONLY_KEYS}
    with _quiet_engine():
        try:
            violations = sweeps.schema_violations_from_proposed_config(engine_input)
        except ValueError as error:
            violations = [str(error)]
        if violations:
            raise SweepError(f"{path} is not a valid sweep config:\n  " + "\n  ".join(violations))
        try:
            engine_config = dict(sweeps.SweepConfig(engine_input))
        except Exception as error:  # jsonschema.ValidationError or ValueError from filling defaults
            raise SweepError(f"{path} is not a valid sweep config: {error}") from error
        try:  # surfaces what the schema lets through, e.g. continuous parameters in a grid
            sweeps.next_run(engine_config, [])
        except (ValueError, TypeError, KeyError) as error:
            raise SweepError(f"{path}: the {config['method']} search cannot use these parameters: {error}") from error
    return engine_config


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file in wandb's format.

    Args:
        path: The YAML file.

    Returns:
        The checked sweep.

    Raises:
        SweepError: If the file is missing, is not YAML, or is not a sweep config this runner can
            run (schema violations, unknown method, no metric, a grid over continuous ranges...).
    """
    path = Path(path)
    config = _read_yaml(path)
    _check_basics(config, path)
    engine_config = _engine_config(config, path)
    metric = engine_config["metric"]
    target = metric.get("target")
    return Sweep(
        name=_safe_name(str(config.get("name") or path.stem)),
        path=path,
        config=config,
        engine_config=engine_config,
        method=config["method"],
        metric=metric["name"],
        goal=metric.get("goal", "minimize"),
        target=float(target) if target is not None else None,
        run_cap=config.get("run_cap"),
        program=config.get("program"),
        command=[str(part) for part in config.get("command") or DEFAULT_COMMAND],
    )


def _safe_name(name: str) -> str:
    """A sweep name usable as a folder name and wandb group."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "sweep"


def trial_limit(sweep: Sweep, count: int | None) -> int | None:
    """How many trials to run: the smaller of ``--count`` and ``run_cap``; None means the whole grid.

    Raises:
        SweepError: If a random or bayes sweep has neither (it would never end).
    """
    limits = [limit for limit in (count, sweep.run_cap) if limit is not None]
    if not limits and sweep.method != "grid":
        raise SweepError(
            f"a {sweep.method} search does not end by itself: pass --count N or set run_cap in {sweep.path}"
        )
    return min(limits) if limits else None


# ----------------------------------------------------------------------------------------------
# Asking the engine


def _plain(value: Any) -> Any:
    """Turn numpy scalars (and containers of them) from the engine into plain Python values."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return value.item()
    return value


def seed_engine(seed: int) -> None:
    """Seed the random sources the engine draws from (``random`` for random search, numpy for bayes)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)


def _engine_state(trial: Trial) -> str:
    """The engine's run state for a trial."""
    return {"finished": "finished", "failed": "failed", "killed": "killed"}.get(trial.state, "running")


def _numeric_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary entries the engine can use (finite numbers)."""
    return {key: value for key, value in summary.items() if _is_number(value)}


def next_params(sweep: Sweep, trials: Sequence[Trial]) -> dict[str, Any] | None:
    """Ask the engine for the next parameter set, given every trial so far.

    Args:
        sweep: The sweep.
        trials: The trials so far, finished or not; their states, metrics and histories guide
            bayes search, and their parameters tell grid search what is left.

    Returns:
        The next parameters, or None when a grid is used up.
    """
    sweeps = _engine()
    with _quiet_engine():
        runs = [
            sweeps.SweepRun(
                name=trial.name,
                state=_engine_state(trial),
                config={key: {"value": value} for key, value in trial.params.items()},
                summaryMetrics=_numeric_summary(trial.summary),
                sampledHistory=trial.history,
            )
            for trial in trials
        ]
        suggestion = sweeps.next_run(sweep.engine_config, runs)
    if suggestion is None:
        return None
    return {key: _plain(spec["value"]) for key, spec in suggestion.config.items()}


def plan_trials(sweep: Sweep, limit: int | None) -> list[Trial]:
    """The trials the engine would start with, without running anything (``--dry-run``).

    Grid and random plans are exact for a seeded engine. A bayes plan treats the earlier trials
    as still running, so only its first trial is what a real sweep would run: later ones depend
    on the results.

    Args:
        sweep: The sweep.
        limit: At most this many trials (None: the whole grid).

    Returns:
        The planned trials, all pending.
    """
    trials: list[Trial] = []
    while limit is None or len(trials) < limit:
        params = next_params(sweep, trials)
        if params is None:
            break
        trials.append(Trial(index=len(trials) + 1, name=_trial_name(len(trials) + 1), params=params))
    return trials


def _trial_name(index: int) -> str:
    """The folder name of the trial at a 1-based index."""
    return f"trial-{index:03d}"


# ----------------------------------------------------------------------------------------------
# Building a trial's command, as wandb agent does


def resolve_program(program: str, sweep_path: Path) -> Path | None:
    """Find a sweep's program: as given, else relative to the repository root or the sweep file.

    Returns:
        The program's path, or None if it does not exist.
    """
    candidate = Path(program)
    if candidate.is_absolute():
        return candidate if candidate.exists() else None
    for base in (Path.cwd(), REPO_ROOT, sweep_path.parent):
        if (base / candidate).exists():
            return (base / candidate).resolve()
    return None


def module_name(program: Path) -> str | None:
    """The module to run a program as: ``experiments/sine.py`` -> ``experiments.sine``.

    Only a ``.py`` file inside this repository whose folders are packages (hold ``__init__.py``)
    runs as a module; None means run it as a script path.
    """
    if program.suffix != ".py":
        return None
    try:
        parts = program.resolve().relative_to(REPO_ROOT).with_suffix("").parts
    except ValueError:
        return None
    folders = [REPO_ROOT.joinpath(*parts[: depth + 1]) for depth in range(len(parts) - 1)]
    if not all(part.isidentifier() for part in parts) or not all(
        (folder / "__init__.py").is_file() for folder in folders
    ):
        return None
    return ".".join(parts)


def _flag_forms(params: dict[str, Any]) -> dict[str, list[str]]:
    """The parameter macros ``wandb agent`` fills a command with (``${args}`` and its variants)."""
    forms: dict[str, list[str]] = {
        "args": [],
        "args_no_equals": [],
        "args_no_hyphens": [],
        "args_no_boolean_flags": [],
        "args_append_hydra": [],
        "args_override_hydra": [],
        "args_json": [json.dumps(params)],
    }
    for name, value in params.items():
        flag = f"{name}={value}"
        forms["args"].append(f"--{flag}")
        forms["args_no_equals"] += [f"--{name}", str(value)]
        forms["args_no_hyphens"].append(flag)
        forms["args_append_hydra"].append(f"+{flag}")
        forms["args_override_hydra"].append(f"++{flag}")
        if not isinstance(value, bool):
            forms["args_no_boolean_flags"].append(f"--{flag}")
        elif value:
            forms["args_no_boolean_flags"].append(f"--{name}")
    return forms


def _program_argv(sweep: Sweep, command: Sequence[str]) -> tuple[list[str], str | None]:
    """What ``${program}`` expands to, and the module it runs (None: a script path)."""
    if sweep.program is None:
        return [], None
    program = resolve_program(sweep.program, sweep.path)
    if program is None:
        return [sweep.program], None
    module = module_name(program)
    pairs = zip(command, command[1:], strict=False)
    if module is not None and ("${interpreter}", "${program}") in pairs:
        return ["-m", module], module
    return [str(program)], None


def build_command(sweep: Sweep, params: dict[str, Any], trial_dir: Path) -> tuple[list[str], str | None]:
    """A trial's command line, as ``wandb agent`` would build it, plus ``--out`` and ``--wandb offline``.

    Macros: ``${env}`` (nothing: the environment is passed to the process directly),
    ``${interpreter}`` (this Python), ``${program}``, ``${args}``, ``${args_no_boolean_flags}``,
    ``${args_no_equals}``, ``${args_no_hyphens}``, ``${args_json}``, ``${args_json_file}``,
    ``${args_append_hydra}``, ``${args_override_hydra}`` and ``${envvar:NAME}`` inside any part.

    Args:
        sweep: The sweep.
        params: The trial's parameters.
        trial_dir: The trial's output folder.

    Returns:
        The command, and the module it runs as (None when the program runs as a script path).
    """
    program_argv, module = _program_argv(sweep, sweep.command)
    macros = {"env": [], "interpreter": [sys.executable], "program": program_argv, **_flag_forms(params)}
    macros["args_json_file"] = [str(trial_dir / "sweep-params.json")]
    argv: list[str] = []
    for part in sweep.command:
        part = _ENVVAR.sub(lambda match: os.environ.get(match.group(1), match.group(1)), part)
        macro = _MACRO.match(part)
        if macro and macro.group(1) in macros:
            argv += macros[macro.group(1)]
        else:
            argv.append(part)
    return argv + ["--out", str(trial_dir), "--wandb", "offline"], module


def trial_env(sweep: Sweep, trial: Trial, trial_dir: Path, module: str | None) -> dict[str, str]:
    """A trial's environment: offline mode, the sweep's group, the parameter file ``wandb.init`` reads."""
    env = dict(os.environ)
    env.update(
        WANDB_MODE="offline",
        WANDB_RUN_GROUP=sweep.name,
        WANDB_NAME=f"{sweep.name}-{trial.name}",
        WANDB_DIR=str(trial_dir),
        WANDB_SWEEP_PARAM_PATH=str(trial_dir / "sweep-params.yaml"),
    )
    env.pop("WANDB_SWEEP_ID", None)
    env.pop("WANDB_RUN_ID", None)
    if module is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _write_param_files(params: dict[str, Any], trial_dir: Path) -> None:
    """Write the trial's parameters as ``wandb agent`` does: YAML for ``wandb.init``, JSON for ``${args_json_file}``."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump({name: {"value": value} for name, value in params.items()}, sort_keys=False)
    (trial_dir / "sweep-params.yaml").write_text(f"wandb_version: 1\n\n{body}")
    (trial_dir / "sweep-params.json").write_text(json.dumps(params))


# ----------------------------------------------------------------------------------------------
# Checking the parameter names against the program's flags


_FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")
_FLAG_MACROS = ("${args}", "${args_no_equals}", "${args_no_boolean_flags}")
# The experiment scripts' parser (experiments.common.parse_args) takes --inner_lr for --inner-lr.
_KEBAB_PARSER = "common.parse_args("
_HELP_TIMEOUT_S = 120


def program_flags(sweep: Sweep) -> tuple[list[str], bool] | None:
    """The flags the sweep's program lists in its ``--help``, and whether it takes ``_`` for ``-`` in them.

    Only a Python program that parses its flags with argparse (or the experiment scripts' parser)
    is asked, where ``--help`` prints and exits. None, and nothing is checked, when the command
    passes the parameters other than as ``--name`` flags, the program is not found or is no such
    program, or its ``--help`` fails or lists no flag.
    """
    if sweep.program is None or not any(part in _FLAG_MACROS for part in sweep.command):
        return None
    program = resolve_program(sweep.program, sweep.path)
    if program is None or program.suffix != ".py" or not program.is_file():
        return None
    source = program.read_text(errors="replace")
    if "argparse" not in source and _KEBAB_PARSER not in source:
        return None
    command, _ = build_command(sweep, {}, Path("<out>"))
    env = {**os.environ, "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:  # command[:-4]: without the --out <out> --wandb offline that build_command appends
        help_ = subprocess.run(
            [*command[:-4], "--help"], cwd=Path.cwd(), env=env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=_HELP_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    flags = sorted(set(_FLAG.findall(help_.stdout)))
    return (flags, _KEBAB_PARSER in source) if help_.returncode == 0 and flags else None


def check_parameters(sweep: Sweep) -> None:
    """Checks that the program has a flag for every parameter (``wandb agent`` passes ``--name=value``).

    Raises:
        SweepError: For a parameter the program has no flag for, with close matches; every trial
            would fail on it.
    """
    found = program_flags(sweep)
    if found is None:
        return
    flags, kebab = found
    for name in sweep.config["parameters"]:
        if f"--{name}" in flags or (kebab and f"--{name.replace('_', '-')}" in flags):
            continue
        matches = difflib.get_close_matches(f"--{name}", flags, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(matches)}?)" if matches else ""
        raise SweepError(
            f"{sweep.path}: the parameter {name!r} is not a flag of {sweep.program}{hint}; every trial would fail "
            f"on it. Rename it under parameters (the program's --help lists its flags)."
        )


# ----------------------------------------------------------------------------------------------
# Running one trial


def _execute(command: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> int:
    """Run a trial's process with its output in ``log_path``; on Ctrl-C stop it and re-raise."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise


def _read_back(trial_dir: Path, exit_code: int) -> OfflineRun:
    """Read the trial's wandb run; after a clean exit, wait briefly for wandb to finish the file."""
    deadline = time.monotonic() + (_READ_BACK_WAIT_S if exit_code == 0 else 0.0)
    while True:
        run = read_run(trial_dir)
        if run.complete or time.monotonic() >= deadline:
            return run
        time.sleep(0.1)


def metric_value(summary: dict[str, Any], metric: str) -> float | None:
    """The sweep metric in a run's summary, if it is a finite number."""
    value = summary.get(metric)
    return float(value) if _is_number(value) else None


def best_metric(summary: dict[str, Any], history: Sequence[dict[str, Any]], metric: str, goal: str) -> float | None:
    """The best value of the sweep metric over the run, its minimum or maximum by the goal, as W&B's engine takes it.

    Every finite value logged (the history) and the summary's count; a metric that fell and rose
    again scores its best value, not its last. None if the run logged no finite value.
    """
    values = [row[metric] for row in history if _is_number(row.get(metric))]
    last = metric_value(summary, metric)
    values += [last] if last is not None else []
    if not values:
        return None
    return float(max(values) if goal == "maximize" else min(values))


def _is_number(value: Any) -> bool:
    """Whether a value is a finite real number (not a bool)."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _record_result(trial: Trial, sweep: Sweep, trial_dir: Path, exit_code: int) -> None:
    """Fill in a finished process's state, metric and logged values from its run files."""
    trial.exit_code = exit_code
    try:
        run = _read_back(trial_dir, exit_code)
    except (OSError, RunFileError) as error:
        run = None
        trial.error = f"no readable wandb run: {error}"
    if run is not None:
        trial.run_dir, trial.run_id = str(run.path), run.id
        trial.summary, trial.history = run.summary, run.history
        trial.metric = best_metric(run.summary, run.history, sweep.metric, sweep.goal)
    if exit_code < 0:
        trial.state, trial.error = "killed", f"killed by signal {-exit_code}"
    elif exit_code != 0:
        trial.state, trial.error = "failed", f"exit code {exit_code}"
    elif run is None:
        trial.state = "failed"
    elif run.exit_code not in (0, None):
        trial.state, trial.error = "failed", f"wandb recorded exit code {run.exit_code}"
    else:
        trial.state = "finished"


def run_trial(sweep: Sweep, trial: Trial, out: Path) -> None:
    """Run one trial to its end and record what it logged in ``trial``.

    Raises:
        KeyboardInterrupt: After stopping the trial's process (the trial is then ``killed``).
    """
    trial_dir = out / trial.name
    _write_param_files(trial.params, trial_dir)
    trial.command, module = build_command(sweep, trial.params, trial_dir)
    cwd = REPO_ROOT if module is not None else Path.cwd()
    trial.state = "running"
    start = time.monotonic()
    try:
        exit_code = _execute(trial.command, cwd, trial_env(sweep, trial, trial_dir, module), trial_dir / "output.log")
    except KeyboardInterrupt:
        trial.state, trial.error, trial.wall_time = "killed", "interrupted", time.monotonic() - start
        raise
    except OSError as error:
        trial.state, trial.error, trial.wall_time = "failed", f"could not start: {error}", time.monotonic() - start
        return
    trial.wall_time = time.monotonic() - start
    _record_result(trial, sweep, trial_dir, exit_code)


# ----------------------------------------------------------------------------------------------
# Ranking and reporting


def rank_trials(trials: Sequence[Trial], goal: str) -> list[Trial]:
    """Trials best first: finished ones with a metric by it (goal-aware), then the rest in order."""
    sign = -1.0 if goal == "maximize" else 1.0
    scored = [trial for trial in trials if trial.state == "finished" and trial.metric is not None]
    rest = [trial for trial in trials if trial not in scored]
    return sorted(scored, key=lambda trial: (sign * trial.metric, trial.index)) + rest


def _format_value(value: Any) -> str:
    """A parameter or metric value for the table."""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_table(trials: Sequence[Trial], sweep: Sweep, limit: int | None = None) -> str:
    """A text table of trials, best first: rank, trial, searched parameters, metric, state, time.

    Args:
        trials: The trials.
        sweep: Their sweep (for the metric, its goal and the searched parameters).
        limit: Show only the best ``limit`` trials.

    Returns:
        The table, one line per trial after a header line.
    """
    ranked = rank_trials(trials, sweep.goal)[:limit]
    shown = sweep.searched or list(sweep.config["parameters"])
    header = ["#", "trial", "parameters", f"{sweep.metric} ({sweep.goal[:3]})", "state", "time"]
    rows = [header]
    for rank, trial in enumerate(ranked, 1):
        params = " ".join(f"{name}={_format_value(trial.params.get(name))}" for name in shown)
        metric = "-" if trial.metric is None else _format_value(trial.metric)
        wall = "-" if trial.wall_time is None else f"{trial.wall_time:.1f}s"
        rows.append([str(rank), trial.name, params, metric, trial.state, wall])
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def write_report(path: Path, sweep: Sweep, trials: Sequence[Trial], seed: int, out: Path) -> None:
    """Write ``sweep.json``: the sweep's settings, every trial, and the best one."""
    ranked = rank_trials(trials, sweep.goal)
    best = ranked[0].name if ranked and ranked[0].state == "finished" and ranked[0].metric is not None else None
    report = {
        "sweep": {
            "name": sweep.name,
            "file": str(sweep.path),
            "method": sweep.method,
            "metric": sweep.metric,
            "goal": sweep.goal,
            "seed": seed,
            "out": str(out),
            "config": sweep.config,
        },
        "best": best,
        "trials": [trial.to_json() for trial in trials],
    }
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(report, indent=2, default=str))
    temporary.replace(path)


# ----------------------------------------------------------------------------------------------
# The sweep loop


def _reached_target(sweep: Sweep, trial: Trial) -> bool:
    """Whether a finished trial reached the metric's ``target``."""
    if sweep.target is None or trial.state != "finished" or trial.metric is None:
        return False
    return trial.metric >= sweep.target if sweep.goal == "maximize" else trial.metric <= sweep.target


def _describe(trial: Trial, sweep: Sweep) -> str:
    """A one-line progress note on a trial that ended."""
    wall = f"{trial.wall_time:.1f}s" if trial.wall_time is not None else "-"
    metric = (
        f"{sweep.metric}={_format_value(trial.metric)}" if trial.metric is not None else f"no {sweep.metric} logged"
    )
    reason = f" ({trial.error})" if trial.error else ""
    return f"{trial.name} {trial.state}{reason} in {wall}: {metric}"


def _log_tail(trial_dir: Path) -> str:
    """The last lines of a trial's output, to show why it failed."""
    try:
        lines = (trial_dir / "output.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-_LOG_TAIL_LINES:])


def run_sweep(
    sweep: Sweep,
    out: Path,
    limit: int | None,
    seed: int,
    progress: TextIO,
    on_trial: Callable[[list[Trial]], None] | None = None,
) -> list[Trial]:
    """Run a sweep's trials one after another until the grid, the count or the target is reached.

    Args:
        sweep: The sweep.
        out: The sweep's folder; each trial writes to ``out/<trial name>``.
        limit: At most this many trials (None: the whole grid).
        seed: Seeds the engine's random choices.
        progress: Where progress goes (stderr for the CLI).
        on_trial: Called with all trials after each one ends (also after an interrupt).

    Returns:
        The trials, in the order they ran.

    Raises:
        KeyboardInterrupt: After recording the interrupted trial as ``killed``.
    """
    seed_engine(seed)
    trials: list[Trial] = []
    try:
        while limit is None or len(trials) < limit:
            params = next_params(sweep, trials)
            if params is None:
                break
            if trials:  # the standings so far; the final table comes once, at the end
                print(f"[sweep] best so far:\n{format_table(trials, sweep, limit=5)}", file=progress, flush=True)
            trial = Trial(index=len(trials) + 1, name=_trial_name(len(trials) + 1), params=params)
            trials.append(trial)
            total = f"/{limit}" if limit is not None else ""
            shown = " ".join(f"{key}={_format_value(value)}" for key, value in params.items())
            print(f"[sweep] {trial.name} ({trial.index}{total}): {shown}", file=progress, flush=True)
            run_trial(sweep, trial, out)
            print(f"[sweep] {_describe(trial, sweep)}", file=progress, flush=True)
            if trial.state != "finished":
                log = out / trial.name / "output.log"
                print(
                    f"[sweep] last output of {trial.name} ({log}):\n{_log_tail(out / trial.name)}",
                    file=progress,
                    flush=True,
                )
            if on_trial is not None:
                on_trial(trials)
            if _reached_target(sweep, trial):
                print(f"[sweep] {trial.name} reached the target {sweep.metric}={sweep.target}; stopping", file=progress)
                break
    except KeyboardInterrupt:
        if on_trial is not None:
            on_trial(trials)
        raise
    return trials


# ----------------------------------------------------------------------------------------------
# Command line


def _positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep",
        description="Run a W&B sweep file locally: each trial is a separate offline wandb run, grouped by sweep.",
    )
    parser.add_argument("sweep", type=Path, help="sweep YAML in wandb's format, e.g. experiments/sweeps/sine.yaml")
    parser.add_argument(
        "--count", type=_positive_int, help="run at most N trials (needed for random and bayes unless run_cap is set)"
    )
    parser.add_argument(
        "--out", type=Path, help="folder for the trials and sweep.json (default: runs/sweeps/<name>-<time>)"
    )
    parser.add_argument(
        "--seed", type=int, help="seed for the search engine's random choices (default: a fresh one, printed)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the trials the sweep would start with and their command; run nothing",
    )
    return parser


def _prepare_out(out: Path | None, sweep: Sweep) -> Path:
    """The sweep's output folder, absolute and created.

    Raises:
        SweepError: If it already holds a sweep (its trials would mix with the new ones).
    """
    if out is None:
        out = Path("runs") / "sweeps" / f"{sweep.name}-{datetime.now():%Y%m%d-%H%M%S}"
    out = out.resolve()
    if (out / "sweep.json").exists() or any(out.glob("trial-*")):
        raise SweepError(f"{out} already holds a sweep; pass a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _dry_run(sweep: Sweep, limit: int | None, seed: int, stdout: TextIO, stderr: TextIO) -> int:
    """Print the planned trials and the first trial's command."""
    seed_engine(seed)
    trials = plan_trials(sweep, limit)
    what = f"{sweep.method} search, {len(trials)} trial(s), metric {sweep.metric} ({sweep.goal}), seed {seed}"
    print(f"{sweep.name}: {what}", file=stdout)
    if sweep.method == "bayes":
        print("bayes: only the first trial is fixed; the later ones depend on the results", file=stdout)
    for trial in trials:
        print(
            f"{trial.name}  " + " ".join(f"{key}={_format_value(value)}" for key, value in trial.params.items()),
            file=stdout,
        )
    if sweep.program is not None and resolve_program(sweep.program, sweep.path) is None:
        print(f"[sweep] warning: program {sweep.program} not found yet; a real run would stop here", file=stderr)
    if trials:
        command, _ = build_command(sweep, trials[0].params, Path("<out>") / trials[0].name)
        print("command: " + " ".join(command), file=stdout)
    return 0


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command line; see the module docstring. Returns the exit code."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    args = _parser().parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    try:
        sweep = load_sweep(args.sweep)
        limit = trial_limit(sweep, args.count)
        check_parameters(sweep)
        if args.dry_run:
            return _dry_run(sweep, limit, seed, stdout, stderr)
        if sweep.program is not None and resolve_program(sweep.program, sweep.path) is None:
            raise SweepError(f"program {sweep.program} (from {sweep.path}) not found from {Path.cwd()} or {REPO_ROOT}")
        out = _prepare_out(args.out, sweep)
    except SweepError as error:
        print(f"error: {error}", file=stderr)
        return 2
    print(
        f"[sweep] {sweep.name}: {sweep.method} search from {sweep.path}, seed {seed}, trials in {out}",
        file=stderr,
        flush=True,
    )

    so_far: list[Trial] = []

    def report(trials: list[Trial]) -> None:
        so_far[:] = trials
        write_report(out / "sweep.json", sweep, trials, seed, out)

    try:
        trials = run_sweep(sweep, out, limit, seed, stderr, on_trial=report)
    except KeyboardInterrupt:
        print(format_table(so_far, sweep), file=stdout)
        print(f"[sweep] interrupted; the trials so far are in {out / 'sweep.json'}", file=stderr)
        return 130
    print(format_table(trials, sweep), file=stdout)
    write_report(out / "sweep.json", sweep, trials, seed, out)
    print(f"[sweep] {len(trials)} trial(s) in {out / 'sweep.json'}", file=stderr)
    return 1 if trials and all(trial.state != "finished" for trial in trials) else 0


if __name__ == "__main__":
    sys.exit(main())
