"""The eager path: second order, first order, and evaluation without a graph.

Second order keeps every inner step's graph (``create_graph=True``) and lets ``backward()``
differentiate through all of it; first order takes the inner gradients as constants.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .forward import Params
from .loop import MetaOutput, Problem, autograd_support_grad, per_task, query_step, stacked
from .rules import State

__all__ = ["adapt", "run"]


def _values(step: int, fast: Params, state: State) -> tuple[Params, State]:
    """Evaluation keeps each step's values, not its graph: the next step starts from fresh leaves."""
    return {k: v.detach().requires_grad_() for k, v in fast.items()}, tuple(
        {k: v.detach() for k, v in s.items()} for s in state
    )


def adapt(
    p: Problem, *, first_order: bool, query: tuple[Tensor, Tensor] | None = None
) -> tuple[Params, Tensor, list[Tensor]]:
    """Runs the inner loop on the support sets of ``p.batch``'s ``T`` tasks.

    Under ``torch.no_grad()`` it computes the same values without keeping a graph (evaluation).

    Args:
        p: the inner problem: the loop, the meta-parameters, the tasks, the steps.
        first_order: take the inner gradients as constants.
        query: ``(query_x, query_y)`` to score after every step but the last (the multi-step loss).

    Returns:
        The fast weights ``(T, *shape)``, the ``(steps, T)`` support losses, and the ``(T,)``
        query losses after each step but the last (empty without ``query``).
    """
    loop, rate_values, consts = p.loop, p.rate_values, p.consts
    tasks = p.batch.num_tasks
    differentiable = torch.is_grad_enabled()
    with torch.enable_grad():  # the inner loop needs gradients even under torch.no_grad()
        fast = per_task(p.params, tasks)
        if not differentiable:
            # Evaluation: no meta-gradient wanted, so the same values without a graph to keep.
            fast = {k: v.detach().requires_grad_() for k, v in fast.items()}
            rate_values = {k: v.detach() for k, v in rate_values.items()}
            consts = {k: v.detach() for k, v in consts.items()}
            first_order = True
        support_grad = autograd_support_grad(loop.forward, consts, p.batch.support_at, create_graph=not first_order)
        score = None if query is None else (lambda fast, step: loop.forward(fast, consts, *query, step=step)[0])
        done = loop.run(
            support_grad,
            fast,
            loop.rule.init(fast),
            rate_values,
            p.steps,
            score=score,
            keep=None if differentiable else _values,
        )
    fast = done.fast if differentiable else {k: v.detach() for k, v in done.fast.items()}
    return fast, stacked(done.support_losses, tasks, p.batch.support_x), done.scores


def run(p: Problem, *, first_order: bool, step_weights: Tensor | None) -> MetaOutput:
    """Adapts to every task of ``p.batch`` and scores the fast weights on its query set."""
    query = (p.batch.query_x, p.batch.query_y)
    every_step = step_weights is not None
    fast, support, step_query = adapt(p, first_order=first_order, query=query if every_step else None)
    query_losses, query_out = p.loop.forward(fast, p.consts, *query, step=query_step(p.steps))
    per_step = torch.stack([*step_query, query_losses]) if every_step else None
    return MetaOutput.of(query_losses, query_out, support, fast, per_step, step_weights)
