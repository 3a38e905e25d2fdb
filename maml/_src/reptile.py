"""Reptile (Nichol, Achiam & Schulman, 2018): the meta-gradient as the step from the initial to the adapted weights.

Reptile adapts each task with the inner loop, without differentiating it, and moves the
initialisation towards the adapted weights: ``theta <- theta + eps * (mean_t phi_t - theta)``.
Here that direction is left in ``.grad`` as ``theta - mean_t phi_t`` by the returned loss, so
any torch optimizer applies it (``torch.optim.SGD(lr=eps)`` is the paper's update); the loss's
value is the mean query loss at the adapted weights, for logging. Parameters the inner loop
does not adapt get a zero direction.
"""

from __future__ import annotations

import torch

from .compiled import with_gradient
from .eager import adapt
from .loop import MetaOutput, Problem, query_step

__all__ = ["run"]


def run(p: Problem) -> MetaOutput:
    """Adapts every task of ``p.batch`` (values only), scores the query sets, and returns Reptile's loss."""
    loop, params, consts, batch = p.loop, p.params, p.consts, p.batch
    with torch.no_grad():  # values only: Reptile differentiates nothing
        fast, support, _ = adapt(p, first_order=True)
        query_losses, query_out = loop.forward(fast, consts, batch.query_x, batch.query_y, step=query_step(p.steps))
        directions = [p.detach() - fast[k].mean(0) for k, p in params.items()]
    trained = [v for v in consts.values() if v.requires_grad]
    loss = with_gradient(
        query_losses.mean(),
        [*params.values(), *trained],
        [*directions, *(torch.zeros_like(v) for v in trained)],
        "mode='reptile' leaves Reptile's direction in .grad, which is no derivative of the loss and cannot be "
        "differentiated again (backward with create_graph=True).",
    )
    return MetaOutput(
        loss=loss,
        query_losses=query_losses,
        query_out=query_out,
        support_losses=support,
        fast=fast,
    )  # no step_query_losses: Reptile weighs no steps
