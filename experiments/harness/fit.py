"""One run of an experiment script, from the command line to results.json: :func:`fit`.

A script gives its own parts in an :class:`Experiment` (config, data, :class:`Model`, :class:`Tasks`, and a test
returning :class:`Results`); :func:`fit` does the rest, and :func:`main` turns how a run ends into one line and
its exit code::

    def run(argv=None, life=None):
        fit.fit(fit.Experiment("sine", SineConfig, "...", check, model=..., tasks=..., test=...), argv, life)

    if __name__ == "__main__":
        fit.main(run)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

import maml
from experiments.harness import devices, recipes
from experiments.harness.config import RunFlags, RunOptions, parse_args
from experiments.harness.divergence import DivergenceWatch, stop_on_divergence
from experiments.harness.folder import UsageError, atomic_write
from experiments.harness.lifecycle import Lifecycle, main
from experiments.harness.report import finish_wandb, init_wandb, provenance, wandb_mode
from experiments.harness.rundir import DATA_KEYS, prepare_out, source, take_out
from experiments.harness.trainer import Trainer

__all__ = ["Model", "Tasks", "Results", "Fitted", "Experiment", "fit", "main", "finish"]
__all__ += ["Need", "parameter_bytes", "free_bytes", "check_fits", "FLOAT_BYTES"]


@dataclasses.dataclass(frozen=True)
class Model:
    """The network an experiment meta-trains, its per-task loss, and what the inner loop leaves alone."""

    module: nn.Module
    loss: Callable[[Tensor, Tensor], Tensor]  # (outputs, targets) of one task -> a scalar
    meta_only: Collection[str] = ()  # names of parameters that only the outer loop learns
    # What computes the training steps in place of this toolkit's learner (experiments.peers.Learn2LearnMAML); None: it
    engine: Callable[[maml.MetaLearner], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The training and validation tasks, and what the log rows say about them."""

    sample: Callable[[torch.Generator], maml.TaskBatch]  # one meta-batch of training tasks
    metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]  # extra training metrics ("train/...")
    val_batch: maml.TaskBatch | None  # the fixed validation tasks (None: no validation)
    val_metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]  # validation metrics ("val/...")
    select: tuple[str, Literal["max", "min"]] | None = None  # model selection: best.pt holds the best validation's


@dataclasses.dataclass(frozen=True)
class Results:
    """What the final test gives results.json and the terminal."""

    test: dict[str, dict[str, Any]]  # results.json's "test": each entry holds ``metric`` and its "ci95"
    metric: str  # the entries' metric, e.g. "mse" (wandb's summary gets it)
    summary: str  # printed on stdout once results.json is written
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # more keys of results.json, before "test"


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A run after meta-training (rank 0), as the experiment's test gets it."""

    cfg: Any
    opts: RunOptions
    data: Any  # what the experiment's load returned
    model: nn.Module
    learner: maml.MetaLearner  # this toolkit's, whatever computed the training steps
    trainer: Trainer  # its history, best validation and iterations

    def run(self, batch: maml.TaskBatch, **kwargs: Any) -> maml.MetaOutput:
        """``learner.run(batch, **kwargs)``; a NaN/Inf inner loss ends the run with "the final test" diverging."""
        return self.trainer.run_batch(batch, "the final test", **kwargs)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """An experiment script's own parts; :func:`fit` runs the rest. Each hook is given the parsed config ``cfg``."""

    name: str  # python -m experiments.NAME; runs/NAME is the default --out, NAME the recipes' key
    config: type  # the config dataclass (a subclass of experiments.config.ExperimentConfig)
    description: str  # the first paragraph of --help
    check: Callable[[Any], None]  # raises ValueError naming the flag and value of an invalid key
    model: Callable[[Any], Model]  # the network, on the CPU, initialised (the global RNG is seeded with --seed)
    tasks: Callable[[Any, Any, torch.device], Tasks]  # tasks(cfg, data, device)
    test: Callable[[Fitted], Results]  # the final test, the plots and the summary
    threads: int | None = None  # the default --threads (None: PyTorch's)
    resolve: Callable[[Any], Any] | None = None  # cfg -> cfg with the defaults that depend on others filled in
    load: Callable[[Any], Any] | None = None  # reads the data (UsageError if it cannot), before anything is written
    notes: Callable[[Any, Any], Sequence[str]] | None = None  # notes(cfg, data): lines for stderr once the run starts
    run_name: Callable[[Any], str] | None = None  # the wandb run's name (default: NAME)
    # needs(cfg, parameter bytes or None): lower bounds on memory held at one moment, checked before writing
    needs: Callable[[Any, int | None], Sequence[Need]] | None = None


def fit(experiment: Experiment, argv: Sequence[str] | None = None, life: Lifecycle | None = None) -> None:
    """Runs ``experiment`` with the command line ``argv`` (default: ``sys.argv[1:]``), from parsing to results.json,
    in the :class:`~experiments.harness.lifecycle.Lifecycle` ``life`` (:func:`main`'s; None: a fresh one, whose
    lock and stage serve without its exit codes: a notebook, a test).

    Under ``torchrun`` every process trains its share of each meta-batch; rank 0 alone writes, logs and tests.

    Raises:
        UsageError: bad flags, config file, device, data or ``--out`` (nothing is written then).
        SystemExit: 1 when training diverged (after one line); 130 or 143 when stopped by a signal.
    """
    life = Lifecycle() if life is None else life
    with life.lock:  # --out is this run's until it ends (the process may go on: tests, notebooks)
        _fit(experiment, argv, life)


def setup(name: str, cfg: Any, flags: RunFlags, life: Lifecycle | None = None) -> tuple[Any, RunOptions]:
    """What the parsed command line asks of this machine, done once at start-up: the compiled step's default (where
    a C++ compiler is found), the wandb mode, the threads, the device and, under torchrun, the process group.

    Raises:
        UsageError: a ``$WANDB_MODE`` that is no mode, a bad ``--threads`` or ``--device``, or a process group that
            cannot be joined on it.
    """
    if cfg.compile is None:  # auto: the compiled step where it applies and a C++ compiler is found
        compiles = maml.Mode.of(cfg.mode).compiles
        cfg = dataclasses.replace(cfg, compile=compiles and devices.cxx() is not None)
        if not cfg.compile and compiles:
            print(
                "note: no C++ compiler found (g++, c++ or $CXX), so the meta-step runs eager, 2-4x slower on "
                "small models; install one, or pass --compile false to silence this",
                file=sys.stderr,
            )
    device = devices.parse_device(flags.device)
    wandb = wandb_mode(flags.wandb)
    devices.set_threads(flags.threads)
    device, rank, size = devices.join_processes(device, life.joined if life is not None else None)
    return cfg, RunOptions(name, flags.out, flags.resume, flags.overwrite, wandb, device, flags.config, rank, size)


def _fit(experiment: Experiment, argv: Sequence[str] | None, life: Lifecycle) -> None:
    lock = life.lock
    cfg, flags = parse_args(
        experiment.name, experiment.config, argv, experiment.description, experiment.check, threads=experiment.threads
    )
    cfg, opts = setup(experiment.name, cfg, flags, life)
    if experiment.resolve is not None:
        cfg = experiment.resolve(cfg)
    devices.check_shards(cfg.meta_batch, opts.world_size)
    if experiment.needs is not None:  # sizes whose tensors cannot fit: one line, before anything is written
        check_fits(experiment.needs(cfg, parameter_bytes(lambda: experiment.model(cfg).module)), opts.device)
    resumed = prepare_out(opts, cfg, lock)  # before writing anything; a resume's code is checked against its start's
    # The code is recorded as the run starts: one changed and reverted before its end would pass for clean there.
    began = resumed["git_history"] if resumed else [{"at": "start", "iteration": 0, **source()}] if opts.main else []
    data = experiment.load(cfg) if experiment.load is not None else None
    torch.manual_seed(cfg.seed)
    model = experiment.model(cfg)
    net = model.module.to(opts.device)
    learner = engine_learner(cfg, model, net)
    tasks = experiment.tasks(cfg, data, opts.device)
    if cfg.memory_budget is not None:  # planned on a batch of its own (the run's draws stay the run's): one line
        try:
            plan = learner.plan_for(maml.shard(tasks.sample(torch.Generator().manual_seed(cfg.seed))).to(opts.device))
        except ValueError as e:
            raise UsageError(f"--memory-budget {cfg.memory_budget}: {e}") from None
        if opts.main:
            print(f"memory plan: {plan}", file=sys.stderr)
    if opts.main:
        take_out(opts, cfg, lock)  # clears an --overwrite'n run's files, then writes config.yaml
        for note in experiment.notes(cfg, data) if experiment.notes is not None else ():
            print(note, file=sys.stderr)

    optimizer = recipes.meta_optimizer(learner, cfg.meta_lr, cfg.rate_meta_lr, cfg.meta_optimizer)
    trained = learner if model.engine is None else model.engine(learner)
    reptile = cfg.mode == "reptile" and cfg.meta_optimizer == "sgd"  # the step towards the adapted weights
    watch = DivergenceWatch(trained, resumed["iteration"] if resumed else 0, cfg.meta_lr, cfg.inner_lr, reptile)
    trainer = Trainer(
        learner=trained,
        optimizer=optimizer,
        **vars(tasks),  # sample, metrics, val_batch, val_metrics, select
        watch=watch,
        iterations=cfg.iterations,
        log_every=cfg.log_every,
        val_every=cfg.val_every,
        checkpoint_every=cfg.checkpoint_every,
        seed=cfg.seed,
        device=opts.device,
        schedule=recipes.Schedule.of(cfg),
        backward_chunk=cfg.backward_chunk,
        clip_value=cfg.clip_meta_grad,
        git_history=began,
    )
    name = experiment.run_name(cfg) if experiment.run_name is not None else experiment.name
    wandb_run = init_wandb(opts, cfg, name, resumed["wandb_id"] if resumed else None) if opts.main else None
    life.training(opts.out)
    # A NaN/Inf: one line naming the loop and the flag, exit code 1.
    with stop_on_divergence(opts.out, wandb_run, opts.main):
        trainer.run(opts, cfg, resumed, wandb_run)
    life.evaluating()
    if not opts.main:
        return  # rank 0 tests and writes the results
    with stop_on_divergence(opts.out, wandb_run):
        results = experiment.test(Fitted(cfg, opts, data, net, learner, trainer))
    finish(opts, cfg, wandb_run, trainer, results.test, results.metric, **results.extra)
    print(results.summary)


def engine_learner(cfg: Any, model: Model, net: torch.nn.Module) -> maml.MetaLearner:
    """The run's learner, built from its config; an option the engine refuses (a ``--memory-budget`` that is no
    size, or one for a mode that plans nothing) is a usage error: one line, exit code 2, nothing written."""
    try:
        return maml.MetaLearner(
            net,
            model.loss,
            inner_lr=cfg.inner_lr,
            steps=cfg.steps,
            mode=maml.Implicit(cfg.implicit_lam, cfg.cg_iterations) if cfg.mode == "implicit" else cfg.mode,
            batching=cfg.batching,
            learn_inner_lr=cfg.learn_inner_lr,
            compile=cfg.compile,
            adapt=recipes.adapt_set(net, cfg.adapt, model.meta_only),
            inner_optimizer=cfg.inner_optimizer,
            inner_optimizer_options={"betas": cfg.inner_adam_betas} if cfg.inner_optimizer == "adam" else None,
            memory_budget=cfg.memory_budget,
        )
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def finish(
    opts: RunOptions, cfg: Any, run: Any, trainer: Trainer, test: dict[str, dict[str, Any]], metric: str, **extra: Any
) -> None:
    """Puts the test metric in the wandb summary, writes results.json, and closes the wandb run."""
    for key, r in test.items():
        run.summary[f"test/{metric}_{key}"] = r[metric]
        run.summary[f"test/{metric}_{key}_ci95"] = r["ci95"]
    config = dataclasses.asdict(cfg)
    # No path of this machine in a result file: the data's path relative to the working directory, its fingerprint.
    data = {
        k: {"path": os.path.relpath(v), "fingerprint": trainer.data_files.get(k, {}).get("fingerprint")}
        for k in DATA_KEYS
        if isinstance(v := config.get(k), str)
    }
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
        **({"memory_plan": str(plan)} if (plan := getattr(trainer.learner, "plan", None)) is not None else {}),
        "git_history": trainer.git_history,  # the code at the start and at each resume; at the end: provenance()
        **provenance(),
    }
    atomic_write(opts.out / "results.json", lambda p: p.write_text(json.dumps(results, indent=2) + "\n"))
    finish_wandb(run)


# ---------------------------------------------------------------------- memory
# Whether a run's tensors can fit, checked before anything is written: a size flag set far too high ends in one
# line, not a traceback. Each Need is a lower bound every mode reaches: a refused run cannot fit.

FLOAT_BYTES = 4  # float32, the experiments' dtype


@dataclasses.dataclass(frozen=True)
class Need:
    """Memory a run holds at one moment: what it is, the flags it grows with, and at least how many bytes."""

    what: str  # e.g. "the training meta-batch's images"
    flags: str  # e.g. "--meta-batch, --ways, --shots, --query"
    bytes: int | None  # None: more than PyTorch can count (sizes whose product overflows)


def parameter_bytes(build: Callable[[], nn.Module]) -> int | None:
    """The bytes of the parameters of ``build()``, built on the meta device; None where the sizes overflow."""
    try:
        with torch.device("meta"):
            net = build()
    except RuntimeError as e:
        if "overflow" in str(e):
            return None
        raise
    return sum(p.numel() * p.element_size() for p in net.parameters())


def free_bytes(device: torch.device) -> int | None:
    """The GPU's free memory, or the host's available memory and free swap (Linux); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def check_fits(needs: Sequence[Need], device: torch.device) -> None:
    """Raises UsageError naming the flags of the largest need when it exceeds ``device``'s free memory."""
    free = free_bytes(device)
    if free is None or not needs:
        return
    worst = max(needs, key=lambda n: float("inf") if n.bytes is None else n.bytes)
    if worst.bytes is not None and worst.bytes <= free:
        return
    amount = "more than PyTorch can count" if worst.bytes is None else f"at least {_size(worst.bytes)}"
    which = "the one set too high" if ", " in worst.flags else "it"
    where = "this machine" if device.type == "cpu" else str(device)
    raise UsageError(
        f"{worst.flags}: {worst.what} need {amount}, and {where} has {_size(free)} of memory free; lower {which}."
    )
