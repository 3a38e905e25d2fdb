"""The meta-training loop (:class:`Trainer`): resumable bit for bit, sharded under torchrun, stopped cleanly by
signals; it logs through :class:`~experiments.harness.report.Logbook`."""

from __future__ import annotations

import dataclasses
import io
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

import maml
from experiments.harness.config import RunOptions
from experiments.harness.failures import DivergenceWatch
from experiments.harness.folder import BEST_FILE, METRICS_FILE, atomic_write, exit_code
from experiments.harness.lifecycle import catch_stop_signals
from experiments.harness.recipes import Schedule
from experiments.harness.report import Logbook, finish_wandb
from experiments.harness.rundir import DATA_KEYS, data_identity
from maml import TaskBatch

__all__ = ["Trainer", "write_state"]


@dataclasses.dataclass
class Trainer:
    """The meta-training loop shared by the experiments: resumable, bit for bit.

    Everything a step depends on (model, optimizer, rates, the sampler's generator, the global RNG,
    the iteration) is in the atomically written checkpoint, so a run killed at any point and
    resumed ends with exactly the parameters of an uninterrupted run. Under ``torchrun`` every
    process samples the full meta-batch from the same generator, adapts its share
    (``maml.shard``) and all-reduces the meta-gradients before the same step: the trajectory does
    not depend on the number of processes. Rank 0 alone validates, logs and writes.

    Attributes:
        sample: ``sample(generator) -> TaskBatch``, one meta-batch of training tasks.
        metrics, val_metrics: ``(output, batch) -> dict`` of training (means over this rank's tasks,
            taken at every iteration and logged, as the meta-loss is, as their means over the iterations
            since the last log row and over the ranks) and validation metrics.
        val_batch: the fixed validation tasks (None: no validation).
        watch: explains a NaN/Inf (:class:`~experiments.harness.failures.DivergenceWatch`).
        select: ``(metric, "max" | "min")``: each validation that beats every earlier one on ``metric`` writes the
            learner's state to ``best.pt``; ``best`` holds it (``{"iteration": i, **metrics}``).
    """

    learner: maml.MetaLearner
    optimizer: torch.optim.Optimizer
    sample: Callable[[torch.Generator], maml.TaskBatch]
    metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]
    val_batch: maml.TaskBatch | None
    val_metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]
    watch: DivergenceWatch
    iterations: int
    log_every: int
    val_every: int
    checkpoint_every: int
    seed: int
    device: torch.device
    schedule: Schedule | None = None  # per-iteration meta-lr, derivative order and step weights (recipes)
    select: tuple[str, Literal["max", "min"]] | None = None
    backward_chunk: int | None = None  # tasks per backward pass (learner.backward); None: meta_loss().backward()
    clip_value: float | None = None  # each meta-gradient entry clamped to [-clip_value, clip_value] before the step
    best: dict[str, float] = dataclasses.field(default_factory=dict)
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # Meta-losses, step time and the script's training metrics since the last log row: checkpointed, so a resumed
    # run logs the same rows.
    window: list[float] = dataclasses.field(default_factory=list)
    step_time: float = 0.0
    metric_window: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    train_seconds: float = 0.0  # wall time of the training loop, summed over resumed runs
    final_val: dict[str, float] = dataclasses.field(default_factory=dict)  # validation at the last iteration
    _began: float = dataclasses.field(default=0.0, repr=False)
    data_files: dict[str, dict[str, str | None]] = dataclasses.field(default_factory=dict, repr=False)
    # The code at the run's start and at each resume (rundir.source), kept from the start: a resume checks it.
    git_history: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)

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
            "window": (self.window, self.step_time, self.metric_window),
            "train_seconds": self.train_seconds + time.perf_counter() - self._began,
            "wandb_id": wandb_id,
            "data": self.data_files,
            "git_history": self.git_history,
            "best": self.best,
        }

    def run(self, opts: RunOptions, cfg: Any, resumed: dict[str, Any] | None, run: Any) -> None:
        """Trains from iteration 0 or from ``resumed`` up to ``iterations``, then sets ``final_val``.

        The last iteration is always logged and validated. A checkpoint at or past ``iterations`` (a
        run shortened on ``--resume``) trains nothing: the run evaluates the checkpoint's parameters.
        """
        from tqdm import tqdm

        generator = torch.Generator().manual_seed(self.seed)
        start = self._restore(resumed, generator, opts.main)
        wandb_id = getattr(run, "id", None)
        log = None
        if opts.main:
            # Where the data is and what files it holds, for the checkpoints: --resume then accepts the
            # same files under another path (computed once: a folder of images has thousands of files).
            self.data_files = {k: data_identity(v) for k in DATA_KEYS if isinstance(v := getattr(cfg, k, None), str)}
            log = Logbook.open(opts.out / METRICS_FILE, self.history, run, start)

        # Ctrl-C and SIGTERM stop the run after this iteration, with a consistent checkpoint; a second Ctrl-C, or an
        # iteration that outlasts the patience, stops at once (the last checkpoint stays valid).
        stop, restore_signals = catch_stop_signals(opts.main)
        self._began = time.perf_counter()
        bar = tqdm(
            range(start, self.iterations),
            initial=start,
            total=self.iterations,
            desc="meta-train",
            dynamic_ncols=True,
            mininterval=0.5,
            disable=None if opts.main else True,
        )
        try:
            for iteration in bar:
                stopping, row = self._iteration(iteration, generator, stop, opts, log)
                if row is not None:
                    bar.set_postfix(meta_loss=f"{row['train/meta_loss']:.4f}")
                last = iteration + 1 == self.iterations
                if stopping:
                    restore_signals()  # the stop is honoured: no timer interrupts its checkpoint
                if opts.main and (stopping or (iteration + 1) % self.checkpoint_every == 0 or last):
                    write_state(opts.out / "checkpoint.pt", self.state(iteration + 1, generator, cfg, wandb_id))
                if stopping:
                    bar.close()
                    if opts.main:
                        finish_wandb(run)
                        print(
                            f"\nstopped after iteration {iteration + 1}; continue with the same command plus --resume",
                            file=sys.stderr,
                        )
                    # A rank stopped by another's signal exits as if it had received SIGTERM.
                    raise SystemExit(exit_code(stop[0] if stop else signal.SIGTERM))
        finally:
            restore_signals()
            bar.close()
            if log is not None:
                log.close()
        self.train_seconds += time.perf_counter() - self._began
        # The validation of the last iteration: logged with it, or (a run that trained nothing,
        # stopped past its last log row) of the checkpoint's parameters now.
        last_row = self.history[-1] if self.history else {}
        self.final_val = {k: v for k, v in last_row.items() if k.startswith("val/")}
        if opts.main and (last_row.get("iteration") != self.iterations or not self.final_val):
            self.final_val = self.validate()

    def _restore(self, resumed: dict[str, Any] | None, generator: torch.Generator, main: bool) -> int:
        """Loads a checkpoint's state (``resumed``) into the learner, optimizer, generators and logs; the iteration to start at."""
        if resumed is None:
            return 0
        self.learner.load_state_dict(resumed["learner"])
        self.optimizer.load_state_dict(resumed["optimizer"])
        generator.set_state(resumed["generator"])
        torch.set_rng_state(resumed["torch_rng"])
        if resumed["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(resumed["cuda_rng"])
        self.history = resumed["history"]
        # A checkpoint written before the training metrics were windowed keeps the meta-losses and the time alone.
        self.window, self.step_time, *metrics = resumed["window"]
        self.metric_window = metrics[0] if metrics else {}
        self.train_seconds = resumed["train_seconds"]
        self.best = resumed.get("best", {})
        start = resumed["iteration"]
        if start >= self.iterations:
            if main:
                print(
                    f"the checkpoint is at iteration {start}, at or past --iterations {self.iterations}: no "
                    f"training; evaluating its parameters",
                    file=sys.stderr,
                )
            self.iterations = start
        return start

    def _iteration(
        self, iteration: int, generator: torch.Generator, stop: list[int], opts: RunOptions, log: Logbook | None
    ) -> tuple[bool, dict[str, float] | None]:
        """One meta-training step: whether a stop signal ends the run after it, and its log row when one was due."""
        sharded = opts.world_size > 1
        # The full meta-batch on every rank, whatever their number: the same trajectory.
        batch = maml.shard(self.sample(generator)).to(self.device)
        t0 = time.perf_counter()
        weights = None if self.schedule is None else self.schedule.apply(iteration, self.learner, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.backward_chunk is None and getattr(self.learner, "memory_budget", None) is None:
            out = self.run_batch(batch, step_weights=weights)
            out.loss.backward()
        else:  # learner.backward: the same .grad, one chunk (given, or what the memory budget fits) at a time
            out = self.run_batch(batch, step_weights=weights, backward=True, chunk=self.backward_chunk)
        if sharded:
            # One all-reduce carries the meta-gradients, the meta-loss and whether a rank was signalled: all
            # ranks stop after the same iteration on the shared vote (none left in a collective).
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
        if self.clip_value is not None:  # after the all-reduce: every rank clips the same whole meta-gradient
            torch.nn.utils.clip_grad_value_(self.learner.parameters(), self.clip_value)
        self.optimizer.step()
        self.watch.check_step(self.optimizer)  # a NaN/Inf meta-parameter: Diverged, before the checkpoint
        self.step_time += time.perf_counter() - t0
        self.window.append(loss)
        for key, value in self.metrics(out, batch).items():
            self.metric_window.setdefault(key, []).append(value)
        if logging:
            row = self._row(iteration + 1, out, batch, grad_norm, sharded)
            if opts.main and ((iteration + 1) % self.val_every == 0 or last):
                validation = self.validate()
                row.update(validation)
                self._keep_if_best(opts.out, iteration + 1, validation)
            self.history.append(row)
            if log is not None:
                log.write(row, self.iterations)
            self.window, self.step_time, self.metric_window = [], 0.0, {}
            return stopping, row
        return stopping, None

    def _row(
        self, iteration: int, out: maml.MetaOutput, batch: maml.TaskBatch, grad_norm: float, sharded: bool
    ) -> dict[str, float]:
        """The training part of a log row: the window's means (the meta-loss, the step time and the script's metrics),
        and the inner losses and rates of this iteration."""
        inner = self._inner_losses(out, batch)
        metrics = {key: sum(values) / len(values) for key, values in self.metric_window.items()}
        row = {
            "iteration": iteration,
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
        return row

    def run_batch(
        self, batch: TaskBatch, phase: str | None = None, backward: bool = False, chunk: int | None = None, **kw: Any
    ) -> maml.MetaOutput:
        """``learner.run``, or ``learner.backward`` ``chunk`` tasks at a time (None: planned); a NaN/Inf: Diverged, explained.
        ``phase``: None in training (the watch keeps the losses), else ``"the validation"`` or ``"the final test"``."""
        try:
            if not backward:
                out = self.learner.run(batch, **kw)
            else:
                out = self.learner.backward(batch, chunk=chunk, return_output=True, **kw)
        except FloatingPointError:  # the engine's check: an inner loss is NaN/Inf
            raise self.watch.diverged(batch, phase, kw.get("steps")) from None
        if phase is None:
            self.watch.record(out)
        return out

    def validate(self) -> dict[str, float]:
        """The validation metrics of the learner now, on its fixed tasks; {} without them."""
        if self.val_batch is None:
            return {}
        with torch.no_grad():
            return self.val_metrics(self.run_batch(self.val_batch, "the validation"), self.val_batch)

    def _keep_if_best(self, out: Path, iteration: int, validation: dict[str, float]) -> None:
        """Writes ``best.pt`` when ``validation`` beats every earlier validation (ties keep the earlier)."""
        if self.select is None or self.select[0] not in validation:
            return
        metric, goal = self.select
        value, best = validation[metric], self.best.get(metric)
        if best is not None and not (value > best if goal == "max" else value < best):
            return
        self.best = {"iteration": iteration, **validation}
        write_state(
            out / BEST_FILE, {"iteration": iteration, "validation": validation, "learner": self.learner.state_dict()}
        )

    def results(self) -> dict[str, Any]:
        """What ``results.json`` keeps of the training (:func:`~experiments.harness.report.finish`)."""
        plan = getattr(self.learner, "plan", None)  # the memory plan the engine chose, if any
        return {
            "final_val": self.final_val,
            "best_val": self.best,
            "iterations": self.iterations,
            "train_seconds": round(self.train_seconds, 1),
            "train_metrics": "log window mean",  # the training metrics of metrics.jsonl (earlier runs: one batch's)
            **({"memory_plan": str(plan)} if plan is not None else {}),
            "git_history": self.git_history,  # the code at the start and at each resume; at the end: provenance()
        }

    def _inner_losses(self, out: maml.MetaOutput, batch: maml.TaskBatch) -> dict[str, float]:
        row = {"train/query_loss": float(out.query_losses.mean())}
        if out.support_losses.shape[0]:
            with torch.no_grad():
                after, _ = self.learner.task_losses(out.fast, batch.support_x, batch.support_y)
            row["train/support_loss_before"] = float(out.support_losses[0].mean())
            row["train/support_loss_after"] = float(after.mean())
        return row

    def _rates(self) -> dict[str, float]:  # the learned inner rates, each a mean
        return {f"inner_lr/{k}": float(v.detach().mean()) for k, v in self.learner.rate_parameters.items()}


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Saves ``state`` (``torch.save``) to ``path`` atomically; through memory, as torch.save to a path turns a full
    disk into a bare RuntimeError where Python's file I/O raises the OSError that atomic_write reports."""
    data = io.BytesIO()
    torch.save(state, data)
    atomic_write(path, lambda p: p.write_bytes(data.getbuffer()))
