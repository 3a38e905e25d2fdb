"""A W&B sweep file read and checked offline, and its trials: the engine's next parameters, each trial's command.

The file is wandb's format (``method``, ``metric``, ``parameters``, ``command``, ``program``, ``run_cap``); W&B's
own search engine (the ``sweeps`` package) picks each trial's parameters; a trial runs as ``wandb agent`` runs it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments.harness.cli import DuplicateKey, UniqueKeys
from experiments.harness.folder import PR_SET_PDEATHSIG, UsageError

with warnings.catch_warnings():  # the engine's pydantic deprecation warnings
    warnings.simplefilter("ignore")
    import sweeps

__all__ = ["REPO_ROOT", "DONE", "Sweep", "Trial"]
__all__ += ["load_sweep", "next_trial", "build_command", "start_trial"]

REPO_ROOT = Path(__file__).resolve().parents[2]  # finds a program named from the root; sweep.json's paths are relative
MACROS = ("${env}", "${interpreter}", "${program}", "${args}")  # wandb's default command; the only macros supported
DONE = ("finished", "failed")  # trials that ran to their end: --resume keeps them


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


def _check_flat(path: Path, text: str, config: dict[str, Any]) -> None:
    """Refuses what one ``--name=value`` flag cannot carry: nested parameters (the engine drops them from every
    trial) and a mapping as a value (the program would get its Python repr)."""

    def line(*keys: str) -> str:  # ", line N" of the key at the path ``keys`` in the file
        node, found = yaml.compose(text, Loader=yaml.SafeLoader), ""
        for key in keys:
            pairs = [(k, v) for k, v in node.value if k.value == key] if isinstance(node, yaml.MappingNode) else []
            if not pairs:
                return ""
            found, node = f", line {pairs[0][0].start_mark.line + 1}", pairs[0][1]
        return found

    parameters = config.get("parameters")
    for name, spec in parameters.items() if isinstance(parameters, dict) else ():
        if not isinstance(spec, dict):
            continue  # the engine's schema says what a parameter must be
        if "parameters" in spec:
            raise UsageError(
                f"{path}{line('parameters', str(name), 'parameters')}: the parameter {name!r} holds nested "
                f"parameters, which the search would drop from every trial (each trial passes flat --name=value "
                f"flags); give each flag its own entry under parameters."
            )
        where = "value" if "value" in spec else "values"
        values = [spec["value"]] if where == "value" else spec["values"] if isinstance(spec.get("values"), list) else []
        if (nested := next((value for value in values if isinstance(value, dict)), None)) is not None:
            raise UsageError(
                f"{path}{line('parameters', str(name), where)}: the parameter {name!r} has the mapping "
                f"{nested!r} as a value, which a trial's --{name}=VALUE flag cannot carry; give it a number, a string "
                f"or a bool (one parameter per flag)."
            )


def load_sweep(path: Path) -> Sweep:
    """Reads and checks a sweep file in wandb's format (``method``, ``metric``, ``parameters``, ``command``,
    ``program``, ``run_cap``); a UsageError for anything the file, the engine or the runner cannot use."""
    try:
        text = path.read_text()
        config = yaml.load(text, Loader=UniqueKeys)
    except DuplicateKey as error:
        raise UsageError(
            f"{path}, line {error.problem_mark.line + 1}: the key {error.key!r} is given twice in one mapping, and YAML "
            f"would keep only the last, silently; keep one."
        ) from None
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f"sweep file {path} not found or not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict) or not isinstance(config.get("metric"), dict) or not config["metric"].get("name"):
        raise UsageError(f"{path} needs a metric to rank its trials, e.g. metric: {{name: val/mse, goal: minimize}}")
    if type(config.get("run_cap", 1)) is not int or config.get("run_cap", 1) < 1:
        raise UsageError(f"{path}: run_cap must be a positive integer (got {config['run_cap']!r})")
    _check_flat(path, text, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine_input = {key: value for key, value in config.items() if key != "run_cap"}  # not in the engine's schema
        if problems := sweeps.schema_violations_from_proposed_config(engine_input):
            raise UsageError(f"{path} is not a valid sweep config: {'; '.join(problems)}")
        engine = dict(sweeps.SweepConfig(engine_input))
        try:  # what the schema lets through, e.g. a grid over a continuous range
            sweeps.next_run(engine, [])
        except (ValueError, TypeError, KeyError) as error:
            raise UsageError(f"{path}: the {config['method']} search cannot use these parameters: {error}") from None
    command = [str(part) for part in config.get("command") or MACROS]
    for macro in re.findall(r"\$\{[^}]*\}", " ".join(command)):
        if macro not in MACROS or macro not in command:
            raise UsageError(f"{path}: command macro {macro} is not supported offline, only {' '.join(MACROS)}")
    found = [base / config["program"] for base in (Path.cwd(), REPO_ROOT, path.parent) if config.get("program")]
    program = next((file.resolve() for file in found if file.is_file()), None)
    if program is None and "${program}" in command:
        raise UsageError(f"{path}: program {config.get('program')!r} not found from {Path.cwd()} or {REPO_ROOT}")
    ours = program is not None and "fit.fit(" in program.read_text(errors="replace")
    name = re.sub(r"[^\w.-]+", "-", str(config.get("name") or path.stem))
    goal = engine["metric"].get("goal", "minimize")
    return Sweep(path, name, config, engine, config["metric"]["name"], goal, command, program, ours)


def next_trial(sweep: Sweep, trials: list[Trial], limit: int | None) -> Trial | None:
    """The first pending trial, else a new one from the engine (appended); None at the limit or the grid's end.

    The engine hears of every trial: ended ones with their score (bayes learns), the others as running (no repeats).
    """
    if pending := [trial for trial in trials if trial.state == "pending"]:
        return pending[0]
    if limit is not None and len(trials) >= limit:
        return None
    runs = [
        sweeps.SweepRun(
            name=trial.name,
            state=trial.state if trial.state in (*DONE, "killed") else "running",
            config={key: {"value": value} for key, value in trial.params.items()},
            summaryMetrics={} if trial.metric is None else {sweep.metric: trial.metric},
        )
        for trial in trials
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's, fitting bayes search
        if (run := sweeps.next_run(sweep.engine, runs)) is None:
            return None
    values = {key: spec["value"] for key, spec in run.config.items()}
    params = {key: value.item() if hasattr(value, "item") else value for key, value in values.items()}  # numpy's
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
    env |= {
        "WANDB_MODE": "offline",
        "WANDB_RUN_GROUP": sweep.name,
        "WANDB_NAME": f"{sweep.name}-{trial_dir.name}",
        "WANDB_DIR": str(trial_dir),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    }
    return env | ({"OMP_NUM_THREADS": str(threads)} if threads else {})


def start_trial(sweep: Sweep, trial: Trial, out: Path, threads: int | None) -> subprocess.Popen[bytes]:
    """Starts a trial's process, its output in ``output.log``; a cut trial's again with --resume or --overwrite."""
    folder = out / trial.name
    cut = ["--resume"] if (folder / "checkpoint.pt").exists() else ["--overwrite"] * (folder / "config.yaml").exists()
    share = ["--threads", str(threads)] if threads and sweep.ours and "threads" not in trial.params else []
    trial.command = build_command(sweep, trial.params, folder) + cut + share
    trial.state, trial.exit_code, trial.error = "running", None, None
    folder.mkdir(parents=True, exist_ok=True)
    # SIGTERM to the trial when the runner dies, however (kill -9 too): no trial goes on writing into a resumed sweep
    linux = sys.platform == "linux"
    pdeathsig = functools.partial(ctypes.CDLL(None).prctl, PR_SET_PDEATHSIG, signal.SIGTERM) if linux else None
    with open(folder / "output.log", "ab") as log:
        return subprocess.Popen(
            trial.command,
            env=trial_env(sweep, folder, threads),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=pdeathsig,
        )
