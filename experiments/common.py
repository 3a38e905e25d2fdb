"""What every experiment script shares: flags and YAML configs, the output folder, checkpoints,
wandb, the meta-training loop, confidence intervals and results.json."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import functools
import hashlib
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import typing
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
import tyro
import tyro._errors  # private, but documented; tyro is pinned to one version for it (setup.cfg)
import yaml
from torch import Tensor

import maml
from experiments import recipes
from experiments.recipes import Schedule

BEST_FILE = "best.pt"  # the meta-parameters of the best validation so far (Trainer.select)
RUN_FILES = ("config.yaml", "checkpoint.pt", BEST_FILE, "results.json")


class UsageError(Exception):
    """Bad input from the user: the script prints the message and exits with code 2."""


# ---------------------------------------------------------------------------- configuration
# The flags, --help and the --config keys come from the config dataclasses through tyro: each field
# is a kebab-case flag (--inner-lr; --inner_lr too, as `wandb agent` passes it) and a YAML key, and
# its attribute docstring is its --help text.


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run, as opposed to what to train (the experiment's config dataclass).

    Under ``torchrun``, ``rank`` and ``world_size`` place this process among the ones that
    share each meta-batch, and ``device`` is its own (``cuda:LOCAL_RANK`` for ``--device cuda``).
    """

    experiment: str
    out: Path
    resume: bool
    overwrite: bool
    wandb: str
    device: torch.device
    config_file: Path | None
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        """Whether this process is rank 0, the one that logs and writes under ``--out``."""
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """Where the run's files go, whether it continues one, wandb and the device."""

    config: Path | None = None
    """YAML file of config keys (flags override it)"""
    out: Path = Path("runs")
    """output folder"""
    resume: bool = False
    """continue the run in --out from its checkpoint"""
    overwrite: bool = False
    """replace the run already in --out"""
    wandb: Annotated[Literal["offline", "online", "disabled"] | None,
                     tyro.conf.arg(help_behavior_hint="(default: $WANDB_MODE, else online if logged in, else offline)")] = None  # fmt: skip
    """wandb mode"""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda"""
    threads: int | None = None
    """CPU threads of this process (null: PyTorch's, one per core)"""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """The hyperparameters every experiment has (each is a flag and a YAML key).

    The defaults are the sine experiment's (Finn et al.'s regression protocol); an experiment's
    subclass overrides those that differ and adds its own fields after these.
    """

    iterations: int = 70_000
    """meta-iterations"""
    meta_batch: int = 25
    """tasks per meta-batch"""
    shots: int = 10
    """support points per training task (K)"""
    query: int = 10
    """query points per training task"""
    # 0.001 is what Finn et al.'s released code runs for sine (its --update_lr default; the paper's
    # text says 0.01): it reproduces their table, while 0.01 overshoots at 5 and 10 test steps (README).
    inner_lr: float = 0.001
    """inner SGD learning rate (initial value if learned)"""
    steps: int = 1
    """inner steps in training"""
    meta_lr: float = 0.001
    """Adam learning rate of the outer loop"""
    rate_meta_lr: float | None = None
    """Adam learning rate of learned inner rates (null: --meta-lr); a schedule scales it alike"""
    mode: Literal[maml.MODES] = "second_order"  # type: ignore[valid-type]
    """the meta-gradient: exact (second_order), without second derivatives (first_order), or exact in less memory (checkpointed)"""
    batching: Literal[maml.BATCHINGS] = "auto"  # type: ignore[valid-type]
    """how the tasks of a meta-batch run: auto (the faster of the two, timed on the first batch), vmap or loop"""
    learn_inner_lr: Literal["scalar", "per_parameter", "per_layer_per_step"] | None = None
    """learned inner rates: scalar, per_parameter (Meta-SGD) or per_layer_per_step (MAML++); null: fixed"""
    compile: bool | None = None
    """compile the meta-step with torch.compile (exact; a one-off compile, then faster steps); null: where a C++ compiler is found, for second or first order"""
    algorithm: Literal[recipes.ALGORITHMS] = "maml"  # type: ignore[valid-type]
    """the recipe (sets its paper's values for the keys below; a flag or YAML key overrides it)"""
    adapt: Literal[recipes.ADAPT] = "all"  # type: ignore[valid-type]
    """what the inner loop adapts: all, head (ANIL) or body (BOIL)"""
    inner_optimizer: Literal[maml.INNER_OPTIMIZERS] = "sgd"  # type: ignore[valid-type]
    """inner update rule"""
    msl_fraction: float = 0.0
    """share of training with MAML++'s annealed multi-step loss (0: only the last step's loss)"""
    first_order_fraction: float = 0.0
    """share of training in first order before --mode (derivative-order annealing)"""
    meta_lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant, or cosine (annealed to --min-meta-lr)"""
    min_meta_lr: float = 1e-5
    """the cosine schedule's final meta-lr"""
    seed: int = 0
    """seeds the initialisation and the task sampler"""
    log_every: int = 100
    """iterations between training logs"""
    val_every: int = 1000
    """iterations between validations"""
    val_tasks: int = 100
    """fixed validation tasks (K = shots, steps = steps)"""
    checkpoint_every: int = 1000
    """iterations between checkpoints"""
    eval_tasks: int = 600
    """fresh test tasks in the final evaluation"""
    eval_steps: tuple[int, ...] = (1, 5, 10)
    """inner steps of the final evaluation"""


def check_config(cfg: Any, positive: Sequence[str] = ()) -> None:
    """Raises ValueError naming the flag and the value of the first invalid key of :class:`ExperimentConfig`.

    ``positive``: the experiment's own integer keys (or lists of them) that must be >= 1. A
    None value (a field whose default is filled in later) passes; the choice fields are checked
    as they are parsed.
    """
    for key in ("msl_fraction", "first_order_fraction"):
        if not 0 <= getattr(cfg, key) <= 1:  # NaN fails too
            raise ValueError(f"{_flag(key)} {getattr(cfg, key):g} must be a share of training in [0, 1].")
    positive = ("iterations", "meta_batch", "shots", "query", "log_every", "val_every", "val_tasks", "checkpoint_every",
                "eval_tasks", *positive)  # fmt: skip
    for keys, low in ((positive, 1), (("steps", "eval_steps"), 0)):
        for key in keys:
            value = getattr(cfg, key)
            if isinstance(value, tuple) and any(v < low for v in value):
                raise ValueError(f"{_flag(key)} {','.join(map(str, value))}: each must be an integer >= {low}.")
            if isinstance(value, int) and value < low:
                raise ValueError(f"{_flag(key)} {value} must be an integer >= {low}.")
    for key in ("inner_lr", "meta_lr", "rate_meta_lr", "min_meta_lr"):
        value = getattr(cfg, key)
        if value is not None and not 0 < value <= torch.finfo(torch.float32).max:  # NaN fails; inf overflows float32
            default = next(f.default for f in dataclasses.fields(cfg) if f.name == key)
            fix = f", e.g. {default:g} (the default)" if isinstance(default, float) else "; leave it out for the default"
            big = " (in float32, the parameters' precision)" if math.isfinite(value) and value > 0 else ""
            raise ValueError(f"{_flag(key)} {value:g} must be a finite number > 0{big}{fix}.")
    if cfg.compile and cfg.mode == "checkpointed":
        raise ValueError("compile applies to mode second_order or first_order, not checkpointed; drop --compile or "
                         "pick another --mode.")  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    """A value as it is written on the command line: ``null``, ``true``, ``5,10,20``."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(_show, value))
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _suggest(word: str, choices: Sequence[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


# How tyro reads a value: a bool as true or false (True, False), None as null (or None), a tuple from
# values separated by commas or spaces (5,10,20); a bad value raises ValueError naming it.
_REGISTRY = tyro.constructors.ConstructorRegistry()


@_REGISTRY.primitive_rule
def _read_values(info: tyro.constructors.PrimitiveTypeInfo) -> tyro.constructors.PrimitiveConstructorSpec | None:
    spec, args = tyro.constructors.PrimitiveConstructorSpec, typing.get_args(info.type)

    def inner(tp: Any) -> Any:
        return tyro.constructors.ConstructorRegistry.get_primitive_spec(tyro.constructors.PrimitiveTypeInfo.make(tp, info.markers))

    if info.type in (bool, int, float):
        kind, tp = {bool: "true or false", int: "an integer", float: "a number"}[info.type], info.type

        def read(words: list[str]) -> Any:
            try:
                return {"true": True, "false": False}[words[0].lower()] if tp is bool else tp(words[0])
            except (KeyError, ValueError):
                raise ValueError(f"{words[0]!r} is not {kind}") from None

        return spec(nargs=1, metavar={bool: "{true,false}", int: "INT", float: "FLOAT"}[tp], instance_from_str=read,
                    is_instance=lambda x: isinstance(x, tp), str_from_instance=lambda x: [_show(x)])  # fmt: skip
    if info.type_origin is tuple and args[1:] == (...,):
        item = inner(args[0])

        def read_all(words: list[str]) -> tuple[Any, ...]:
            values = [v for word in words for v in word.split(",") if v]
            if not values:
                raise ValueError("needs at least one value")
            return tuple(item.instance_from_str([v]) for v in values)

        return spec(nargs="*", metavar=f"{item.metavar},...", instance_from_str=read_all,
                    is_instance=lambda x: isinstance(x, tuple), str_from_instance=lambda x: [_show(x)])  # fmt: skip
    if info.type_origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        some = inner(next(a for a in args if a is not type(None)))
        return spec(nargs=some.nargs, metavar=f"{some.metavar}|null",
                    instance_from_str=lambda words: None if words in (["null"], ["None"]) else some.instance_from_str(words),
                    is_instance=lambda x: x is None or some.is_instance(x),
                    str_from_instance=lambda x: ["null"] if x is None else some.str_from_instance(x),
                    choices=None if some.choices is None else (*some.choices, "null", "None"))  # fmt: skip
    return None


def _cli(tp: Any, args: Sequence[str], default: Any, flags: Sequence[str] = (), where: str = "", **kwargs: Any) -> Any:
    """``tyro.cli``, whose parse errors become one-line UsageErrors that name the flag, the value and the fix.

    ``tyro._errors.on_parse_error`` is private, though documented in its module's docstring: that
    is why setup.cfg pins tyro to one version. ``flags`` are the close matches an unknown flag may
    have; ``where`` prefixes the messages of a --config file, which name the key (``inner_lr``).
    """

    def one_line(event: tyro._errors.ParseErrorEvent) -> None:
        argument = getattr(event, "argument", None)
        name = argument and (argument.field.intern_name if where else argument.display_name())
        if isinstance(event, tyro._errors.UnrecognizedArgs):
            bad = event.tokens[0].split("=", 1)[0]
            if not bad.startswith("-"):
                raise UsageError(f"unexpected argument {bad!r}: a value follows its flag (--name value).")
            raise UsageError(f"unknown flag {bad}{_suggest(bad.replace('_', '-'), flags)}; see --help for the full list.")
        if isinstance(event, tyro._errors.InvalidChoice):
            choices = [c for c in event.choices if c != "None"]  # null stands for it
            raise UsageError(f"{where}{name} {event.value!r} is not one of {', '.join(choices)}.")
        if isinstance(event, tyro._errors.InstantiationFailure) and name:
            raise UsageError(f"{where}{name} {event.message}.")
        if isinstance(event, tyro._errors.BadValue) and name:
            raise UsageError(f"{where}{name} needs a value.")
        raise UsageError(f"{where}{type(event).__name__}: see --help.")  # none of ours; tyro may add kinds

    with tyro._errors.on_parse_error(one_line):
        return tyro.cli(tp, args=list(args), default=default, registry=_REGISTRY,
                        config=(tyro.conf.OmitArgPrefixes, tyro.conf.FlagCreatePairsOff), **kwargs)  # fmt: skip


def _load_yaml(path: Path, cls: type) -> dict[str, Any]:
    """The keys of a ``--config`` file, read as their flags are."""
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: must be a mapping of config keys to values, got {type(data).__name__}.")
    types_ = typing.get_type_hints(cls)
    args, keys = [], []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise UsageError(f"--config {path}: unknown key {key!r}{_suggest(name, list(types_))}. Known keys: {', '.join(types_)}.")
        listed = typing.get_origin(types_[name]) is tuple
        if isinstance(value, dict) or isinstance(value, list) != listed:
            should = f"a list (e.g. [{_show(value)}])" if listed else "a single value"
            raise UsageError(f"--config {path}: {name} must be {should}, got {value!r}.")
        args.append(f"--{name}={_show(value)}")
        keys.append(name)
    parsed = _cli(Annotated[cls, tyro.conf.FlagConversionOff], args, cls(), where=f"--config {path}: ")
    return {name: getattr(parsed, name) for name in keys}


def parse_args(
    experiment: str, cls: type, argv: Sequence[str] | None, description: str, validate: Callable[[Any], None],
    threads: int | None = None,
) -> tuple[Any, RunOptions]:
    """Parses the command line into the experiment's config dataclass and the run options.

    Precedence: the dataclass defaults, then the recipe of ``--algorithm``, then ``--config FILE``
    (YAML), then flags. ``threads`` is the experiment's default ``--threads`` (None: PyTorch's).

    Raises:
        UsageError: unknown flag or key (with close matches), wrong type, invalid value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [_flag(f.name) for c in (RunFlags, cls) for f in dataclasses.fields(c)] + ["--help"]
    args_cls = dataclasses.make_dataclass("Args", [("run", RunFlags), (experiment, Annotated[cls, tyro.conf.FlagConversionOff])])
    args = _cli(args_cls, argv, args_cls(RunFlags(out=Path("runs") / experiment, threads=threads), cls()), flags,
                prog=f"python -m experiments.{experiment}", description=description)  # fmt: skip
    run, parsed = args.run, getattr(args, experiment)
    given = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}  # the keys flags set
    flagged = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(cls) if f.name in given}
    from_yaml = _load_yaml(run.config, cls) if run.config is not None else {}
    algorithm = {**vars(cls()), **from_yaml, **flagged}["algorithm"]
    values = {**vars(cls()), **recipes.recipe(experiment, algorithm), **from_yaml, **flagged}
    if values["compile"] is None:  # auto: the compiled step where it applies and a C++ compiler is found
        values["compile"] = values["mode"] != "checkpointed" and _cxx() is not None
        if not values["compile"] and values["mode"] != "checkpointed":
            print("note: no C++ compiler found (g++, c++ or $CXX), so the meta-step runs eager, 2-4x slower on "
                  "small models; install one, or pass --compile false to silence this", file=sys.stderr)  # fmt: skip
    cfg = cls(**values)
    try:
        validate(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        device = torch.device(run.device)
    except RuntimeError:
        raise UsageError(f"--device {run.device!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {run.device}: CUDA is not available on this machine; use --device cpu.")
    set_threads(run.threads)
    device, rank, world_size = join_processes(device)
    return cfg, RunOptions(experiment, run.out, run.resume, run.overwrite, run.wandb or default_wandb_mode(), device,
                           run.config, rank, world_size)  # fmt: skip

def _cxx() -> str | None:
    """The C++ compiler torch.compile's CPU backend would call, if one is installed."""
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)), None)


def default_wandb_mode() -> str:
    """$WANDB_MODE if set; online if the user is logged in; offline otherwise (never hangs without network)."""
    if os.environ.get("WANDB_MODE") in ("offline", "online", "disabled", "dryrun", "run"):
        return {"dryrun": "offline", "run": "online"}.get(os.environ["WANDB_MODE"], os.environ["WANDB_MODE"])
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


# ---------------------------------------------------------------------------- several processes (torchrun)


def join_processes(device: torch.device) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group; returns this process's device, rank and world size.

    torchrun (or any launcher of ``init_method="env://"``) sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; without them this is the only process: ``(device, 0, 1)``.
    The backend is gloo on CPU and NCCL on GPUs, each process on the GPU ``cuda:LOCAL_RANK``.

    Raises:
        UsageError: a device that the backends cannot serve, a GPU index that several
            processes of this machine would share, or fewer GPUs than processes.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if not dist.is_available():
        raise UsageError("this PyTorch build has no torch.distributed; run the script without torchrun.")
    if device.type == "cuda":
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device.index is not None and local_size > 1:
            raise UsageError(f"--device {device}: the {local_size} processes on this machine would share one GPU; "
                             f"pass --device cuda, and each process takes the GPU cuda:LOCAL_RANK.")  # fmt: skip
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise UsageError(f"process LOCAL_RANK={local_rank} needs the GPU cuda:{local_rank}, but this machine has "
                                 f"{torch.cuda.device_count()}; start at most that many processes per machine "
                                 f"(--nproc-per-node).")  # fmt: skip
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL and broadcast_object_list use the current device
        dist.init_process_group("nccl")
    elif device.type == "cpu":
        dist.init_process_group("gloo")
    else:
        raise UsageError(f"--device {device}: several processes need --device cpu (gloo) or --device cuda (NCCL).")
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, opts: RunOptions) -> None:
    """Raises UsageError when the meta-batch cannot be split into equal shares, one per process.

    Equal shares make the mean of the processes' meta-gradients the meta-gradient of the whole
    meta-batch (see ``maml.shard``); checked at start-up rather than at the first step.
    """
    if meta_batch % opts.world_size:
        fits = [n for n in range(1, meta_batch + 1) if meta_batch % n == 0]
        raise UsageError(
            f"--meta-batch {meta_batch} cannot be split evenly across {opts.world_size} processes (the world size "
            f"torchrun started): each process adapts the same number of tasks. Pass a --meta-batch that is a "
            f"multiple of {opts.world_size}, or start a number of processes (--nnodes x --nproc-per-node) that "
            f"divides {meta_batch}: {', '.join(map(str, fits))}."
        )


def broadcast(value: Any, opts: RunOptions) -> Any:
    """Rank 0's ``value`` on every process (any picklable object); ``value`` itself in one process."""
    if opts.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------- output folder

METRICS_FILE = "metrics.jsonl"  # every logged row, one JSON object a line, as the checkpoint's history
PLOTS = ("learning_curves.png", "sine_fit.png", "task_grid.png")  # the PNG plots the scripts write
# Config keys that --resume may change: how long the run goes and how often it logs, validates and
# checkpoints. None of them changes the trajectory, except the length for a run whose schedule is a
# share of it (--algorithm mamlpp: refused on resume), so a lengthened run ends with the parameters of
# a run that was that long from the start.
RESUMABLE = ("iterations", "log_every", "val_every", "checkpoint_every")
# Config keys naming data on disk: on --resume, another spelling of the path (a trailing slash, a
# relative path) is the same data, and so is another folder holding the same files (the data moved).
DATA_KEYS = ("data",)
_TEMPORARY = re.compile(r"\..+\.tmp(\d+)")  # atomic_write's temporary files, .NAME.tmpPID
_WANDB_FILES = re.compile(r"(offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(-internal)?\.log")  # under --out/wandb


def set_threads(threads: int | None) -> None:
    """Sets this process's CPU threads (intra-op, and inter-op where PyTorch still allows it); None keeps PyTorch's.

    Raises:
        UsageError: ``threads < 1``.
    """
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads {threads} must be >= 1, or null for PyTorch's default "
                         f"({torch.get_num_threads()} on this machine).")  # fmt: skip
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # settable once, before any inter-op work; the intra-op threads are what a step uses
        pass


def check_device(device: torch.device) -> None:
    """Raises UsageError, naming what to pass instead, when ``device`` is not usable on this machine."""
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available,
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}  # fmt: skip
    names = {"cuda": "CUDA GPU", "mps": "Apple MPS GPU", "xpu": "Intel XPU"}
    if device.type in available and not available[device.type]():
        reason = f"this PyTorch finds no {names[device.type]}"
    else:
        try:
            torch.empty(1, device=device).add_(1)  # an allocation and a kernel: e.g. cuda:3 on a 1-GPU machine fails
            return
        except Exception as e:  # whatever the backend raises (RuntimeError, NotImplementedError, AssertionError)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    other = f" or --device {accelerator.type}" if accelerator is not None and accelerator.type != device.type else ""
    raise UsageError(f"--device {device} is not available on this machine ({reason}); use --device cpu{other}.")


def prepare_out(opts: RunOptions, cfg: Any) -> dict[str, Any] | None:
    """Checks the device and the output folder before anything is written; returns the checkpoint when resuming.

    With several processes, rank 0 alone reads ``--out`` (the others may run on machines
    that do not see it) and sends every rank the checkpoint or the error, so that all ranks
    resume from the same state or stop together.

    Raises:
        UsageError: the device is not available; ``--out`` is a file, sits under a file or
            cannot be written; it holds another run (without ``--resume``/``--overwrite``); or
            the checkpoint to resume is missing, unreadable, or from a config that differs in
            more than :data:`RESUMABLE`.
    """
    check_device(opts.device)
    outcome: dict[str, Any] | UsageError | None = None
    if opts.main:
        try:
            outcome = _check_out(opts, cfg)
        except UsageError as e:
            if opts.world_size == 1:
                raise
            outcome = e
    outcome = broadcast(outcome, opts)
    if isinstance(outcome, UsageError):
        raise outcome
    return outcome


def _check_out(opts: RunOptions, cfg: Any) -> dict[str, Any] | None:
    out = opts.out
    if opts.resume and opts.overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one.")
    _check_writable(out)
    if opts.resume:
        path = out / "checkpoint.pt"
        if not path.is_file():
            raise UsageError(f"--resume: no checkpoint at {path}; start the run without --resume.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            saved = state["config"]
        except Exception as e:  # a truncated or foreign file: say so, keep it
            raise UsageError(f"--resume: the checkpoint {path} is corrupt or not from this script ({type(e).__name__}: {e}).") from None
        mine = dataclasses.asdict(cfg)
        diff = []
        for key in [*mine, *(k for k in saved if k not in mine)]:
            old, new = saved.get(key), mine.get(key)
            if old == new or (key in RESUMABLE and not (key == "iterations" and _length_scheduled(saved))):
                continue
            if key in DATA_KEYS and isinstance(old, str) and isinstance(new, str):
                problem = _same_data(old, new, state.get("data", {}).get(key))
                if problem is None:
                    continue
                diff.append(f"{key}={new!r} (run has {old!r}; {problem})")
            else:
                diff.append(f"{key}={new!r} (run has {old!r})")
        if diff and _length_scheduled(saved) and any(d.startswith("iterations=") for d in diff):
            raise UsageError(
                f"--resume: --iterations {cfg.iterations} differs from the run's {saved['iterations']}, and its "
                f"schedule (meta_lr_schedule, first_order_fraction or msl_fraction, as --algorithm sets them) is a "
                f"share of --iterations; resume with --iterations {saved['iterations']}."
            )
        if diff:
            allowed = ", ".join(_flag(k) for k in RESUMABLE[:-1]) + f" and {_flag(RESUMABLE[-1])}"
            raise UsageError(
                f"--resume: the config differs from the run in {out}: {', '.join(diff)}. Resume with the same "
                f"flags (only {allowed} may change), or --config {out / 'config.yaml'}."
            )
        return state
    taken = [f for f in RUN_FILES if (out / f).exists()]
    if taken and not opts.overwrite:
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(taken)}); pass --resume to continue it, "
            f"--overwrite to replace it, or another --out."
        )
    return None


def _length_scheduled(config: dict[str, Any]) -> bool:
    """Whether a saved config's schedule is a share of its --iterations (keys it lacks take their defaults)."""
    keys = {f.name for f in dataclasses.fields(recipes.Schedule)}
    return recipes.Schedule(**{k: v for k, v in config.items() if k in keys}).depends_on_length


def _check_writable(out: Path) -> None:
    """Raises UsageError unless ``out`` is, or can be made, a folder this process can write in; writes nothing."""
    here = out
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a folder; pass a folder (it is created if missing).")
        here = next(p for p in (out, *out.parents) if p.exists())
        if not here.is_dir():
            raise UsageError(f"--out {out}: {here} is a file, so no folder can be made there; pass another --out.")
        # Creating a file asks what the permissions, a read-only mount and `chattr +i` say, even to root.
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write in {here} ({e.strerror or e}); make it writable or pass "
                         f"another --out.") from None  # fmt: skip


def fingerprint(path: str) -> str | None:
    """A digest of the names and sizes of the files at ``path`` (a file, or a folder's non-hidden files), None if missing.

    Names and sizes tell data apart without reading it (the cache folders a loader writes
    beside the data, hidden, are left out); the digest is the same wherever the files are.
    """
    root = Path(path)
    if root.is_file():
        entries = [(root.name, root.stat().st_size)]
    elif root.is_dir():
        entries = []
        for folder, dirs, files in os.walk(root, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(folder).relative_to(root)
            entries += [((rel / f).as_posix(), os.path.getsize(Path(folder) / f)) for f in files if not f.startswith(".")]
    else:
        return None
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def _data_identity(path: str) -> dict[str, str | None]:
    """What a checkpoint keeps of a data path: the resolved path and the files' fingerprint."""
    resolved = str(Path(path).expanduser().resolve())
    return {"path": resolved, "fingerprint": fingerprint(resolved)}


def _same_data(old: str, new: str, kept: dict[str, str | None] | None) -> str | None:
    """None when ``new`` names the data the run began with (``old``, ``kept`` by its checkpoint); else why not."""
    # A checkpoint from before data identities were kept: its path, resolved from here.
    before = kept["path"] if kept else str(Path(old).expanduser().resolve())
    now = _data_identity(new)
    if now["path"] == before:
        return None
    if kept is None or kept["fingerprint"] is None:
        return "its checkpoint keeps no record of the files to compare; pass the path the run began with"
    if now["fingerprint"] != kept["fingerprint"]:
        return "not the same files: their names or sizes differ" if now["fingerprint"] else f"{new} does not exist"
    print(f"resuming with --data {new}: the same files as {before}, where the run began", file=sys.stderr)
    return None


def take_out(opts: RunOptions, cfg: Any) -> None:
    """Makes ``--out`` this run's, once every check has passed (rank 0): clears, then writes config.yaml.

    With ``--overwrite``, first removes everything the run there wrote (:data:`RUN_FILES`, the
    metrics, the plots, its wandb runs), so the folder never shows the old run's results or
    checkpoint beside the new run's files, even if the new run is stopped at once; other files
    stay. On every start it removes the temporary files of writers that were killed mid-write.

    Raises:
        UsageError: the folder cannot be written (full, read-only); nothing is left half-written.
    """
    out = opts.out
    made = not out.exists()
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
        if opts.overwrite:
            for name in (*RUN_FILES, METRICS_FILE, *PLOTS):
                (out / name).unlink(missing_ok=True)
            runs = out / "wandb"
            for path in runs.iterdir() if runs.is_dir() else ():
                if _WANDB_FILES.fullmatch(path.name):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            with contextlib.suppress(OSError):
                runs.rmdir()  # when nothing but the old run's files was there
        for path in out.glob(".*.tmp*"):
            match = _TEMPORARY.fullmatch(path.name)
            if match and not _alive(int(match.group(1))):
                path.unlink(missing_ok=True)
    try:
        save_config(out, cfg)
    except UsageError:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turns an OSError while writing ``path`` into a UsageError that names the path and what to do.

    A full disk names the filesystem (its mount point and the space left), so the user knows
    what to free; the script then exits with code 2 and one line, not a traceback.
    """
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            mount = path.resolve()
            while not os.path.ismount(mount):
                mount = mount.parent
            what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
            raise UsageError(f"{what} writing {path}; free space on the filesystem mounted at {mount} "
                             f"({_size(shutil.disk_usage(mount).free)} free) or pass another --out.") from None  # fmt: skip
        raise UsageError(f"cannot write {path} ({e.strerror or e}); make --out writable or pass another --out.") from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Writes through a temporary file and a rename, so a kill never leaves a half-written file.

    ``write(tmp)`` writes the content to the temporary path ``tmp``; it must use Python's file
    I/O (or anything that raises OSError) for a full disk to be reported as one.

    Raises:
        UsageError: the disk is full or the folder cannot be written (the message names the path
            and, for a full disk, its filesystem); the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with _writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # gone after the rename; after a failure, a partial file


def save_config(out: Path, cfg: Any) -> None:
    atomic_write(out / "config.yaml", lambda p: p.write_text(yaml.safe_dump(
        {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}, sort_keys=False)))  # fmt: skip


def load_config(cls: type, path: Path) -> Any:
    """The config dataclass saved in a run's config.yaml."""
    return cls(**_load_yaml(path, cls))


# ---------------------------------------------------------------------------- statistics, provenance


def mean_ci95(values: Tensor) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (normal approximation)."""
    values = values.double().flatten()
    n = values.numel()
    half = 1.96 * float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return float(values.mean()), half


# ---------------------------------------------------------------------------- divergence


class Diverged(Exception):
    """Training produced NaN/Inf; the message names the meta-iteration, the loop that diverged and the flag."""


class DivergenceWatch:
    """Tells an outer-loop divergence from an inner-loop one and stops the run before it is checkpointed.

    Outer (lower ``--meta-lr``): an optimizer step made a meta-parameter (a weight or a learnable
    rate) NaN/Inf from a finite meta-gradient; or the meta-parameters' own loss, before any inner
    step, is NaN/Inf; or the outer updates raised that own loss ``GROWTH``-fold since the first
    iteration this process ran, and the inner steps on it overflowed. Inner (lower ``--inner-lr``):
    a loss after inner steps, or the meta-gradient through them, is NaN/Inf while the
    meta-parameters and their own loss are finite and have not run away.

    It wraps ``learner.run``, which keeps each training iteration's losses (and catches the
    engine's NaN/Inf check, then runs the batch again to find the step and the task), and checks
    the meta-parameters after every optimizer step: a NaN/Inf loss or meta-gradient makes them
    NaN/Inf too, so this one check, one synchronisation per iteration, stops the run before the
    trainer checkpoints it; only then are the losses and gradients looked at.

    Args:
        learner, optimizer: the ones the trainer uses.
        iteration: meta-iterations already done (the resumed checkpoint's, else 0).
        meta_lr, inner_lr: the values to name in the messages.
        out: the run's folder (its checkpoint is named in the message).
    """

    GROWTH = 100.0

    def __init__(self, learner: maml.MetaLearner, optimizer: torch.optim.Optimizer, iteration: int, meta_lr: float,
                 inner_lr: float, out: Path) -> None:  # fmt: skip
        self.learner, self.iteration, self.meta_lr, self.inner_lr, self.out = learner, iteration, meta_lr, inner_lr, out
        self._names = {id(p): n for n, p in learner.model.named_parameters()}
        self._names.update({id(p): f"the inner rate {n}" for n, p in learner.rate_parameters.items()})
        self._first: float | None = None  # the mean own loss at this process's first training iteration
        # The latest training iteration's meta-loss, support losses (steps, T) and query losses (T,), detached.
        self._losses: tuple[Tensor, Tensor, Tensor] | None = None
        self.phase = "the validation"  # what a run under no_grad is, in the messages
        self._run = learner.run
        learner.run = self._watched_run  # type: ignore[method-assign]
        optimizer.register_step_post_hook(self._after_step)

    def _watched_run(self, batch: maml.TaskBatch, *args: Any, **kwargs: Any) -> maml.MetaOutput:
        training = torch.is_grad_enabled()  # validation and evaluation run under no_grad
        where = f"meta-iteration {self.iteration + 1}" if training else f"{self.phase} after meta-iteration {self.iteration}"
        try:
            out = self._run(batch, *args, **kwargs)
        except FloatingPointError:  # the engine's check: a support loss is NaN/Inf
            raise Diverged(self._explain(where, batch, *args, **kwargs)) from None
        if training:
            self._losses = (out.loss.detach(), out.support_losses.detach(), out.query_losses.detach())
            if self._first is None:  # one synchronisation, at the first iteration only
                self._first = float(self._own(out.support_losses, out.query_losses).mean())
        return out

    @staticmethod
    def _own(support: Tensor, query: Tensor) -> Tensor:
        """Each task's own loss: at the meta-parameters, before any inner step."""
        return support[0] if support.shape[0] else query

    def _explain(self, where: str, batch: maml.TaskBatch, *args: Any, **kwargs: Any) -> str:
        """Runs ``batch`` again, one more inner step at a time, to find the loss, the step and the task that diverged.

        The support loss before inner step ``k`` is the query loss, after ``k`` steps, of a batch
        whose query set is the support set; runs that stop before the first NaN/Inf one pass the
        engine's check, whatever ``check_finite`` is.
        """
        steps = self.learner.steps if kwargs.get("steps") is None else kwargs["steps"]
        on_support = maml.TaskBatch(batch.support_x, batch.support_y, batch.support_x, batch.support_y)
        losses: list[Tensor] = []
        with torch.no_grad():
            for k in range(steps):
                losses.append(self._run(on_support, steps=k).query_losses)
                if not bool(torch.isfinite(losses[-1]).all()):
                    break
            else:
                losses.append(self._run(batch, steps=steps).query_losses)
        return self._describe(where, losses, steps)

    def _describe(self, where: str, losses: Sequence[Tensor], steps: int) -> str:
        """Which loss is NaN/Inf first, of which task, and why: ``losses[k]`` is the support loss before inner
        step ``k`` for ``k < steps``, ``losses[steps]`` (if there) the query loss after the inner steps."""
        own = float(losses[0].mean())
        step = next((k for k, row in enumerate(losses) if not bool(torch.isfinite(row).all())), None)
        if step is None:  # finite losses: the backward pass overflowed
            return self._gradient(where, own)
        task = int((~torch.isfinite(losses[step])).nonzero()[0, 0])
        value, before = float(losses[step][task]), float(losses[0][task])
        what = "query loss" if step == steps else "support loss"
        if step == 0:
            return (f"the outer loop diverged by {where}: the meta-parameters are finite, but their own {what} "
                    f"(before any inner step) is {value} for task {task}; lower --meta-lr {self.meta_lr:g}")  # fmt: skip
        after = f"the {what} of task {task} is {value} after {step} inner step{'s' if step != 1 else ''}"
        if self._ran_away(own):
            return (f"the outer loop diverged by {where}: {self._ran_away(own)}, and from there {after}; "
                    f"lower --meta-lr {self.meta_lr:g}")  # fmt: skip
        return (f"the inner loop diverged at {where}: {after}, from a support loss of {before:.4g} at the "
                f"meta-parameters; lower --inner-lr {self.inner_lr:g}{self._rates()}")  # fmt: skip

    def _gradient(self, where: str, own: float) -> str:
        """The message for a NaN/Inf meta-gradient of finite losses."""
        if self._ran_away(own):
            return (f"the outer loop diverged by {where}: {self._ran_away(own)}, and the meta-gradient there is "
                    f"NaN/Inf; lower --meta-lr {self.meta_lr:g}")  # fmt: skip
        return (f"the inner loop diverged at {where}: the meta-gradient through its inner steps is NaN/Inf though "
                f"its losses are finite (the second-order terms overflowed); lower --inner-lr {self.inner_lr:g}"
                f"{self._rates()}")  # fmt: skip

    def _ran_away(self, own: float) -> str:
        """How the outer updates raised the meta-parameters' own loss, if they did ``GROWTH``-fold; else ''."""
        if self._first is None or not math.isfinite(own) or not own > self.GROWTH * self._first:
            return ""
        return f"its updates raised the meta-parameters' own loss (before any inner step) from {self._first:.4g} to {own:.4g}"

    def _rates(self) -> str:
        if not self.learner.rate_parameters:
            return ""
        top = max(float(r.detach().abs().max()) for r in self.learner.rate_parameters.values())
        return f" (the learned inner rates, which --meta-lr moves, reach {top:.3g})"

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():  # NaN/Inf if any parameter is (or if their sum overflows: they ran away)
            total = torch.stack([p.sum() for p in params]).sum()
        if bool(torch.isfinite(total)):  # the one synchronisation per iteration
            self.iteration += 1
            return
        where = f"meta-iteration {self.iteration + 1}"
        if self._losses is not None:
            loss, support, query = self._losses
            if not bool(torch.isfinite(loss)):  # a NaN/Inf meta-loss: which task's loss, after which step
                raise Diverged(self._describe(where, [*support, query], support.shape[0]))
            if any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params):
                raise Diverged(self._gradient(where, float(self._own(support, query).mean())))
        bad = [p for p in params if not bool(torch.isfinite(p).all())]
        what = f"made {self._names.get(id(bad[0]), 'a meta-parameter')} NaN/Inf" if bad else "overflowed the meta-parameters"
        raise Diverged(f"the outer loop diverged at {where}: its optimizer step with --meta-lr {self.meta_lr:g} "
                       f"{what} from a finite meta-gradient; lower --meta-lr")  # fmt: skip

    @contextlib.contextmanager
    def guard(self, run: Any, main: bool = True) -> Iterator[None]:
        """Turns a divergence inside the block into one line on stderr and exit code 1 (not a usage error).

        The trainer checkpoints only finite meta-parameters, so ``checkpoint.pt`` keeps the last
        one written before the divergence; the wandb run is marked failed.
        """
        try:
            yield
        except Diverged as e:
            if run is not None:
                import wandb

                run.finish(exit_code=1)
                wandb.teardown()
            if main:
                path = self.out / "checkpoint.pt"
                try:  # this run's (--overwrite removed an earlier run's before it started)
                    kept = f"{path} keeps meta-iteration {torch.load(path, weights_only=False)['iteration']}"
                except Exception:  # none, or unreadable: say no more than that
                    kept = "no checkpoint was written"
                print(f"error: {e}. The run stopped; {kept}.", file=sys.stderr)
            raise SystemExit(1) from None


def provenance() -> dict[str, Any]:
    """Package versions and the git commit of the code that ran."""
    versions = {"python": platform.python_version()}
    for pkg in ("maml-toolkit", "torch", "numpy", "wandb", "learn2learn", "higher"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"versions": versions, "git_commit": commit, "git_dirty": dirty, "host": platform.node(), "cpu": _cpu(),
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}


def _cpu() -> str:
    """The processor's model name (Linux), else the platform's word for it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def finish(opts: RunOptions, cfg: Any, run: Any, trainer: Trainer, test: dict[str, dict[str, Any]], metric: str,
           **extra: Any) -> None:  # fmt: skip
    """Puts the test metric in the wandb summary, writes results.json, and closes the wandb run."""
    for key, r in test.items():
        run.summary[f"test/{metric}_{key}"] = r[metric]
        run.summary[f"test/{metric}_{key}_ci95"] = r["ci95"]
    config = dataclasses.asdict(cfg)
    # No path of this machine in a result file: the data as a path relative to the working directory, and its fingerprint.
    data = {k: {"path": os.path.relpath(v), "fingerprint": trainer._data.get(k, {}).get("fingerprint")}
            for k in DATA_KEYS if isinstance(v := config.get(k), str)}  # fmt: skip
    config.update({k: d["path"] for k, d in data.items()})
    results = {
        "experiment": opts.experiment,
        "config": config,
        **({"data_files": data} if data else {}),
        **extra,
        "test": test,
        "final_val": trainer.final_val,
        "best_val": trainer.best,
        "iterations": trainer.iterations,
        "train_seconds": round(trainer.train_seconds, 1),
        "device": str(opts.device),
        "processes": opts.world_size,
        **provenance(),
    }
    atomic_write(opts.out / "results.json", lambda p: p.write_text(json.dumps(results, indent=2) + "\n"))
    finish_wandb(run)


# ---------------------------------------------------------------------------- wandb


def init_wandb(opts: RunOptions, cfg: Any, name: str, run_id: str | None) -> Any:
    """Starts (or resumes) the wandb run, its files under ``--out``; never blocks without a network.

    A long run does not die at its start for its logging backend: ``--wandb online`` with no
    server to reach (a TCP connection tried for at most 5 s), no API key, or a server that
    refuses the key logs offline instead, with a warning that gives the ``wandb sync`` command
    that uploads the run later.
    """
    import wandb

    os.environ.setdefault("WANDB_DIR", str(opts.out))
    start = functools.partial(
        wandb.init,
        project=os.environ.get("WANDB_PROJECT", "maml-toolkit"),
        name=os.environ.get("WANDB_NAME", name),
        group=os.environ.get("WANDB_RUN_GROUP"),
        dir=str(opts.out),
        id=run_id,
        resume="allow" if run_id else None,
        config=dataclasses.asdict(cfg),
    )
    if opts.wandb != "online":
        return start(mode=opts.wandb)
    url = wandb.setup().settings.base_url
    problem, login = _unreachable(url), False
    if problem is None:
        try:
            return start(mode="online")
        except wandb.errors.Error as e:  # wandb's own retries have run out (init_timeout), or no usable key
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            login = isinstance(e, (wandb.errors.UsageError, wandb.errors.AuthenticationError))
            problem = (f"no W&B API key ({detail})" if isinstance(e, wandb.errors.UsageError) else
                       f"the W&B server at {url} refused the API key ({detail})" if login else
                       f"cannot reach the W&B server at {url} ({detail})")  # fmt: skip
            wandb.teardown()
    run = start(mode="offline")
    print(f"warning: --wandb online: {problem}; logging offline instead. To upload the run later: "
          f"{'wandb login, then ' if login else ''}wandb sync {run.settings.sync_dir}", file=sys.stderr)  # fmt: skip
    return run


def _unreachable(url: str) -> str | None:
    """Why nothing answers at ``url`` (one TCP connection, at most 5 s); None if something does, or a proxy decides."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy connects, not this machine: leave it to wandb
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), timeout=5).close()
    except OSError as e:
        return f"cannot reach the W&B server at {url} ({e.strerror or e})"  # e.g. Connection refused, timed out
    return None


def finish_wandb(run: Any) -> None:
    import wandb

    run.finish()
    # finish() can return before the offline .wandb file is complete; teardown waits for it.
    wandb.teardown()


# ---------------------------------------------------------------------------- the training loop


@dataclasses.dataclass
class Trainer:
    """The meta-training loop shared by the experiments: resumable, bit for bit.

    Everything a step depends on (model, optimizer, learnable rates, the task sampler's
    generator, the global RNG, the iteration) is in the checkpoint, and the checkpoint is
    written atomically, so a run killed at any point and resumed with ``--resume`` ends with
    exactly the parameters of an uninterrupted run.

    Under ``torchrun`` every process samples the full meta-batch from the same generator,
    adapts its share (``maml.shard``), and the meta-gradients are averaged in one all-reduce
    before the same optimizer step everywhere: the trajectory does not depend on the number
    of processes (to float rounding), and a run may resume with another number. Rank 0 alone
    validates, logs and writes checkpoints.

    Attributes:
        learner: the meta-learner (its model is trained).
        optimizer: the outer optimizer over ``learner.parameters()``.
        sample: ``sample(generator) -> TaskBatch``, one meta-batch of training tasks.
        metrics: ``metrics(output, batch) -> dict`` of extra training metrics (e.g. accuracy),
            each a mean over the tasks of ``batch`` (with several processes, of this rank's
            share; the logged value is the mean over the ranks, the full meta-batch's).
        validate: ``validate() -> dict`` of validation metrics (its own fixed tasks); runs on rank 0 only.
        iterations: total meta-iterations.
        log_every, val_every, checkpoint_every: in iterations.
        seed: seeds the sampler's generator.
        device: where the meta-batches go.
        select: ``(metric, "max" | "min")``: model selection. Each validation that beats every
            earlier one on ``metric`` writes the learner's state to ``best.pt`` (with its iteration
            and metrics), so a run ends with its last and its best-validation parameters.
        final_val: after ``run``, the validation metrics at the last iteration (rank 0).
        best: the best validation so far: ``{"iteration": i, **metrics}`` (empty before the first).
    """

    learner: maml.MetaLearner
    optimizer: torch.optim.Optimizer
    sample: Callable[[torch.Generator], maml.TaskBatch]
    metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]
    validate: Callable[[], dict[str, float]]
    iterations: int
    log_every: int
    val_every: int
    checkpoint_every: int
    seed: int
    device: torch.device
    schedule: Schedule | None = None  # per-iteration meta-lr, derivative order and step weights (recipes)
    select: tuple[str, Literal["max", "min"]] | None = None
    best: dict[str, float] = dataclasses.field(default_factory=dict)
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # Meta-losses and step time since the last log row: checkpointed, so a resumed run logs the same rows.
    window: list[float] = dataclasses.field(default_factory=list)
    step_time: float = 0.0
    train_seconds: float = 0.0  # wall time of the training loop, summed over resumed runs
    final_val: dict[str, float] = dataclasses.field(default_factory=dict)  # validation at the last iteration
    _began: float = dataclasses.field(default=0.0, repr=False)
    _data: dict[str, dict[str, str | None]] = dataclasses.field(default_factory=dict, repr=False)

    def state(self, iteration: int, generator: torch.Generator, cfg: Any, wandb_id: str | None) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "config": dataclasses.asdict(cfg),
            "learner": self.learner.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "history": self.history,
            "window": (self.window, self.step_time),
            "train_seconds": self.train_seconds + time.perf_counter() - self._began,
            "wandb_id": wandb_id,
            "data": self._data,
            "best": self.best,
        }

    def run(self, opts: RunOptions, cfg: Any, resumed: dict[str, Any] | None, run: Any) -> None:
        """Trains from iteration 0 or from ``resumed`` up to ``iterations``, then sets ``final_val``.

        The last iteration is always logged and validated, however short the run. A checkpoint
        at or past ``iterations`` (a run shortened on ``--resume``) trains nothing: the run
        evaluates the checkpoint's parameters, and ``iterations`` becomes the checkpoint's.

        Rank 0 writes every logged row to ``metrics.jsonl`` as well as to wandb: on a start the
        file is rewritten with the checkpoint's history, so after a kill it holds each logged
        iteration once, up to the checkpoint, and no rows of iterations that are then redone.
        A resumed wandb run gets those rows again, from wandb's own next step on (0 offline,
        where the killed run's file may hold nothing; after the server's last row online). When
        stderr is not a terminal (a batch job, ``nohup``), tqdm stays silent and a plain
        progress line per log window goes to stderr instead.
        """
        from tqdm import tqdm

        generator = torch.Generator().manual_seed(self.seed)
        start = 0
        if resumed is not None:
            self.learner.load_state_dict(resumed["learner"])
            self.optimizer.load_state_dict(resumed["optimizer"])
            generator.set_state(resumed["generator"])
            torch.set_rng_state(resumed["torch_rng"])
            if resumed["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(resumed["cuda_rng"])
            self.history = resumed["history"]
            self.window, self.step_time = resumed["window"]
            self.train_seconds = resumed["train_seconds"]
            self.best = resumed.get("best", {})
            start = resumed["iteration"]
        wandb_id = getattr(run, "id", None)
        main, sharded = opts.main, opts.world_size > 1
        if start >= self.iterations:
            if main:
                print(f"the checkpoint is at iteration {start}, at or past --iterations {self.iterations}: no "
                      f"training; evaluating its parameters", file=sys.stderr)  # fmt: skip
            self.iterations = start
        metrics_path = opts.out / METRICS_FILE
        metrics_file, wandb_from = None, 0
        if main:
            # Where the data is and what files it holds, for the checkpoints: --resume then accepts the
            # same files under another path (computed once: a folder of images has thousands of files).
            self._data = {k: _data_identity(v) for k in DATA_KEYS if isinstance(v := getattr(cfg, k, None), str)}
            atomic_write(metrics_path, lambda p: p.write_text("".join(json.dumps(row) + "\n" for row in self.history)))
            with _writing(metrics_path):
                metrics_file = metrics_path.open("a")
            # wandb's next step: 0 offline; online, past the last row its server holds. It drops (with a
            # warning) a row of an earlier step, which it has from the run before: the same row.
            wandb_from = run.starting_step
            for row in self.history:
                if row["iteration"] >= wandb_from:
                    run.log(row, step=row["iteration"])

        def checkpoint(iteration: int) -> None:
            # Serialised in memory and written with Python's file I/O, where a full disk is an OSError
            # (ENOSPC) that atomic_write reports; torch.save to a path makes it a bare RuntimeError.
            data = io.BytesIO()
            torch.save(self.state(iteration, generator, cfg, wandb_id), data)
            atomic_write(opts.out / "checkpoint.pt", lambda p: p.write_bytes(data.getbuffer()))

        # Ctrl-C and SIGTERM (kill, a cluster's pre-emption) stop the run at the end of the current
        # iteration, so the checkpoint written then is consistent; a second Ctrl-C stops at once
        # (the last periodic checkpoint stays valid). torchrun passes the signal on to every process.
        stop: list[int] = []

        def request_stop(signum: int, frame: Any) -> None:
            if stop:
                raise KeyboardInterrupt
            stop.append(signum)

        handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._began = time.perf_counter()
        bar = tqdm(range(start, self.iterations), initial=start, total=self.iterations, desc="meta-train",
                   dynamic_ncols=True, mininterval=0.5, disable=None if main else True)  # fmt: skip
        # tqdm switches itself off without a terminal (disable=None); then a plain line per log window.
        plain = main and sys.stderr is not None and not sys.stderr.isatty()
        window_began, window_start = time.perf_counter(), start
        try:
            for iteration in bar:
                # The full meta-batch on every rank, whatever their number: the same trajectory.
                batch = maml.shard(self.sample(generator)).to(self.device)
                t0 = time.perf_counter()
                weights = None if self.schedule is None else self.schedule.apply(iteration, self.learner, self.optimizer)
                out = self.learner.run(batch, step_weights=weights)
                self.optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                if sharded:
                    # One all-reduce carries the meta-gradients, the meta-loss and whether a rank was
                    # signalled; ranks get signals at different moments, and deciding on the shared
                    # vote makes them all stop after the same iteration (none left in a collective).
                    votes = torch.stack([out.loss.detach(), out.loss.new_tensor(float(bool(stop)))])
                    loss, vote = maml.all_reduce_grads(self.learner.parameters(), votes).tolist()
                    stopping = vote > 0
                else:
                    loss, stopping = float(out.loss.detach()), bool(stop)
                last = iteration + 1 == self.iterations
                logging = (iteration + 1) % self.log_every == 0 or last  # a run shorter than log_every logs too
                if logging:
                    grads = [p.grad for p in self.learner.parameters() if p.grad is not None]
                    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
                self.optimizer.step()
                self.step_time += time.perf_counter() - t0
                self.window.append(loss)
                if logging:
                    inner, metrics = self._inner_losses(out, batch), self.metrics(out, batch)
                    row = {
                        "iteration": iteration + 1,
                        "train/meta_loss": sum(self.window) / len(self.window),
                        "train/meta_grad_norm": grad_norm,
                        "train/step_time_ms": 1e3 * self.step_time / len(self.window),
                        **inner,
                        **self._rates(),
                        **metrics,
                    }
                    if sharded:  # means over this rank's tasks -> means over the meta-batch
                        shard_means = torch.tensor([*inner.values(), *metrics.values()], dtype=torch.float64, device=self.device)
                        row.update(zip([*inner, *metrics], maml.all_reduce_mean(shard_means).tolist()))
                    if main and ((iteration + 1) % self.val_every == 0 or last):
                        validation = self.validate()
                        row.update(validation)
                        self._keep_if_best(opts.out, iteration + 1, validation)
                    self.history.append(row)
                    if main:
                        with _writing(metrics_path):
                            metrics_file.write(json.dumps(row) + "\n")  # type: ignore[union-attr]
                            metrics_file.flush()  # a kill loses no row the process logged
                        if iteration + 1 >= wandb_from:
                            run.log(row, step=iteration + 1)
                    bar.set_postfix(meta_loss=f"{row['train/meta_loss']:.4f}")
                    self.window, self.step_time = [], 0.0
                    if plain:
                        now = time.perf_counter()
                        rate = (iteration + 1 - window_start) / max(now - window_began, 1e-9)
                        eta = round((self.iterations - iteration - 1) / rate)
                        print(f"meta-train {iteration + 1}/{self.iterations} ({100 * (iteration + 1) // self.iterations} %): "
                              f"meta-loss {row['train/meta_loss']:.4g}, {rate:.1f} it/s, "
                              f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", file=sys.stderr, flush=True)  # fmt: skip
                        window_began, window_start = now, iteration + 1
                if main and (stopping or (iteration + 1) % self.checkpoint_every == 0 or last):
                    checkpoint(iteration + 1)
                if stopping:
                    bar.close()
                    if main:
                        finish_wandb(run)
                        print(f"\nstopped after iteration {iteration + 1}; continue with the same command plus --resume",
                              file=sys.stderr)  # fmt: skip
                    # A rank stopped by another's signal exits as if it had received SIGTERM.
                    raise SystemExit(130 if stop and stop[0] == signal.SIGINT else 143)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            bar.close()
            if metrics_file is not None:
                with contextlib.suppress(OSError):
                    metrics_file.close()
        self.train_seconds += time.perf_counter() - self._began
        # The validation of the last iteration: logged with it, or (a run that trained nothing,
        # stopped past its last log row) of the checkpoint's parameters now.
        last_row = self.history[-1] if self.history else {}
        self.final_val = {k: v for k, v in last_row.items() if k.startswith("val/")}
        if main and (last_row.get("iteration") != self.iterations or not self.final_val):
            self.final_val = self.validate()

    def _keep_if_best(self, out: Path, iteration: int, validation: dict[str, float]) -> None:
        """Writes ``best.pt`` when ``validation`` beats every earlier validation (ties keep the earlier)."""
        if self.select is None or self.select[0] not in validation:
            return
        metric, goal = self.select
        value, best = validation[metric], self.best.get(metric)
        if best is not None and not (value > best if goal == "max" else value < best):
            return
        self.best = {"iteration": iteration, **validation}
        data = io.BytesIO()
        torch.save({"iteration": iteration, "validation": validation, "learner": self.learner.state_dict()}, data)
        atomic_write(out / BEST_FILE, lambda p: p.write_bytes(data.getbuffer()))

    def _inner_losses(self, out: maml.MetaOutput, batch: maml.TaskBatch) -> dict[str, float]:
        row = {"train/query_loss": float(out.query_losses.mean())}
        if out.support_losses.shape[0]:
            with torch.no_grad():
                after, _ = self.learner.task_losses(out.fast, batch.support_x, batch.support_y)
            row["train/support_loss_before"] = float(out.support_losses[0].mean())
            row["train/support_loss_after"] = float(after.mean())
        return row

    def _rates(self) -> dict[str, float]:
        return {f"inner_lr/{k}": float(v.detach().mean()) for k, v in self.learner.rate_parameters.items()}


def main(run: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Runs an experiment's entry point, turning UsageError into a message and exit code 2.

    Leaves the process group that ``parse_args`` joined under torchrun, however the run ends.
    """
    together = False  # whether every rank ends here at the same point of the run
    try:
        run(argv)
        together = True
    except UsageError as e:
        # Under torchrun every rank may print it; the rank says which process did.
        where = f" (rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
        print(f"error{where}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit as e:
        together = e.code in (130, 143)  # the stop that every rank voted for after one iteration
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            if together:
                # Ranks > 0 finish before rank 0 (which evaluates and writes); a rank that tore down
                # its gloo connections while rank 0 still held them has died of SIGABRT at exit.
                # Leaving together is the shutdown that gloo and NCCL expect.
                dist.barrier()
            dist.destroy_process_group()
