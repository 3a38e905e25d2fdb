"""One run of an experiment script, from the command line to results.json (:func:`fit`), and where it computes
(:func:`setup`: its CPU threads, its device, the C++ compiler, and under ``torchrun`` the process group that shares
each meta-batch).

A script gives its own parts in an :class:`Experiment` (config, data, :class:`Model`, :class:`Tasks`, and a test
returning :class:`Results`); :func:`fit` does the rest, and :func:`main` turns how a run ends into one line and
its exit code::

    def run(argv=None, life=None):
        fit.fit(fit.Experiment("sine", SineConfig, "...", check, model=..., tasks=..., test=...), argv, life)

    if __name__ == "__main__":
        fit.main(run)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

import maml
from experiments.harness import failures, recipes
from experiments.harness.config import RunFlags, RunOptions, parse_args
from experiments.harness.failures import DivergenceWatch, Need, check_fits, parameter_bytes, stop_on_failure
from experiments.harness.folder import UsageError
from experiments.harness.lifecycle import Lifecycle, RankUsageError, Terminated, main
from experiments.harness.report import finish, init_wandb, wandb_mode
from experiments.harness.rundir import prepare_out, source, take_out
from experiments.harness.trainer import Trainer

__all__ = ["Model", "Tasks", "Results", "Fitted", "Experiment", "fit", "main", "setup"]
__all__ += ["set_threads", "parse_device", "cxx", "check_device", "join_processes", "check_shards"]


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
    # extra training metrics ("train/..."), taken at every iteration and logged as their means over the log window
    metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]
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
        UsageError: a ``$WANDB_MODE`` that is no mode, a bad ``--threads`` or ``--device``, a device this machine
            cannot use, or a process group that cannot be joined on it.
    """
    if cfg.compile is None:  # auto: the compiled step where it applies and a C++ compiler is found
        compiles = maml.Mode.of(cfg.mode).compiles
        cfg = dataclasses.replace(cfg, compile=compiles and cxx() is not None)
        if not cfg.compile and compiles:
            print(
                "note: no C++ compiler found (g++, c++ or $CXX), so the meta-step runs eager, 2-4x slower on "
                "small models; install one, or pass --compile false to silence this",
                file=sys.stderr,
            )
    device = parse_device(flags.device)
    wandb = wandb_mode(flags.wandb)
    set_threads(flags.threads)
    device, rank, size = join_processes(device, life.joined if life is not None else None)
    check_device(device)  # this process's own (under torchrun, cuda:LOCAL_RANK)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun (--max-restarts)
    opts = RunOptions(name, flags.out, flags.resume, flags.overwrite, wandb, device, flags.config, rank, size, restart)
    return cfg, opts


def _fit(experiment: Experiment, argv: Sequence[str] | None, life: Lifecycle) -> None:
    lock = life.lock
    cfg, flags = parse_args(
        experiment.name, experiment.config, argv, experiment.description, experiment.check, threads=experiment.threads
    )
    cfg, opts = setup(experiment.name, cfg, flags, life)
    if experiment.resolve is not None:
        cfg = experiment.resolve(cfg)
    check_shards(cfg.meta_batch, opts.world_size)
    needs = experiment.needs(cfg, parameter_bytes(lambda: experiment.model(cfg).module)) if experiment.needs else ()
    check_fits(needs, opts.device)  # sizes whose tensors cannot fit: one line, before anything is written
    resumed = prepare_out(opts, cfg, lock)  # before writing anything; a resume's code is checked against its start's
    if resumed is not None:  # (a torchrun restart resumes without --resume; an --overwrite'n run is this one now)
        opts = dataclasses.replace(opts, resume=True, overwrite=False)
    # The code is recorded as the run starts: one changed and reverted before its end would pass for clean there.
    began = resumed["git_history"] if resumed else [{"at": "start", "iteration": 0, **source()}] if opts.main else []
    data = experiment.load(cfg) if experiment.load is not None else None
    torch.manual_seed(cfg.seed)
    model = experiment.model(cfg)
    net = model.module.to(opts.device)
    learner = recipes.learner(cfg, net, model.loss, model.meta_only)
    tasks = experiment.tasks(cfg, data, opts.device)
    if cfg.memory_budget is not None:  # planned on a batch of its own (the run's draws stay the run's)
        batch = maml.shard(tasks.sample(torch.Generator().manual_seed(cfg.seed))).to(opts.device)
        plan = failures.plan_memory(learner, batch, cfg.memory_budget, opts.out, needs)
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
    # A NaN/Inf (one line naming the loop and its flag), or memory that runs out: exit code 1.
    with stop_on_failure(opts.out, wandb_run, needs, opts.main):
        trainer.run(opts, cfg, resumed, wandb_run)
    life.evaluating()
    if not opts.main:
        return  # rank 0 tests and writes the results
    with stop_on_failure(opts.out, wandb_run, needs):
        results = experiment.test(Fitted(cfg, opts, data, net, learner, trainer))
    finish(opts, cfg, wandb_run, trainer.results(), trainer.data_files, results.test, results.metric, **results.extra)
    print(results.summary)


# ---------------------------------------------------------------------- where the run computes


def set_threads(threads: int | None) -> None:
    """Sets this process's CPU threads (intra-op, and inter-op where PyTorch still allows it); None keeps PyTorch's.

    Raises:
        UsageError: ``threads < 1``, or more than the CPUs this process may run on (they would only wait on each other).
    """
    if threads is None:
        return
    if threads < 1:
        raise UsageError(
            f"--threads {threads} must be >= 1, or null for PyTorch's default "
            f"({torch.get_num_threads()} on this machine)."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads > cpus:
        raise UsageError(f"--threads {threads} is more than the {cpus} CPUs this process may run on; pass 1 to {cpus}.")
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # settable once, before any inter-op work; a step uses the intra-op ones
        torch.set_num_interop_threads(threads)


def parse_device(name: str) -> torch.device:
    """The device ``--device name`` names; UsageError if it is not a torch device, or none to train on here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu.")
    if device.type == "meta":
        raise UsageError(f"--device {name} holds shapes without data, so nothing can train on it; use --device cpu.")
    return device


def cxx() -> str | None:
    """The C++ compiler torch.compile's CPU backend would call, if one is installed."""
    return next(
        filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)), None
    )


def check_device(device: torch.device) -> None:
    """Raises UsageError, naming what to pass instead, when ``device`` is not usable on this machine."""
    available = {
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
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
    message = f"--device {device} is not available on this machine ({reason}); use --device cpu{other}."
    # Under torchrun each process checks its own GPU (cuda:LOCAL_RANK): one may fail where the others do not.
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    raise (RankUsageError if grouped and device.index is not None else UsageError)(message)


def join_processes(device: torch.device, joined: threading.Event | None = None) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group: this process's device, rank and world size (alone: ``(device, 0, 1)``).

    gloo on CPU; NCCL on GPUs, each process on ``cuda:LOCAL_RANK``. UsageError for a device the backends cannot serve,
    one GPU for several processes, or fewer GPUs than processes. ``joined`` (the lifecycle's) is set once joined.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if not dist.is_available():
        raise UsageError("this PyTorch build has no torch.distributed; run the script without torchrun.")
    store: dict[str, Any] = {}  # where the processes meet (empty: torch.distributed's env:// default)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the launcher's agent keeps the run's store
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        try:  # nothing listens there: the agent died, and joining would wait 30 minutes in C++
            socket.create_connection(address, timeout=10).close()
        except ConnectionRefusedError:
            raise Terminated from None  # as the SIGTERM that the launcher's death would have sent
        except OSError:  # unreachable for now: joining says what is wrong
            pass
        # One store serves each attempt of a run that torchrun restarts (--max-restarts), where a process may read
        # the address a process of the attempt before left: each attempt's keys apart (pytorch/pytorch#167288).
        agent = dist.TCPStore(*address, is_master=False, timeout=dist.default_pg_timeout)
        prefix = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
        store = {"store": prefix, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    if device.type == "cuda":
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device.index is not None and local_size > 1:
            raise UsageError(
                f"--device {device}: the {local_size} processes on this machine would share one GPU; "
                f"pass --device cuda, and each process takes the GPU cuda:LOCAL_RANK."
            )
        if device.index is None:
            if local_rank >= torch.cuda.device_count():  # this process's GPU alone: the first ones have theirs
                raise RankUsageError(
                    f"process LOCAL_RANK={local_rank} needs the GPU cuda:{local_rank}, but this machine has "
                    f"{torch.cuda.device_count()}; start at most that many processes per machine "
                    f"(--nproc-per-node)."
                )
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL and broadcast_object_list use the current device
    elif device.type != "cpu":
        raise UsageError(f"--device {device}: several processes need --device cpu (gloo) or --device cuda (NCCL).")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **store)
    # gloo's init returns on a process whose connections are made while another still makes its own: one
    # that then stopped on a usage error would break the other's init. All leave together.
    dist.barrier()
    if joined is not None:
        joined.set()
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, world_size: int) -> None:
    """Raises UsageError, at start-up, when the meta-batch cannot be split into equal shares (``maml.shard_size``)."""
    try:
        maml.shard_size(meta_batch, world_size)
    except ValueError as error:
        raise UsageError(f"--meta-batch {meta_batch}: {error} torchrun starts --nnodes x --nproc-per-node.") from None
