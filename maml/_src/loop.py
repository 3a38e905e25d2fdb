"""The inner loop, written once: every execution path runs :meth:`InnerLoop.run`.

One inner step is the support loss's gradient, then the update rule at the step's rates. The
paths differ only in how the support gradient is taken and in what they keep after each step,
which they hand to :meth:`InnerLoop.run` as two functions:

- the support gradient, ``support_grad(fast, step) -> (grads, losses)``:
  :func:`autograd_support_grad` (eager, checkpointed: ``torch.autograd.grad`` on the batched graph,
  ``create_graph=True`` for the exact meta-gradient) or :func:`func_support_grad` (compiled:
  ``torch.func.grad``, which ``torch.compile`` traces and differentiates again); the checkpointed
  path wraps them to record or restore each step's random-number state;
- what is kept, ``keep(step, fast, state) -> (fast, state)``: nothing (second order), the values
  without their graph (evaluation), or copies written into memory allocated before the step
  (the checkpointed forward pass).

Fast weights and the rule's state are dicts of ``(T, *param.shape)`` tensors: one slice per task.
This module also holds what a pass over a meta-batch returns (:class:`MetaOutput`) and the
meta-objective every path computes from its query losses (:func:`meta_objective`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .batch import TaskBatch
from .forward import Params, TaskForward
from .rates import InnerRates
from .rules import BoundRule, State

__all__ = [
    "Adapted",
    "InnerLoop",
    "MetaOutput",
    "Problem",
    "Support",
    "SupportGrad",
    "autograd_support_grad",
    "flatten_state",
    "func_support_grad",
    "meta_objective",
    "per_task",
    "query_step",
    "stacked",
    "unflatten_state",
]

# (fast (T, *shape), step) -> (each task's support-loss gradient in its slice, support losses (T,))
SupportGrad = Callable[[Params, int], tuple[Params, Tensor]]
# step -> (x (T, n, *x_shape), y (T, n, *y_shape)): the support set a step adapts on (TaskBatch.support_at)
Support = Callable[[int], tuple[Tensor, Tensor]]
# (fast weights after a step, step) -> (T,) query losses
Score = Callable[[Params, int], Tensor]
# (step, fast weights and state after it) -> what the loop goes on from
Keep = Callable[[int, Params, State], tuple[Params, State]]


class Adapted(NamedTuple):
    """What :meth:`InnerLoop.run` returns.

    Attributes:
        fast: ``(T, *shape)`` fast weights after the last step run.
        state: the rule's state after it.
        support_losses: one ``(T,)`` support loss per step, before the step.
        scores: one ``(T,)`` query loss after each step but the loop's last (with ``score``).
    """

    fast: Params
    state: State
    support_losses: list[Tensor]
    scores: list[Tensor]


@dataclasses.dataclass(frozen=True)
class InnerLoop:
    """The inner loop of a learner: forward pass, update rule, rates, finiteness check.

    Attributes:
        forward: the per-task forward pass.
        rule: the update rule, bound (its own tensors come from the rates' values).
        rates: the rates' layout; ``rates.at(values, step)`` gives a step's rates.
        check: ``check(losses (T,), step, steps)`` raises on a NaN/Inf support loss, or ``None``.
    """

    forward: TaskForward
    rule: BoundRule
    rates: InnerRates
    check: Callable[[Tensor, int, int], None] | None

    def run(
        self,
        support_grad: SupportGrad,
        fast: Params,
        state: State,
        rate_values: Params,
        steps: int,
        *,
        start: int = 0,
        stop: int | None = None,
        score: Score | None = None,
        keep: Keep | None = None,
    ) -> Adapted:
        """Inner steps ``start`` to ``stop - 1`` (default: all) of a loop of ``steps`` steps.

        Args:
            support_grad: how the support gradient is taken (see the module docstring).
            fast: ``(T, *shape)`` fast weights entering step ``start``.
            state: the rule's state entering it.
            rate_values: the learnable rates (see ``InnerRates``) and the rule's own tensors.
            steps: the loop's length: the check names it, and no score follows the last step.
            score: the query losses after each step but the last (MAML++'s multi-step loss).
            keep: what the path keeps of each step's result (see the module docstring).
        """
        support_losses: list[Tensor] = []
        scores: list[Tensor] = []
        for step in range(start, steps if stop is None else stop):
            grads, losses = support_grad(fast, step)
            rates = self.rates.at(rate_values, step)
            fast, state = self.rule.update(rate_values, grads, state, fast, step, rates, self.forward.unused(step))
            if self.check is not None:
                self.check(losses, step, steps)
            support_losses.append(losses)
            if score is not None and step < steps - 1:
                scores.append(score(fast, step))
            if keep is not None:
                fast, state = keep(step, fast, state)
        return Adapted(fast, state, support_losses, scores)

    def unchecked(self) -> InnerLoop:
        """The same loop without the finiteness check (replays, traced code: the check runs elsewhere)."""
        return dataclasses.replace(self, check=None)


def query_step(steps: int) -> int:
    """The step index of the query pass after the last of ``steps`` updates (0 when there is none)."""
    return max(steps - 1, 0)


def autograd_support_grad(forward: TaskForward, consts: Params, support: Support, *, create_graph: bool) -> SupportGrad:
    """The support gradient by ``torch.autograd.grad``; ``create_graph=False`` treats it as a constant (first order).

    ``support(step)`` gives the step's support set; the inner loss scores it. The fast weights must
    require grad. The returned losses are detached.
    """

    def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:
        losses, _ = forward(fast, consts, *support(step), step=step, inner=True)
        # The tasks' losses depend on disjoint slices of `fast`, so the gradient of their sum
        # holds every task's own gradient in its slice.
        grads = torch.autograd.grad(
            losses.sum(), tuple(fast.values()), create_graph=create_graph, allow_unused=True, materialize_grads=True
        )
        return dict(zip(fast, grads)), losses.detach()

    return support_grad


def func_support_grad(forward: TaskForward, consts: Params, support: Support, *, first_order: bool) -> SupportGrad:
    """The support gradient by ``torch.func.grad``, for traced code; ``first_order`` detaches it."""

    def support_loss(fast: Params, step: int) -> tuple[Tensor, Tensor]:
        losses, _ = forward(fast, consts, *support(step), step=step, inner=True)
        return losses.sum(), losses

    def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:
        grads, losses = torch.func.grad(support_loss, has_aux=True)(fast, step)
        if first_order:
            grads = {k: g.detach() for k, g in grads.items()}
        return grads, losses

    return support_grad


def per_task(params: Params, tasks: int) -> Params:
    """``(T, *shape)`` views of the initial parameters, one slice per task, through which the meta-gradient flows."""
    if tasks == 1:  # a view whose backward is a view too: expand's would sum over the task dimension, a kernel a tensor
        return {k: p.unsqueeze(0) for k, p in params.items()}
    return {k: p.unsqueeze(0).expand(tasks, *p.shape) for k, p in params.items()}


def stacked(losses: list[Tensor], tasks: int, like: Tensor) -> Tensor:
    """``(steps, T)`` from one ``(T,)`` loss per step; ``(0, T)`` for a loop of no steps."""
    return torch.stack(losses) if losses else like.new_zeros((0, tasks), dtype=torch.float32)


def meta_objective(query_losses: Tensor, per_step: Tensor | None, step_weights: Tensor | None) -> Tensor:
    """The meta-loss: the mean ``(T,)`` query loss, or MAML++'s ``step_weights``-weighted sum of each step's ``(steps, T)`` mean."""
    if step_weights is None:
        return query_losses.mean()
    assert per_step is not None
    return (step_weights * per_step.mean(1)).sum()


def flatten_state(state: State, names: tuple[str, ...]) -> list[Tensor]:
    """The rule's state as one list of tensors: every dict's tensors in ``names`` order."""
    return [d[n] for d in state for n in names]


def unflatten_state(values: list[Tensor] | tuple[Tensor, ...], names: tuple[str, ...]) -> State:
    """Inverse of :func:`flatten_state`."""
    n = len(names)
    return tuple(dict(zip(names, values[i : i + n])) for i in range(0, len(values), n))


class Problem(NamedTuple):
    """One call's inner problem, the arguments every path takes first (the compiled path after its step).

    Attributes:
        loop: the learner's inner loop.
        params: the adapted parameters' initial values (no task dimension).
        rate_values: the learnable rates and a rule's own tensors (see ``InnerRates``).
        consts: the other parameters and the buffers, shared by the tasks.
        batch: ``T`` tasks; the inner loop adapts on their support sets.
        steps: inner steps.
    """

    loop: InnerLoop
    params: Params
    rate_values: Params
    consts: Params
    batch: TaskBatch
    steps: int


@dataclasses.dataclass(frozen=True)
class MetaOutput:
    """Everything one pass over a meta-batch computes; every execution path returns one.

    Attributes:
        loss: ``()`` the meta-loss: the mean query loss over the tasks at their fast weights,
            or with ``step_weights`` the weighted sum of the means after each inner step;
            differentiable with respect to the meta-parameters.
        query_losses: ``(T,)`` each task's query loss after the last inner step (detached).
        query_out: ``(T, n_query, ...)`` the model's outputs on the query inputs at the fast
            weights (detached), e.g. logits for accuracy.
        support_losses: ``(steps, T)`` support loss before each inner step (detached); row
            0 is the loss before adaptation.
        fast: ``(T, *shape)`` per-task fast weights of the adapted parameters.
        step_query_losses: ``(steps, T)`` each task's query loss after each inner step
            (detached) when ``step_weights`` was given, else ``None``.
    """

    loss: Tensor
    query_losses: Tensor
    query_out: Tensor
    support_losses: Tensor
    fast: Params
    step_query_losses: Tensor | None = None

    @classmethod
    def of(
        cls,
        query_losses: Tensor,
        query_out: Tensor,
        support_losses: Tensor,
        fast: Params,
        per_step: Tensor | None,
        step_weights: Tensor | None,
    ) -> MetaOutput:
        """The output of a path that kept the graph: the meta-objective of differentiable ``(T,)`` query losses."""
        return cls(
            loss=meta_objective(query_losses, per_step, step_weights),
            query_losses=query_losses.detach(),
            query_out=query_out.detach(),
            support_losses=support_losses,
            fast=fast,
            step_query_losses=None if per_step is None else per_step.detach(),
        )

    @classmethod
    def joined(cls, outputs: list[MetaOutput], loss: Tensor, fast: Params) -> MetaOutput:
        """Chunks' outputs as one over all their tasks (detached), with the meta-loss ``loss`` and the fast weights
        ``fast``, joined as the chunks ran (``chunked.py``: a chunk's own go before the next runs)."""

        def cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
            return torch.cat(tensors, dim).detach()

        steps = [o.step_query_losses for o in outputs]
        return cls(
            loss=loss,
            query_losses=cat([o.query_losses for o in outputs]),
            query_out=cat([o.query_out for o in outputs]),
            support_losses=cat([o.support_losses for o in outputs], dim=1),
            fast=fast,
            step_query_losses=None if steps[0] is None else cat(steps, dim=1),  # type: ignore[arg-type]
        )
