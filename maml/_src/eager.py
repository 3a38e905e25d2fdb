"""The eager path: second order, first order, and evaluation without a graph.

Second order keeps every inner step's graph (``create_graph=True``) and lets ``backward()``
differentiate through all of it; first order takes the inner gradients as constants.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TaskBatch
from .forward import Params
from .loop import InnerLoop, MetaOutput, autograd_support_grad, per_task, query_step, stacked
from .rules import State

__all__ = ["adapt", "run"]


def _values(step: int, fast: Params, state: State) -> tuple[Params, State]:
    """Evaluation keeps each step's values, not its graph: the next step starts from fresh leaves."""
    return {k: v.detach().requires_grad_() for k, v in fast.items()}, tuple(
        {k: v.detach() for k, v in s.items()} for s in state
    )


def adapt(
    loop: InnerLoop,
    params: Params,
    rate_values: Params,
    consts: Params,
    x: Tensor,
    y: Tensor,
    steps: int,
    *,
    first_order: bool,
    query: tuple[Tensor, Tensor] | None = None,
) -> tuple[Params, Tensor, list[Tensor]]:
    """Runs the inner loop on ``T`` tasks.

    Under ``torch.no_grad()`` it computes the same values without keeping a graph (evaluation).

    Args:
        loop: the learner's inner loop.
        params: the adapted parameters' initial values (no task dimension).
        rate_values: the learnable rates (see ``InnerRates``).
        consts: shared parameters and buffers.
        x: ``(T, n, *x_shape)`` support inputs.
        y: ``(T, n, *y_shape)`` support targets.
        steps: inner steps.
        first_order: take the inner gradients as constants.
        query: ``(query_x, query_y)`` to score after every step but the last (the multi-step loss).

    Returns:
        The fast weights ``(T, *shape)``, the ``(steps, T)`` support losses, and the ``(T,)``
        query losses after each step but the last (empty without ``query``).
    """
    tasks = x.shape[0]
    differentiable = torch.is_grad_enabled()
    with torch.enable_grad():  # the inner loop needs gradients even under torch.no_grad()
        fast = per_task(params, tasks)
        if not differentiable:
            # Evaluation: no meta-gradient wanted, so the same values without a graph to keep.
            fast = {k: v.detach().requires_grad_() for k, v in fast.items()}
            rate_values = {k: v.detach() for k, v in rate_values.items()}
            consts = {k: v.detach() for k, v in consts.items()}
            first_order = True
        support_grad = autograd_support_grad(loop.forward, consts, x, y, create_graph=not first_order)
        score = None if query is None else (lambda fast, step: loop.forward(fast, consts, *query, step=step)[0])
        done = loop.run(
            support_grad,
            fast,
            loop.rule.init(fast),
            rate_values,
            steps,
            score=score,
            keep=None if differentiable else _values,
        )
    fast = done.fast if differentiable else {k: v.detach() for k, v in done.fast.items()}
    return fast, stacked(done.support_losses, tasks, x), done.scores


def run(
    loop: InnerLoop,
    params: Params,
    rate_values: Params,
    consts: Params,
    batch: TaskBatch,
    steps: int,
    *,
    first_order: bool,
    step_weights: Tensor | None,
) -> MetaOutput:
    """Adapts to every task of ``batch`` and scores the fast weights on its query set."""
    query = (batch.query_x, batch.query_y)
    every_step = step_weights is not None
    fast, support, step_query = adapt(
        loop,
        params,
        rate_values,
        consts,
        batch.support_x,
        batch.support_y,
        steps,
        first_order=first_order,
        query=query if every_step else None,
    )
    query_losses, query_out = loop.forward(fast, consts, *query, step=query_step(steps))
    per_step = torch.stack([*step_query, query_losses]) if every_step else None
    return MetaOutput.of(query_losses, query_out, support, fast, per_step, step_weights)
