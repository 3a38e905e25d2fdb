"""The eager path: second order, first order, and evaluation without a graph.

Second order keeps every inner step's graph (``create_graph=True``) and lets ``backward()``
differentiate through all of it; first order takes the inner gradients as constants.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import TaskBatch
from .inner import Params
from .loop import InnerLoop, Trace
from .step import autograd_support_grad, inner_step

__all__ = ["adapt", "run"]


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
        fast = {k: p.unsqueeze(0).expand(tasks, *p.shape) for k, p in params.items()}
        if not differentiable:
            # Evaluation: no meta-gradient wanted, so the same values without a graph to keep.
            fast = {k: v.detach().requires_grad_() for k, v in fast.items()}
            rate_values = {k: v.detach() for k, v in rate_values.items()}
            consts = {k: v.detach() for k, v in consts.items()}
            first_order = True
        state = loop.rule.init(fast)
        support_losses, step_query = [], []
        for step in range(steps):
            support_grad = autograd_support_grad(loop.forward, consts, x, y, create_graph=not first_order)
            fast, state, losses = inner_step(support_grad, loop.rule, fast, state, loop.rates.at(rate_values, step), step)
            if loop.check is not None:
                loop.check(losses, step, steps)
            support_losses.append(losses)
            if query is not None and step < steps - 1:
                step_query.append(loop.forward(fast, consts, *query)[0])
            if not differentiable:
                fast = {k: v.detach().requires_grad_() for k, v in fast.items()}
                state = tuple({k: v.detach() for k, v in s.items()} for s in state)
    if not differentiable:
        fast = {k: v.detach() for k, v in fast.items()}
    support = torch.stack(support_losses) if support_losses else x.new_zeros((0, tasks), dtype=torch.float32)
    return fast, support, step_query


def run(
    loop: InnerLoop,
    params: Params,
    rate_values: Params,
    consts: Params,
    batch: TaskBatch,
    steps: int,
    *,
    first_order: bool,
    every_step: bool,
) -> Trace:
    """Adapts to every task of ``batch`` and scores the fast weights on its query set."""
    query = (batch.query_x, batch.query_y)
    fast, support, step_query = adapt(
        loop, params, rate_values, consts, batch.support_x, batch.support_y, steps,
        first_order=first_order, query=query if every_step else None,
    )  # fmt: skip
    query_losses, query_out = loop.forward(fast, consts, *query)
    return Trace(
        query_losses=query_losses,
        query_out=query_out.detach(),
        support_losses=support,
        fast=fast,
        step_query_losses=torch.stack([*step_query, query_losses]) if every_step else None,
    )
