"""What a run is given: the hyperparameters (:class:`ExperimentConfig`), how to run (:class:`RunFlags`,
:class:`RunOptions`), and :func:`parse_args`, which reads them from the command line and ``--config`` YAML.

Each field of the config dataclasses is a flag and a YAML key, and its attribute docstring is its
``--help`` text (``experiments.cli`` reads the words). Precedence: the dataclass defaults, then
the recipe of ``--algorithm`` (``experiments.recipes``), then ``--config FILE``, then flags.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import tyro
import yaml

import maml
from experiments import cli, recipes, runtime, tracking
from experiments.cli import UsageError
from experiments.config_file import load_yaml
from experiments.files import atomic_write
from experiments.run_options import RunOptions

__all__ = [
    "RunFlags",
    "ExperimentConfig",
    "check_config",
    "check_given",
    "parse_args",
    "load_config",
    "config_text",
    "save_config",
]

COMPILED_MODES = maml.COMPILED_MODES  # the modes compile=True applies to (the engine's table)
UNROLLED_MODES = maml.UNROLLED_MODES  # the modes that differentiate an unrolled inner loop (the engine's table)
# The most inner steps a run takes, in training (--steps) or in the evaluation (--eval-steps). Each step is a
# forward and backward pass of every task, and second order keeps each one's graph for the meta-gradient, so
# 10^12 steps run for days before the first meta-iteration ends. Published protocols take at most 50 (MAML 1-10,
# MAML++ 5, iMAML 16-25, Reptile's evaluation 50): 10,000 is 200 times that, and still finishes.
MAX_STEPS = 10_000
# The most conjugate-gradient iterations of --mode implicit. In exact arithmetic CG solves an n-dimensional
# system in n iterations, and in float32 it stops gaining long before (iMAML runs 5-20); each iteration is a
# Hessian-vector product of every task, so 10^12 of them never end. 1,000 is 50 times the most published.
MAX_CG_ITERATIONS = 1_000


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
    wandb: Annotated[
        Literal["offline", "online", "disabled"] | None,
        tyro.conf.arg(help_behavior_hint="(default: $WANDB_MODE, else online if logged in, else offline)"),
    ] = None
    """wandb mode (null: $WANDB_MODE, else online if logged in, else offline)"""
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
    """learning rate of the outer loop (Reptile's meta-step size with --meta-optimizer sgd)"""
    meta_optimizer: Literal["adam", "sgd"] = "adam"
    """the outer optimizer: adam, or sgd (plain steps of --meta-lr, as Reptile's)"""
    rate_meta_lr: float | None = None
    """Adam learning rate of learned inner rates (null: --meta-lr); a schedule scales it alike"""
    mode: Literal[maml.MODES] = "second_order"  # type: ignore[valid-type]
    """the meta-gradient: exact (second_order), without second derivatives (first_order), exact in less memory (checkpointed), Reptile's (reptile) or iMAML's (implicit)"""
    batching: Literal[maml.BATCHINGS] = "auto"  # type: ignore[valid-type]
    """how the tasks of a meta-batch run: auto (the faster of the two, timed on the first batch), vmap or loop"""
    learn_inner_lr: Literal["scalar", "per_parameter", "per_layer_per_step"] | None = None
    """learned inner rates: scalar, per_parameter (Meta-SGD) or per_layer_per_step (MAML++); null: fixed"""
    backward_chunk: int | None = None
    """tasks per backward pass (learner.backward: the same meta-gradient, one chunk's inner-loop graph in memory at a time); null: the whole meta-batch in one"""
    clip_meta_grad: float | None = None
    """clamp each meta-gradient entry to [-c, c] before the meta-step (the reference's mini-ImageNet clip: 10); null: none"""
    compile: bool | None = None
    """compile the meta-step with torch.compile (exact; a one-off compile, then faster steps); null: where a C++ compiler is found, for second or first order"""
    algorithm: Literal[recipes.ALGORITHMS] = "maml"  # type: ignore[valid-type]
    """the recipe (sets its paper's values for the keys below; a flag or YAML key overrides it)"""
    adapt: Literal[recipes.ADAPT] = "all"  # type: ignore[valid-type]
    """what the inner loop adapts: all, head (ANIL) or body (BOIL)"""
    inner_optimizer: Literal[maml.INNER_OPTIMIZERS] = "sgd"  # type: ignore[valid-type]
    """inner update rule"""
    inner_adam_betas: tuple[float, ...] = (0.9, 0.999)
    """the betas of --inner-optimizer adam (Reptile's: 0,0.999)"""
    implicit_lam: float = 1.0
    """iMAML's proximal regularisation lambda (--mode implicit)"""
    cg_iterations: int = 5
    """conjugate-gradient iterations of --mode implicit"""
    msl_fraction: float = 0.0
    """share of training with MAML++'s annealed multi-step loss (0: only the last step's loss)"""
    first_order_fraction: float = 0.0
    """share of training in first order before --mode (derivative-order annealing)"""
    meta_lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """constant, or annealed to --min-meta-lr: cosine, or linear (Reptile's)"""
    min_meta_lr: float = 1e-5
    """the annealed schedules' final meta-lr (>= 0)"""
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
    flag = cli.flag
    if cfg.clip_meta_grad is not None and not 0 < cfg.clip_meta_grad < float("inf"):
        raise ValueError(
            f"--clip-meta-grad {cfg.clip_meta_grad:g} must be a finite number > 0 (10 is the reference's), or null."
        )
    for key in ("msl_fraction", "first_order_fraction"):
        if not 0 <= getattr(cfg, key) <= 1:  # NaN fails too
            raise ValueError(f"{flag(key)} {getattr(cfg, key):g} must be a share of training in [0, 1].")
    positive = (
        "iterations",
        "meta_batch",
        "shots",
        "query",
        "log_every",
        "val_every",
        "val_tasks",
        "checkpoint_every",
        "eval_tasks",
        "cg_iterations",
        "backward_chunk",
        *positive,
    )
    for keys, low in ((positive, 1), (("steps", "eval_steps"), 0)):
        for key in keys:
            value = getattr(cfg, key)
            if isinstance(value, tuple) and any(v < low for v in value):
                raise ValueError(f"{flag(key)} {','.join(map(str, value))}: each must be an integer >= {low}.")
            if isinstance(value, int) and value < low:
                raise ValueError(f"{flag(key)} {value} must be an integer >= {low}.")
    # Upper bounds on the counts whose loops a meta-iteration runs, so that a run asked for can finish. The
    # other counts are not bounded: --iterations and the intervals are Python integers, which do not overflow,
    # and a long run is stopped and resumed from its checkpoint; the sizes are bounded by memory (fit).
    for key in ("steps", "eval_steps"):
        value = getattr(cfg, key)
        if isinstance(value, tuple) and any(v > MAX_STEPS for v in value):
            raise ValueError(
                f"{flag(key)} {','.join(map(str, value))}: each must be at most {MAX_STEPS} inner steps, the most a "
                f"run takes (each step is a forward and backward pass of every task; published protocols take 1 to "
                f"50); pass values up to {MAX_STEPS}."
            )
        if isinstance(value, int) and value > MAX_STEPS:
            raise ValueError(
                f"{flag(key)} {value} is above {MAX_STEPS} inner steps, the most a run takes (each step is a "
                f"forward and backward pass of every task; published protocols take 1 to 50); pass at most "
                f"{MAX_STEPS}."
            )
    if cfg.cg_iterations > MAX_CG_ITERATIONS:
        raise ValueError(
            f"--cg-iterations {cfg.cg_iterations} is above {MAX_CG_ITERATIONS}: conjugate gradient solves an "
            f"n-dimensional system in n iterations in exact arithmetic and stops gaining far sooner in float32 "
            f"(iMAML runs 5 to 20), and each iteration is a Hessian-vector product of every task; pass at most "
            f"{MAX_CG_ITERATIONS}."
        )
    for key in ("inner_lr", "meta_lr", "rate_meta_lr", "implicit_lam"):
        value = getattr(cfg, key)
        if value is not None and not 0 < value <= torch.finfo(torch.float32).max:  # NaN fails; inf overflows float32
            default = next(f.default for f in dataclasses.fields(cfg) if f.name == key)
            fix = (
                f", e.g. {default:g} (the default)" if isinstance(default, float) else "; leave it out for the default"
            )
            big = " (in float32, the parameters' precision)" if math.isfinite(value) and value > 0 else ""
            raise ValueError(f"{flag(key)} {value:g} must be a finite number > 0{big}{fix}.")
    if cfg.rate_meta_lr is not None and cfg.learn_inner_lr is None:
        raise ValueError(
            f"--rate-meta-lr {cfg.rate_meta_lr:g} is the Adam lr of learned inner rates, and none are learned; "
            f"drop it, or learn them with --learn-inner-lr."
        )
    if not 0 <= cfg.min_meta_lr <= torch.finfo(torch.float32).max:
        raise ValueError(f"--min-meta-lr {cfg.min_meta_lr:g} must be a finite number >= 0, e.g. 1e-05 (the default).")
    if cfg.meta_lr_schedule != "constant" and cfg.min_meta_lr > cfg.meta_lr:
        raise ValueError(
            f"--min-meta-lr {cfg.min_meta_lr:g} is above --meta-lr {cfg.meta_lr:g}, where the {cfg.meta_lr_schedule} "
            f"schedule starts: it would anneal the meta-lr upwards; pass a --min-meta-lr below --meta-lr."
        )
    if len(cfg.inner_adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.inner_adam_betas):
        betas = ",".join(f"{b:g}" for b in cfg.inner_adam_betas)
        raise ValueError(f"--inner-adam-betas {betas} must be two numbers in [0, 1), e.g. 0.9,0.999 (the default).")
    if cfg.mode not in UNROLLED_MODES and cfg.msl_fraction > 0:
        raise ValueError(
            f"--msl-fraction {cfg.msl_fraction:g} weighs the query losses of an unrolled inner loop, and --mode "
            f"{cfg.mode} unrolls none; drop it, or pick another --mode."
        )
    if cfg.mode not in UNROLLED_MODES and cfg.first_order_fraction > 0:
        raise ValueError(
            f"--first-order-fraction {cfg.first_order_fraction:g} trains that share in first order, dropping the "
            f"second derivatives of an unrolled inner loop, and --mode {cfg.mode} differentiates none; drop it, or "
            f"pick another --mode."
        )
    if cfg.mode == "reptile" and cfg.steps == 0:
        # Reptile's direction is the meta-parameters minus the adapted weights: without a step, zero.
        raise ValueError(
            "--steps 0 with --mode reptile: Reptile's meta-gradient is the meta-parameters minus the weights the "
            "inner steps adapt, which 0 steps leave where they are, so it is zero and nothing trains; pass --steps 1 "
            "or more (the reptile recipe takes 5)."
        )
    if cfg.mode == "implicit" and cfg.steps == 0:
        # iMAML's gradient holds at the solution of the proximal inner problem; 0 steps leave the meta-parameters,
        # which solve it only where the support gradient is zero: the gradient would be no iMAML gradient.
        raise ValueError(
            "--steps 0 with --mode implicit: iMAML's meta-gradient is that of the inner problem's solution, and 0 "
            "inner steps solve nothing (the adapted weights stay the meta-parameters); pass --steps 1 or more (the "
            "imaml recipe takes 10 on sine, 16 on Omniglot)."
        )
    if cfg.mode not in UNROLLED_MODES and cfg.learn_inner_lr is not None:
        why = "differentiates no inner step" if cfg.mode == "reptile" else "does not depend on how the inner loop ran"
        raise ValueError(
            f"--learn-inner-lr {cfg.learn_inner_lr}: --mode {cfg.mode}'s meta-gradient {why}, so it has none for "
            f"the rates; drop it, or pick another --mode."
        )
    if cfg.mode not in UNROLLED_MODES and cfg.adapt != "all":
        why = (
            "iMAML's meta-gradient is that of the adapted weights"
            if cfg.mode == "implicit"
            else "Reptile moves only what the inner loop moved; its reference adapts every trainable variable"
        )
        raise ValueError(
            f"--mode {cfg.mode} needs every trained parameter adapted ({why}), and --adapt {cfg.adapt} leaves "
            f"some out, which would never train; pass --adapt all, or pick another --mode."
        )
    if cfg.compile and cfg.mode not in COMPILED_MODES:
        raise ValueError(
            f"compile applies to mode second_order or first_order, not {cfg.mode}; drop --compile or "
            f"pick another --mode."
        )


# The keys only --mode implicit reads, and what each is: set with another mode, they would do nothing but be
# recorded in config.yaml and results.json as if they had shaped the run.
IMPLICIT_KEYS = {
    "implicit_lam": "iMAML's proximal regularisation",
    "cg_iterations": "the number of conjugate-gradient iterations of iMAML's linear solve",
}


def check_given(cfg: Any, given: Mapping[str, Path | None]) -> None:
    """Raises ValueError naming a key the user set that ``cfg``'s mode does not read.

    ``given``: the keys set by a flag (None) or by a ``--config`` file (its path) to a value of
    their own; the defaults and the recipe's values are not given, so ``--algorithm imaml
    --mode first_order`` passes while ``--mode first_order --cg-iterations 10`` does not.
    """
    if cfg.mode == "implicit":
        return
    for key, what in IMPLICIT_KEYS.items():
        if key not in given:
            continue
        value = getattr(cfg, key)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        path = given[key]
        named = f"{cli.flag(key)} {shown}" if path is None else f"--config {path}: {key} {shown}"
        raise ValueError(
            f"{named} is {what} (--mode implicit), and --mode {cfg.mode} does not read it (it would only be "
            f"recorded in results.json); drop it, or pass --mode implicit."
        )


def parse_args(
    experiment: str,
    cls: type,
    argv: Sequence[str] | None,
    description: str,
    validate: Callable[[Any], None],
    threads: int | None = None,
) -> tuple[Any, RunOptions]:
    """Parses the command line into the experiment's config dataclass and the run options.

    Precedence: the dataclass defaults, then the recipe of ``--algorithm``, then ``--config FILE``
    (YAML), then flags: tyro parses the flags over the config that the others make. ``threads``
    is the experiment's default ``--threads`` (None: PyTorch's).

    Raises:
        UsageError: unknown flag or key (with close matches), wrong type, invalid value, or a
            ``$WANDB_MODE`` that is no mode.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    types_ = {**typing.get_type_hints(RunFlags), **typing.get_type_hints(cls)}
    flagged = cli.check_argv(argv, types_, switches=("resume", "overwrite"))
    base = cls()
    given: dict[str, Path | None] = {}  # the keys the user set, by a flag (None) or in --config (its path)
    if flagged is not None:  # (for --help, the defaults of the dataclass)
        from_yaml = load_yaml(flagged["config"], cls) if flagged.get("config") is not None else {}
        algorithm = {**vars(cls()), **from_yaml, **flagged}["algorithm"]
        preset = {**vars(cls()), **recipes.recipe(experiment, algorithm)}
        base = cls(**{**preset, **from_yaml})
        # A --config file written by a run (config.yaml) holds every key: only a value other than the
        # default or the recipe's counts as set there.
        given = {k: flagged["config"] for k, v in from_yaml.items() if v != preset.get(k)}
        given |= {k: None for k in flagged}
    args_cls = dataclasses.make_dataclass(
        "Args", [("run", RunFlags), (experiment, Annotated[cls, tyro.conf.FlagConversionOff])]
    )
    argv = [a for a in argv if a != "--"]  # the end of the flags, with nothing after it (check_argv saw to that)
    if any(
        a == "--out=" or (a == "--out" and i + 1 < len(argv) and not argv[i + 1].strip()) for i, a in enumerate(argv)
    ):
        # Path("") is the current folder, where --overwrite would delete run files: say so instead.
        raise UsageError('--out is empty; pass a folder, e.g. --out runs/try (or "." for this one).')
    args = cli.tyro_cli(
        args_cls,
        argv,
        args_cls(RunFlags(out=Path("runs") / experiment, threads=threads), base),
        prog=f"python -m experiments.{experiment}",
        description=description,
    )
    run, cfg = args.run, getattr(args, experiment)
    if cfg.compile is None:  # auto: the compiled step where it applies and a C++ compiler is found
        cfg = dataclasses.replace(cfg, compile=cfg.mode in COMPILED_MODES and runtime.cxx() is not None)
        if not cfg.compile and cfg.mode in COMPILED_MODES:
            print(
                "note: no C++ compiler found (g++, c++ or $CXX), so the meta-step runs eager, 2-4x slower on "
                "small models; install one, or pass --compile false to silence this",
                file=sys.stderr,
            )
    try:
        validate(cfg)
        check_given(cfg, given)
    except ValueError as e:
        raise UsageError(str(e)) from None
    device = runtime.parse_device(run.device)
    wandb = tracking.wandb_mode(run.wandb)
    runtime.set_threads(run.threads)
    device, rank, world_size = runtime.join_processes(device)
    return cfg, RunOptions(experiment, run.out, run.resume, run.overwrite, wandb, device, run.config, rank, world_size)


def config_text(cfg: Any) -> str:
    """``cfg`` as ``config.yaml`` holds it."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    return yaml.safe_dump(values, sort_keys=False)


def save_config(out: Path, cfg: Any) -> None:
    """Writes ``cfg`` to ``out/config.yaml``, which ``--config`` reads back."""
    atomic_write(out / "config.yaml", lambda p: p.write_text(config_text(cfg)))


def load_config(cls: type, path: Path) -> Any:
    """The config dataclass saved in a run's config.yaml."""
    return cls(**load_yaml(path, cls))
