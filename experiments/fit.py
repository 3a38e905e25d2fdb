"""One run of an experiment script, from the command line to results.json: :func:`fit`.

A script gives its own parts in an :class:`Experiment` (config, data, :class:`Model`, :class:`Tasks`, and a test
returning :class:`Results`); :func:`fit` does the rest, and :func:`main` turns how a run ends into one line and
its exit code::

    def run(argv=None):
        fit.fit(fit.Experiment("sine", SineConfig, "...", check, model=..., tasks=..., test=...), argv)

    if __name__ == "__main__":
        fit.main(run)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

import maml
from experiments import STARTING, peers, recipes, release_start_up_signals, torchrun
from experiments.cli import UsageError
from experiments.config import parse_args
from experiments.divergence import DivergenceWatch, stop_on_divergence
from experiments.lock import unlock_folders
from experiments.memory import Need, check_fits, parameter_bytes
from experiments.results import finish
from experiments.run_options import RunOptions
from experiments.rundir import prepare_out, source, take_out
from experiments.runtime import Terminated
from experiments.tracking import init_wandb
from experiments.trainer import Trainer

__all__ = ["Model", "Tasks", "Results", "Fitted", "Experiment", "fit", "main"]


@dataclasses.dataclass(frozen=True)
class Model:
    """The network an experiment meta-trains, its per-task loss, and what the inner loop leaves alone."""

    module: nn.Module
    loss: Callable[[Tensor, Tensor], Tensor]  # (outputs, targets) of one task -> a scalar
    meta_only: Collection[str] = ()  # names of parameters that only the outer loop learns
    engine: Literal[peers.ENGINES] = "maml"  # type: ignore[valid-type]  # learn2learn: the peer computes the training steps


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


def fit(experiment: Experiment, argv: Sequence[str] | None = None) -> None:
    """Runs ``experiment`` with the command line ``argv`` (default: ``sys.argv[1:]``), from parsing to results.json.

    Under ``torchrun`` every process trains its share of each meta-batch; rank 0 alone writes, logs and tests.

    Raises:
        UsageError: bad flags, config file, device, data or ``--out`` (nothing is written then).
        SystemExit: 1 when training diverged (after one line); 130 or 143 when stopped by a signal.
    """
    _STAGE[:] = ["start-up"]
    cfg, opts = parse_args(
        experiment.name, experiment.config, argv, experiment.description, experiment.check, threads=experiment.threads
    )
    if experiment.resolve is not None:
        cfg = experiment.resolve(cfg)
    torchrun.check_shards(cfg.meta_batch, opts)
    if experiment.needs is not None:  # sizes whose tensors cannot fit: one line, before anything is written
        check_fits(experiment.needs(cfg, parameter_bytes(lambda: experiment.model(cfg).module)), opts.device)
    resumed = prepare_out(opts, cfg)  # before writing anything; a resume's code is checked against its start's
    # The code is recorded as the run starts: one changed and reverted before its end would pass for clean there.
    began = resumed["git_history"] if resumed else [{"at": "start", "iteration": 0, **source()}] if opts.main else []
    data = experiment.load(cfg) if experiment.load is not None else None
    if opts.main:
        take_out(opts, cfg)  # clears an --overwrite'n run's files, then writes config.yaml
        for note in experiment.notes(cfg, data) if experiment.notes is not None else ():
            print(note, file=sys.stderr)

    torch.manual_seed(cfg.seed)
    model = experiment.model(cfg)
    net = model.module.to(opts.device)
    learner = maml.MetaLearner(
        net,
        model.loss,
        inner_lr=cfg.inner_lr,
        steps=cfg.steps,
        mode=cfg.mode,
        batching=cfg.batching,
        learn_inner_lr=cfg.learn_inner_lr,
        compile=cfg.compile,
        adapt=recipes.adapt_set(net, cfg.adapt, model.meta_only),
        inner_optimizer=cfg.inner_optimizer,
        inner_optimizer_options={"betas": cfg.inner_adam_betas} if cfg.inner_optimizer == "adam" else None,
        implicit=maml.Implicit(cfg.implicit_lam, cfg.cg_iterations) if cfg.mode == "implicit" else None,
    )
    optimizer = recipes.meta_optimizer(learner, cfg.meta_lr, cfg.rate_meta_lr, cfg.meta_optimizer)
    trained = peers.Learn2LearnMAML(learner) if model.engine == "learn2learn" else learner
    reptile = cfg.mode == "reptile" and cfg.meta_optimizer == "sgd"  # the step towards the adapted weights
    watch = DivergenceWatch(trained, resumed["iteration"] if resumed else 0, cfg.meta_lr, cfg.inner_lr, reptile)
    tasks = experiment.tasks(cfg, data, opts.device)
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
    _STAGE[:] = ["training", str(opts.out)]
    # A NaN/Inf: one line naming the loop and the flag, exit code 1.
    with stop_on_divergence(opts.out, wandb_run, opts.main):
        trainer.run(opts, cfg, resumed, wandb_run)
    _STAGE[0] = "the final evaluation"
    if not opts.main:
        return  # rank 0 tests and writes the results
    with stop_on_divergence(opts.out, wandb_run):
        results = experiment.test(Fitted(cfg, opts, data, net, learner, trainer))
    finish(opts, cfg, wandb_run, trainer, results.test, results.metric, **results.extra)
    print(results.summary)


_STAGE: list[str] = ["start-up"]  # where fit() is, for the line a stop prints: [stage, --out once known]


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated  # SIGTERM outside the training loop unwinds as Ctrl-C does (atomic writes leave nothing half-done)


def _ending_line(lost: str | None = None) -> str:
    """What a stop (or the end of another process, ``lost`` naming gloo's reason) leaves, and what to run next."""
    stage, *out = _STAGE
    if stage == "start-up":
        if lost is None:
            return STARTING
        left = "before training, nothing to resume: run the same command again (once what ended it is fixed)."
    elif stage == "the final evaluation":
        left = f"training is complete in {out[0]}: the same command plus --resume evaluates it."
    elif (Path(out[0]) / "checkpoint.pt").is_file():  # a stop in training is at once: the last checkpoint is whole
        left = f"the last checkpoint in {out[0]} is whole: the same command plus --resume goes on."
    elif lost is None:
        return "stopped at once, before the first checkpoint: nothing to resume; run the same command again."
    elif torchrun.process_rank() == 0:
        left = "no checkpoint was written yet: run the same command again."
    else:  # rank 0 writes the checkpoints, maybe on a disk this machine does not see
        left = (
            f"rank 0 keeps the checkpoints in {out[0]} on its machine: the same command plus --resume goes on from "
            f"the last one (without --resume if there is none)."
        )
    if lost is None:
        return f"stopped {'at once' if stage == 'training' else 'during ' + stage}; {left}"
    return (
        f"error (rank {torchrun.process_rank()}): another process of this torchrun run ended during a collective "
        f"(gloo: {lost}); {left}"
    )


def _leaving() -> None:
    """Ignores Ctrl-C and SIGTERM from here on: this process is already ending (torchrun sends the survivors SIGTERM)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _exit_skipping_teardown(code: int) -> None:
    """Ends a torchrun process now: gloo's threads may still release a collective's tensors, and one that takes the
    GIL during the interpreter's teardown aborts a complete run (SIGABRT; pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(run: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Runs an experiment's entry point: a UsageError is one line and exit code 2, a stop one line and 130 or 143.

    Under torchrun it leaves the process group however the run ends: a collective that fails because another process
    ended is one line and exit code 1; the death of torchrun's launcher stops this process as SIGTERM does.
    """
    together: int | None = None  # the exit code of an end that every rank reaches at the same point
    lost: str | None = None  # gloo's reason, when another process ended during a collective
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        release_start_up_signals()  # Ctrl-C raises KeyboardInterrupt from here on
    sigterm = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        if main_thread and "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent, its parent
            torchrun.leave_with_launcher()  # (its SIGTERM, if the launcher is gone already, raises Terminated here)
        run(argv)
        together = 0
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) outside the training loop, or a second one in it
        lost = torchrun.peer_lost(e)  # torchrun's SIGTERM, come while a failed collective's error unwound
        if lost is None:
            print(f"\n{_ending_line()}", file=sys.stderr)
            raise SystemExit(143 if isinstance(e, Terminated) else 130) from None
        _leaving()
    except UsageError as e:
        # Under torchrun one process per machine says an error that all meet alike; one of its own, the process.
        if isinstance(e, torchrun.RankUsageError):
            print(f"error (rank {torchrun.process_rank()}): {e}", file=sys.stderr)
        elif torchrun.prints_usage_errors():
            print(f"error: {e}", file=sys.stderr)
        else:
            torchrun.outwait_printer()
        raise SystemExit(2) from None
    except RuntimeError as e:
        lost = torchrun.peer_lost(e)
        if lost is None:
            raise
        _leaving()
    except SystemExit as e:
        if e.code in (130, 143):  # the stop that every rank voted for after one iteration
            together = e.code
        raise
    finally:
        if main_thread and lost is None:
            signal.signal(signal.SIGTERM, sigterm)
        unlock_folders()  # a script run in a process that goes on (tests, notebooks)
        if dist.is_available() and dist.is_initialized():
            if together is not None:
                # Ranks > 0 finish before rank 0 (which evaluates and writes): they wait for it, so that
                # no rank tears down its gloo connections while another still uses them.
                try:
                    dist.barrier()
                except RuntimeError as e:
                    reason = torchrun.peer_lost(e)
                    if reason is None:
                        raise
                    _leaving()
                    if not (together == 0 and dist.get_rank() == 0):  # rank 0 wrote the results: nothing is lost
                        lost = reason
            if lost is not None:
                print(_ending_line(lost), file=sys.stderr)
            dist.destroy_process_group()
            if lost is not None or together is not None:
                _exit_skipping_teardown(1 if lost is not None else together)
    if lost is not None:  # (a collective's error comes from a process group: not reached)
        print(_ending_line(lost), file=sys.stderr)
        raise SystemExit(1)
