"""What a run is given: the hyperparameters (:class:`ExperimentConfig`), how to run (:class:`RunFlags`, resolved
into :class:`RunOptions`), and :func:`parse_args`, which reads them from the command line and ``--config`` YAML.

Each field is a flag and a YAML key, and its attribute docstring is its ``--help`` text.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import tyro

import maml
from experiments.harness import cli, recipes
from experiments.harness.checks import check_given
from experiments.harness.folder import UsageError

__all__ = ["RunFlags", "RunOptions", "ExperimentConfig", "parse_args"]


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
class ExperimentConfig:
    """The hyperparameters every experiment has; the defaults are the sine protocol's (Finn et al.), which an
    experiment's subclass overrides and extends."""

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
    run_keys = typing.get_type_hints(RunFlags)
    types_ = {**run_keys, **typing.get_type_hints(cls)}
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
    preset = {**vars(cls()), **recipes.recipe(experiment, algorithm)}
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
