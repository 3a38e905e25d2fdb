"""What a run is given: the hyperparameters (:class:`ExperimentConfig`), how to run (:class:`RunFlags`, resolved
into :class:`RunOptions`), what makes them invalid (:func:`check_config`, :func:`check_given`: one line naming the
flag), and :func:`parse_args`, which reads them from the command line and ``--config`` YAML. Each field is a flag
and a YAML key, and its attribute docstring is its ``--help`` text.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
import tyro

import maml
from experiments.harness import cli, recipes
from experiments.harness.cli import flag, show
from experiments.harness.folder import UsageError

__all__ = ["RunFlags", "RunOptions", "ExperimentConfig", "parse_args"]
__all__ += ["MAX_STEPS", "MAX_CG_ITERATIONS", "check_config", "check_given"]


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
class RunOptions:
    """How to run, as opposed to what to train (the experiment's config dataclass).

    Under ``torchrun``, ``rank`` and ``world_size`` place this process among the ones that share each meta-batch,
    ``device`` is its own (``cuda:LOCAL_RANK`` for ``--device cuda``), and ``restart`` counts the processes' restarts
    so far (``--max-restarts``): a restart goes on from the checkpoint in ``out``.
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
    restart: int = 0

    @property
    def main(self) -> bool:
        """Whether this process is rank 0, the one that logs and writes under ``--out``."""
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """The hyperparameters every experiment has; the defaults are the sine protocol's (Finn et al.), which an
    experiment's subclass overrides and extends."""

    # What each recipe (--algorithm) sets differently for the experiment: its paper's values for that data.
    RECIPES: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

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
    """inner learning rate: the lr of --inner-optimizer (initial value if learned)"""
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
    memory_budget: str | None = None
    """the tensor bytes a training step may hold (6GiB, 500MB, or 0.8 of the device's free memory): the engine plans the tasks per backward pass (second/first order) or the tasks replayed together and the segments (checkpointed) to fit; null: second and first order hold every task at once, checkpointed plans on one task's second-order step"""
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
    """inner update rule: the torch.optim optimizer of that name, differentiable (its lr is --inner-lr)"""
    inner_optimizer_options: str | None = None
    """the inner rule's torch.optim options as a JSON object, e.g. {"momentum": 0.9}; its "learn" meta-learns float options, e.g. {"learn": {"betas": "per_parameter"}} (docs/family.md); null: torch.optim's defaults"""
    inner_adam_betas: tuple[float, ...] = (0.9, 0.999)
    """the betas of --inner-optimizer adam (Reptile's: 0,0.999); betas in --inner-optimizer-options replace them"""
    implicit_lam: float = 1.0
    """iMAML's proximal regularisation lambda (--mode implicit)"""
    inner_proximal: float = 0.0
    """lambda of a proximal term lambda/2 |phi - theta|^2 to the initial weights added to the inner (support) loss, differentiated exactly (the meta-loss stays the query loss); 0: none"""
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


# Upper bounds, so that a run asked for can finish: published protocols take at most 50 inner steps (MAML 1-10,
# MAML++ 5, iMAML 16-25, Reptile's evaluation 50) and 20 conjugate-gradient iterations (iMAML 5-20).
MAX_STEPS = 10_000
MAX_CG_ITERATIONS = 1_000


def check_config(cfg: Any, positive: Sequence[str] = ()) -> None:
    """Raises ValueError naming the flag and the value of the first invalid key of :class:`ExperimentConfig`.

    ``positive``: the experiment's own integer keys (or tuples of them) that must be >= 1; None passes.
    """
    if cfg.clip_meta_grad is not None and not 0 < cfg.clip_meta_grad < float("inf"):
        raise ValueError(
            f"--clip-meta-grad {cfg.clip_meta_grad:g} must be a finite number > 0 (10 is the reference's), or null."
        )
    for key in ("msl_fraction", "first_order_fraction"):
        if not 0 <= getattr(cfg, key) <= 1:  # NaN fails too
            raise ValueError(f"{flag(key)} {getattr(cfg, key):g} must be a share of training in [0, 1].")
    positive = (
        *("iterations", "meta_batch", "shots", "query", "log_every", "val_every", "val_tasks", "checkpoint_every"),
        *("eval_tasks", "cg_iterations", "backward_chunk", *positive),
    )
    # Only the loops inside a meta-iteration are bounded: a long run is stopped and resumed, and memory bounds sizes.
    most = f"{MAX_STEPS} inner steps, the most a run takes (each step is a forward and backward pass of every task; "
    most += "published protocols take 1 to 50)"
    for keys, low in ((positive, 1), (("steps", "eval_steps"), 0)):
        for key in keys:
            value = getattr(cfg, key)
            listed = isinstance(value, tuple)
            values = value if listed else () if value is None else (value,)
            if any(v < low for v in values):
                raise ValueError(f"{flag(key)} {show(value)}{': each' if listed else ''} must be an integer >= {low}.")
            if low == 0 and any(v > MAX_STEPS for v in values):
                each, up_to = (": each must be at most", "values up to") if listed else (" is above", "at most")
                raise ValueError(f"{flag(key)} {show(value)}{each} {most}; pass {up_to} {MAX_STEPS}.")
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
            fix = f", e.g. {default:g} (the default)" if default else "; leave it out for the default"
            big = " (in float32, the parameters' precision)" if math.isfinite(value) and value > 0 else ""
            raise ValueError(f"{flag(key)} {value:g} must be a finite number > 0{big}{fix}.")
    recipes.check_inner_proximal(cfg)
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
    mode = maml.Mode.of(cfg.mode)  # what the mode differentiates, as the engine says
    if not mode.unrolled and cfg.msl_fraction > 0:
        raise ValueError(
            f"--msl-fraction {cfg.msl_fraction:g} weighs the query losses of an unrolled inner loop, and --mode "
            f"{cfg.mode} unrolls none; drop it, or pick another --mode."
        )
    if not mode.unrolled and cfg.first_order_fraction > 0:
        raise ValueError(
            f"--first-order-fraction {cfg.first_order_fraction:g} trains that share in first order, dropping the "
            f"second derivatives of an unrolled inner loop, and --mode {cfg.mode} differentiates none; drop it, or "
            f"pick another --mode."
        )
    if cfg.mode == "reptile" and cfg.steps == 0:
        raise ValueError(
            "--steps 0 with --mode reptile: Reptile's meta-gradient is the meta-parameters minus the weights the "
            "inner steps adapt, which 0 steps leave where they are, so it is zero and nothing trains; pass --steps 1 "
            "or more (the reptile recipe takes 5)."
        )
    if cfg.mode == "implicit" and cfg.steps == 0:
        raise ValueError(
            "--steps 0 with --mode implicit: iMAML's meta-gradient is that of the inner problem's solution, and 0 "
            "inner steps solve nothing (the adapted weights stay the meta-parameters); pass --steps 1 or more (the "
            "imaml recipe takes 10 on sine, 16 on Omniglot)."
        )
    if not mode.unrolled and cfg.learn_inner_lr is not None:
        why = "differentiates no inner step" if cfg.mode == "reptile" else "does not depend on how the inner loop ran"
        raise ValueError(
            f"--learn-inner-lr {cfg.learn_inner_lr}: --mode {cfg.mode}'s meta-gradient {why}, so it has none for "
            f"the rates; drop it, or pick another --mode."
        )
    if not mode.unrolled and cfg.adapt != "all":
        why = (
            "iMAML's meta-gradient is that of the adapted weights"
            if cfg.mode == "implicit"
            else "Reptile moves only what the inner loop moved; its reference adapts every trainable variable"
        )
        raise ValueError(
            f"--mode {cfg.mode} needs every trained parameter adapted ({why}), and --adapt {cfg.adapt} leaves "
            f"some out, which would never train; pass --adapt all, or pick another --mode."
        )
    recipes.inner_options(cfg)  # --inner-adam-betas and --inner-optimizer-options, read and built
    if cfg.compile and not mode.compiles:
        raise ValueError(
            f"--compile true with --mode {cfg.mode}: only --mode {' or '.join(maml.COMPILED_MODES)} compiles; drop "
            f"--compile or pick another --mode."
        )


# The keys only --mode implicit reads: set with another mode, they would be recorded as if they had shaped the run.
IMPLICIT_KEYS = {
    "implicit_lam": "iMAML's proximal regularisation",
    "cg_iterations": "the number of conjugate-gradient iterations of iMAML's linear solve",
}


def check_given(cfg: Any, given: Mapping[str, Path | None]) -> None:
    """Raises ValueError naming a key the user set that ``cfg``'s mode does not read.

    ``given``: the keys set by a flag (None) or a ``--config`` file (its path), not by a default or a
    recipe: ``--algorithm imaml --mode first_order`` passes, ``--mode first_order --cg-iterations 10`` does not.
    """
    if cfg.mode == "implicit":
        return
    for key, what in IMPLICIT_KEYS.items():
        if key not in given:
            continue
        value = getattr(cfg, key)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        path = given[key]
        named = f"{flag(key)} {shown}" if path is None else f"--config {path}: {key} {shown}"
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
) -> tuple[Any, RunFlags]:
    """Parses the command line into the experiment's config dataclass and the run flags, and nothing else: what
    the flags ask of the machine (device, threads, wandb, the process group) is :func:`experiments.harness.fit.setup`'s.

    Precedence: the dataclass defaults, the recipe of ``--algorithm``, ``--config FILE``, then flags.
    ``threads`` is the experiment's default ``--threads`` (None: PyTorch's).

    Raises:
        UsageError: unknown flag or key (with close matches), wrong type, or invalid value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    run_keys = cli.field_types(RunFlags)
    types_ = {**run_keys, **cli.field_types(cls)}
    flagged = cli.read_argv(argv, types_, switches=("resume", "overwrite"))  # the one parse of argv
    run_defaults = RunFlags(out=Path("runs") / experiment, threads=threads)
    if flagged is None:  # --help: tyro renders it from the dataclasses (their defaults), and exits
        args_cls = dataclasses.make_dataclass(
            "Args", [("run", RunFlags), (experiment, Annotated[cls, tyro.conf.FlagConversionOff])]
        )
        cli.tyro_cli(
            args_cls,
            ["--help"],
            args_cls(run_defaults, cls()),
            prog=f"python -m experiments.{experiment}",
            description=description,
        )
    assert flagged is not None  # (tyro exits after the help)
    if any(
        a == "--out=" or (a == "--out" and i + 1 < len(argv) and not argv[i + 1].strip()) for i, a in enumerate(argv)
    ):
        # Path("") is the current folder, where --overwrite would delete run files: say so instead.
        raise UsageError('--out is empty; pass a folder, e.g. --out runs/try (or "." for this one).')
    from_yaml = cli.load_yaml(flagged["config"], cls) if flagged.get("config") is not None else {}
    algorithm = {**vars(cls()), **from_yaml, **flagged}["algorithm"]
    preset = {**vars(cls()), **recipes.recipe(cls, algorithm)}
    # A run's config.yaml holds every key: only a value other than the default or the recipe's counts as set.
    given: dict[str, Path | None] = {k: flagged["config"] for k, v in from_yaml.items() if v != preset.get(k)}
    given |= {k: None for k in flagged if k not in run_keys}
    run = dataclasses.replace(run_defaults, **{k: v for k, v in flagged.items() if k in run_keys})
    cfg = cls(**{**preset, **from_yaml, **{k: v for k, v in flagged.items() if k not in run_keys}})
    try:
        validate(cfg)
        check_given(cfg, given)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg, run
