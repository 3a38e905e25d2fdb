"""One inner step, the engine's core: the support loss's gradient, then the update rule.

Every execution path (eager, checkpointed, compiled) runs :func:`inner_step`; they differ only
in how the support gradient is taken, which :func:`autograd_support_grad` and
:func:`func_support_grad` build:

- eager and checkpointed: ``torch.autograd.grad`` on the batched graph, with
  ``create_graph=True`` for the exact meta-gradient or without it for first order;
- compiled: ``torch.func.grad``, which ``torch.compile`` can trace and differentiate again.

Fast weights and the rule's state are dicts of ``(T, *param.shape)`` tensors: one slice per task.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .inner import Params, TaskForward
from .rules import State, StepRates, UpdateRule

__all__ = ["SupportGrad", "autograd_support_grad", "func_support_grad", "inner_step"]

# fast (T, *shape) -> (gradient of each task's support loss in its slice, support losses (T,))
SupportGrad = Callable[[Params], tuple[Params, Tensor]]


def autograd_support_grad(forward: TaskForward, consts: Params, x: Tensor, y: Tensor, *, create_graph: bool) -> SupportGrad:
    """The support gradient by ``torch.autograd.grad``; ``create_graph=False`` treats it as a constant (first order).

    The fast weights must require grad. The returned losses are detached.
    """

    def support_grad(fast: Params) -> tuple[Params, Tensor]:
        losses, _ = forward(fast, consts, x, y)
        # The tasks' losses depend on disjoint slices of `fast`, so the gradient of their sum
        # holds every task's own gradient in its slice.
        grads = torch.autograd.grad(
            losses.sum(), tuple(fast.values()), create_graph=create_graph, allow_unused=True, materialize_grads=True
        )
        return dict(zip(fast, grads)), losses.detach()

    return support_grad


def func_support_grad(forward: TaskForward, consts: Params, x: Tensor, y: Tensor, *, first_order: bool) -> SupportGrad:
    """The support gradient by ``torch.func.grad``, for traced code; ``first_order`` detaches it."""

    def support_loss(fast: Params) -> tuple[Tensor, Tensor]:
        losses, _ = forward(fast, consts, x, y)
        return losses.sum(), losses

    def support_grad(fast: Params) -> tuple[Params, Tensor]:
        grads, losses = torch.func.grad(support_loss, has_aux=True)(fast)
        if first_order:
            grads = {k: g.detach() for k, g in grads.items()}
        return grads, losses

    return support_grad


def inner_step(
    support_grad: SupportGrad, rule: UpdateRule, fast: Params, state: State, rates: StepRates, step: int
) -> tuple[Params, State, Tensor]:
    """One inner step on every task.

    Args:
        support_grad: the support gradient at ``fast`` (see the builders above).
        rule: the update rule.
        fast: ``(T, *shape)`` adapted parameters.
        state: the rule's state, ``(T, *shape)`` tensors.
        rates: each adapted parameter's rate at this step (see ``InnerRates.at``).
        step: the inner step's index, 0-based.

    Returns:
        The new fast weights, the new state and the ``(T,)`` support losses before the step.
    """
    grads, losses = support_grad(fast)
    fast, state = rule.update(grads, state, fast, step, rates)
    return fast, state, losses
