"""What stops a run early, each in one line that names the flags to change: a size whose tensors cannot fit this
machine (:func:`check_fits`, before anything is written; exit code 2), an allocation that fails all the same
(:func:`out_of_memory`: PyTorch's error, caught where it happens), and a divergence (NaN/Inf) of the outer loop
(lower ``--meta-lr``) or the inner loop (lower ``--inner-lr``).

The trainer asks :class:`DivergenceWatch` when the engine's check stops ``learner.run`` (an inner
loss is NaN/Inf) and after each optimizer step; either way the run ends with :class:`Diverged`,
which :func:`stop_on_failure` turns into one line on stderr and exit code 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import maml
from experiments.harness.folder import EXIT_FAILED, UsageError
from experiments.harness.report import finish_wandb

__all__ = ["Need", "parameter_bytes", "free_bytes", "check_fits", "FLOAT_BYTES", "plan_memory"]
__all__ += ["Diverged", "DivergenceWatch", "out_of_memory", "stop_on_failure"]


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


def plan_memory(learner: maml.MetaLearner, batch: maml.TaskBatch, flag: str, out: Path, needs: Sequence[Need]) -> Any:
    """The learner's plan of a training step on ``batch`` within ``--memory-budget`` (``flag``), before anything is
    written: a budget too small is a UsageError naming the smallest that runs; an allocation refused while the
    planner measures is the out-of-memory line of :func:`stop_on_failure`, as in training."""
    try:
        with stop_on_failure(out, None, needs):
            return learner.plan_for(batch, return_output=True)  # the trainer's backward keeps its outputs
    except ValueError as e:
        raise UsageError(f"--memory-budget {flag}: {e}") from None


# ---------------------------------------------------------------------- divergence


class Diverged(Exception):
    """Training produced NaN/Inf; the message names the meta-iteration, the loop that diverged and the flag."""


class DivergenceWatch:
    """Tells an outer-loop divergence from an inner-loop one and stops the run before it is checkpointed.

    Outer (lower ``--meta-lr``): a step made a meta-parameter NaN/Inf from a finite meta-gradient,
    or the meta-parameters' own loss (before any inner step) is NaN/Inf or grew ``GROWTH``-fold
    since this process's first iteration. Inner (lower ``--inner-lr``): a loss after inner steps, or
    the meta-gradient through them, is NaN/Inf while the meta-parameters are finite and have not
    run away. A NaN/Inf loss or meta-gradient makes the meta-parameters NaN/Inf too, so
    :meth:`check_step` (one synchronisation per iteration) catches every case before a checkpoint.

    Reptile's SGD meta-step, ``theta += meta_lr (phi - theta)``, at a meta-lr of at most 1 stops at
    the adapted weights ``phi``: meta-parameters that ran away were led there by the inner loop.

    Args:
        learner: the one the trainer runs.
        iteration: meta-iterations already done (the resumed checkpoint's, else 0).
        meta_lr, inner_lr: the values to name in the messages.
        reptile: whether the outer step is Reptile's SGD step (``--mode reptile --meta-optimizer sgd``).
    """

    GROWTH = 100.0

    def __init__(
        self, learner: maml.MetaLearner, iteration: int, meta_lr: float, inner_lr: float, reptile: bool = False
    ) -> None:
        self.learner, self.iteration, self.meta_lr, self.inner_lr = learner, iteration, meta_lr, inner_lr
        self.reptile = reptile
        self._names = {id(p): n for n, p in learner.model.named_parameters()}
        self._names.update({id(p): f"the inner rate {n}" for n, p in learner.rate_parameters.items()})
        if isinstance(learner.rule, nn.Module):  # the inner optimizer's learned options
            self._names.update({id(p): f"the inner optimizer's {n}" for n, p in learner.rule.named_parameters()})
        self._first: float | None = None  # the mean own loss at this process's first training iteration
        # The latest training iteration's meta-loss, support losses (steps, T) and query losses (T,), detached.
        self._losses: tuple[Tensor, Tensor, Tensor] | None = None

    def record(self, out: maml.MetaOutput) -> None:
        """Keeps the losses of a training iteration's ``learner.run``, for :meth:`check_step`."""
        self._losses = (out.loss.detach(), out.support_losses.detach(), out.query_losses.detach())
        if self._first is None:  # one synchronisation, at the first iteration only
            self._first = float(self._own(out.support_losses, out.query_losses).mean())

    def diverged(self, batch: maml.TaskBatch, phase: str | None = None, steps: int | None = None) -> Diverged:
        """Why ``learner.run(batch, steps=steps)`` stopped at the engine's NaN/Inf check; ``phase``: None in training,
        else what ran after the iteration (``"the validation"``, ``"the final test"``)."""
        where = (
            f"meta-iteration {self.iteration + 1}"
            if phase is None
            else f"{phase} after meta-iteration {self.iteration}"
        )
        return Diverged(self._explain(where, batch, steps))

    @staticmethod
    def _own(support: Tensor, query: Tensor) -> Tensor:
        """Each task's own loss: at the meta-parameters, before any inner step."""
        return support[0] if support.shape[0] else query

    def _explain(self, where: str, batch: maml.TaskBatch, steps: int | None) -> str:
        """Runs ``batch`` again, one more inner step at a time, to find the loss, the step and the task that diverged.

        The support loss before step ``k`` is the query loss after ``k`` steps of a batch whose query set is its
        support set; the runs before the first NaN/Inf one pass the engine's check.
        """
        steps = self.learner.steps if steps is None else steps
        on_support = maml.TaskBatch(batch.support_x, batch.support_y, batch.support_x, batch.support_y)
        losses: list[Tensor] = []
        with torch.no_grad():
            for k in range(steps):
                losses.append(self.learner.run(on_support, steps=k).query_losses)
                if not bool(torch.isfinite(losses[-1]).all()):
                    break
            else:
                losses.append(self.learner.run(batch, steps=steps).query_losses)
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
            return self._outer(
                f"by {where}",
                f"the meta-parameters are finite, but their own {what} (before any inner step) is {value} for task "
                f"{task}",
            )
        after = f"the {what} of task {task} is {value} after {step} inner step{'s' if step != 1 else ''}"
        if self._ran_away(own):
            return self._outer(f"by {where}", f"{self._ran_away(own)}, and from there {after}")
        return (
            f"the inner loop diverged at {where}: {after}, from a support loss of {before:.4g} at the "
            f"meta-parameters; lower --inner-lr {self.inner_lr:g}{self._rates()}"
        )

    def _gradient(self, where: str, own: float) -> str:
        """The message for a NaN/Inf meta-gradient of finite losses."""
        if self._ran_away(own):
            return self._outer(f"by {where}", f"{self._ran_away(own)}, and the meta-gradient there is NaN/Inf")
        return (
            f"the inner loop diverged at {where}: the meta-gradient through its inner steps is NaN/Inf though "
            f"its losses are finite (the second-order terms overflowed); lower --inner-lr {self.inner_lr:g}"
            f"{self._rates()}"
        )

    def _outer(self, at: str, why: str, fix: str | None = None) -> str:
        """The message for meta-parameters that diverged ``at`` (``"by meta-iteration 7"``) for the reason ``why``:
        the outer loop's (``fix``: lower --meta-lr), or under Reptile's step at a meta-lr <= 1 the inner loop's."""
        if not self.reptile:
            return f"the outer loop diverged {at}: {why}; {fix or f'lower --meta-lr {self.meta_lr:g}'}"
        if self.meta_lr > 1:  # the step overshoots the adapted weights: 1 is a value below the user's
            return (
                f"the outer loop diverged {at}: {why}; lower --meta-lr {self.meta_lr:g} to at most 1, where "
                f"Reptile's meta-step stops at the adapted weights instead of overshooting them"
            )
        steps = f" or --steps {self.learner.steps}" if self.learner.steps > 1 else ""  # 1 step cannot be lowered
        return (
            f"the inner loop diverged {at}: {why}; Reptile's meta-step at --meta-lr {self.meta_lr:g} (at most 1) "
            f"only moves the meta-parameters towards the weights the inner steps adapt, so those ran away: lower "
            f"--inner-lr {self.inner_lr:g}{steps}"
        )

    def _ran_away(self, own: float) -> str:
        """How the outer updates raised the meta-parameters' own loss, if they did ``GROWTH``-fold; else ''."""
        if self._first is None or not math.isfinite(own) or not own > self.GROWTH * self._first:
            return ""
        # Under Reptile's step the outer loop may not be to blame (_outer): "its" would name the loop blamed.
        who = "the meta-steps" if self.reptile else "its updates"
        return f"{who} raised the meta-parameters' own loss (before any inner step) from {self._first:.4g} to {own:.4g}"

    def _rates(self) -> str:
        if not self.learner.rate_parameters:
            return ""
        top = max(float(r.detach().abs().max()) for r in self.learner.rate_parameters.values())
        return f" (the learned inner rates, which --meta-lr moves, reach {top:.3g})"

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``: counts the iteration, or raises Diverged if a meta-parameter is NaN/Inf."""
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
        what = (
            f"made {self._names.get(id(bad[0]), 'a meta-parameter')} NaN/Inf"
            if bad
            else "overflowed the meta-parameters"
        )
        raise Diverged(
            self._outer(
                f"at {where}",
                f"its optimizer step with --meta-lr {self.meta_lr:g} {what} from a finite meta-gradient",
                "lower --meta-lr",
            )
        )


def out_of_memory(error: BaseException) -> str | None:
    """What an allocation that failed asked for, in PyTorch's words (CPU or GPU); None for any other error."""
    text = str(error)  # the CPU's: "DefaultCPUAllocator: can't allocate memory" (or "not enough memory")
    if not isinstance(error, torch.OutOfMemoryError) and not (
        isinstance(error, RuntimeError) and re.search("DefaultCPUAllocator|out of memory", text)
    ):
        return None
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?\w+)", text)
    return asked.group(1) if asked else "memory"


@contextlib.contextmanager
def stop_on_failure(out: Path, run: Any, needs: Sequence[Need] = (), main: bool = True) -> Iterator[None]:
    """Turns a divergence, or an allocation that fails, inside the block into one line on stderr and exit code 1,
    naming the last checkpoint (only finite meta-parameters are checkpointed) and, for memory, the size flags of
    ``needs``; the wandb ``run`` (None on ranks > 0) is marked failed."""
    try:
        yield
    except (Diverged, RuntimeError) as e:
        asked = None if isinstance(e, Diverged) else out_of_memory(e)
        if asked is None and not isinstance(e, Diverged):
            raise
        if run is not None:
            finish_wandb(run, exit_code=1)
        if main:
            path = out / "checkpoint.pt"
            try:  # this run's (--overwrite removed an earlier run's before it started)
                kept = f"{path} keeps meta-iteration {torch.load(path, map_location='cpu', weights_only=False)['iteration']}"
            except Exception:  # none, or unreadable: say no more than that
                kept = "no checkpoint was written"
            what = str(e)
            if asked is not None:
                sizes = ", ".join(dict.fromkeys(f for need in needs for f in need.flags.split(", "))) or "the sizes"
                what = f"out of memory: an allocation of {asked} failed; lower {sizes}, or set --memory-budget"
            print(f"error: {what}. The run stopped; {kept}.", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None
