"""iMAML (Rajeswaran, Finn, Kakade & Levine, NeurIPS 2019): the implicit meta-gradient of a proximal inner problem.

Each task's adapted weights solve, approximately, ``phi* = argmin_phi L_s(phi) + lam/2 |phi - theta|^2``:
the inner loop runs its update rule on the gradient of that regularised loss, values only. At
the solution ``d phi*/d theta = (I + H/lam)^-1`` with ``H`` the support loss's Hessian at
``phi*``, so the meta-gradient is ``(I + H/lam)^-1 g`` with ``g`` the query loss's gradient at
``phi*``. Conjugate gradient solves that system for all tasks at once (the tasks' systems are
independent: every inner product and step size is per task) from Hessian-vector products:
forward-over-reverse (``torch.func.jvp`` over ``torch.func.grad``, ``hvp.support_hvp``), or by
double backward where a model's operators lack forward-mode derivatives. Nothing of the inner
loop is kept, so memory does not grow with the number of steps.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .batch import TaskBatch
from .compiled import with_gradient
from .forward import Params, TaskForward
from .hvp import support_hvp
from .loop import Adapted, MetaOutput, Problem, autograd_support_grad, per_task, query_step, stacked

__all__ = ["Options", "evaluate", "proximal_adapt", "run"]


class Options(Protocol):
    """iMAML's options, as ``maml.Implicit`` holds them (``modes.py``, where they are checked)."""

    @property
    def lam(self) -> float: ...
    @property
    def cg_iterations(self) -> int: ...
    @property
    def cg_tolerance(self) -> float: ...


def _dot(a: Params, b: Params) -> Tensor:
    """Per-task inner products of ``(T, *shape)`` dicts: ``(T,)``."""
    return sum((a[k] * b[k]).flatten(1).sum(1) for k in a)  # type: ignore[return-value]


def _scaled(a: Params, s: Tensor, b: Params) -> Params:
    """``a + s * b`` with a per-task ``(T,)`` scale."""
    return {k: a[k] + s.view(-1, *[1] * (a[k].dim() - 1)) * b[k] for k in a}


def _hessian_products(forward: TaskForward, consts: Params, batch: TaskBatch, steps: int, fast: Params, step: int):
    """``u -> H u`` for every task's support loss at ``fast`` (``(T, *shape)``), forward over reverse if it can run.

    With support sets of their own per inner step (``batch.per_step``) the inner problem's loss is
    the mean of the sets' inner losses (the objective a minibatched loop descends), so ``H`` is the
    mean of their Hessians, over the ``min(steps, S)`` sets the loop visited.
    """
    state = {"forward": True}
    sets = min(max(steps, 1), batch.support_x.shape[1]) if batch.per_step else 1

    def one_set(u: Params, k: int) -> Params:
        x, y = batch.support_at(k)
        if state["forward"]:
            try:
                return support_hvp(forward, consts, {}, x, y, fast, u, step=step)[1]
            except RuntimeError as e:
                if "forward_over_reverse" not in str(e):
                    raise
                state["forward"] = False  # an operator without forward-mode derivatives: double backward
        return by_double_backward(u, x, y)

    def by_double_backward(u: Params, x: Tensor, y: Tensor) -> Params:
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in fast.items()}
            losses, _ = forward(leaves, consts, x, y, step=step, inner=True)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()), create_graph=True)
            dot = sum((g * u[k]).sum() for g, k in zip(grads, leaves))
            return dict(
                zip(leaves, torch.autograd.grad(dot, list(leaves.values()), allow_unused=True, materialize_grads=True))
            )

    def products(u: Params) -> Params:
        parts = [one_set(u, k) for k in range(sets)]
        return parts[0] if sets == 1 else {k: sum(h[k] for h in parts) / sets for k in u}  # type: ignore[misc]

    return products


def conjugate_gradient(apply: callable, b: Params, iterations: int, tolerance: float) -> Params:  # type: ignore[valid-type]
    """Solves ``apply(v) = b`` for every task at once (``(T, *shape)``), each with its own step sizes.

    A task stops once its residual's norm is at most ``tolerance`` times its own ``b``'s norm
    (relative: a task's solution scales with its ``b``, so a small ``b`` is solved as far as a large
    one); a task whose ``b`` is 0 stops at once with the solution 0.
    """
    v = {k: torch.zeros_like(t) for k, t in b.items()}
    r = dict(b)
    p = dict(b)
    rr = _dot(r, r)
    # Norms, not squares: (tolerance * |b|)**2 underflows to 0 in float32 for a gradient as small as 1e-15.
    limit = tolerance * rr.sqrt()
    for _ in range(iterations):
        going = rr.sqrt() > limit  # per task; False where b = 0 (0 > 0), whose solution stays 0
        if not bool(going.any()):
            break
        ap = apply(p)
        pap = _dot(p, ap)
        # I + H/lam is indefinite where the support loss is not convex: CG's step stays defined while p'Ap != 0.
        alpha = torch.where(going & (pap != 0), rr / torch.where(pap != 0, pap, 1.0), 0.0)
        v = _scaled(v, alpha, p)
        r = _scaled(r, -alpha, ap)
        rr_new = _dot(r, r)
        beta = torch.where(going, rr_new / torch.where(rr > 0, rr, 1.0), 0.0)
        p = _scaled(r, beta, p)
        rr = rr_new
    return v


def proximal_adapt(p: Problem, options: Options) -> Adapted:
    """The inner loop on each task's proximal problem ``L_s(phi) + lam/2 |phi - theta|^2``, values only.

    What iMAML adapts with, in training and in evaluation alike, on the support sets of
    ``p.batch``; ``p.params`` are ``theta`` (no task dimension).

    Returns:
        The loop's result, its ``(T, *shape)`` fast weights detached.
    """
    lam, loop = options.lam, p.loop
    anchor = per_task({k: v.detach() for k, v in p.params.items()}, p.batch.num_tasks)
    consts = {k: v.detach() for k, v in p.consts.items()}
    rates = {k: v.detach() for k, v in p.rate_values.items()}
    plain = autograd_support_grad(loop.forward, consts, p.batch.support_at, create_graph=False)

    def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:  # of the proximal loss
        grads, losses = plain(fast, step)
        return {k: g + lam * (fast[k] - anchor[k]) for k, g in grads.items()}, losses

    def values(step: int, fast: Params, state: tuple) -> tuple[Params, tuple]:
        return {k: v.detach().requires_grad_() for k, v in fast.items()}, tuple(
            {k: v.detach() for k, v in s.items()} for s in state
        )

    with torch.enable_grad():
        fast = {k: v.clone().requires_grad_() for k, v in anchor.items()}
        done = loop.run(support_grad, fast, loop.rule.init(fast), rates, p.steps, keep=values)
    return done._replace(fast={k: v.detach() for k, v in done.fast.items()})


def evaluate(p: Problem, options: Options) -> MetaOutput:
    """The query losses after the proximal adaptation, without a meta-gradient (evaluation)."""
    done, batch = proximal_adapt(p, options), p.batch
    with torch.no_grad():
        query_losses, query_out = p.loop.forward(
            done.fast, p.consts, batch.query_x, batch.query_y, step=query_step(p.steps)
        )
    return MetaOutput(
        loss=query_losses.mean(),
        query_losses=query_losses,
        query_out=query_out,
        support_losses=stacked(done.support_losses, batch.num_tasks, batch.support_x),
        fast=done.fast,
        step_query_losses=None,
    )


def run(p: Problem, options: Options) -> MetaOutput:
    """Adapts to the proximal problem (values only), then returns the query loss carrying iMAML's meta-gradient."""
    loop, params, batch = p.loop, p.params, p.batch
    tasks, lam = batch.num_tasks, options.lam
    done = proximal_adapt(p, options)
    fast, consts = done.fast, {k: v.detach() for k, v in p.consts.items()}
    with torch.enable_grad():
        last = query_step(p.steps)
        leaves = {k: v.clone().requires_grad_() for k, v in fast.items()}
        query_losses, query_out = loop.forward(leaves, consts, batch.query_x, batch.query_y, step=last)
        g = dict(
            zip(
                leaves,
                torch.autograd.grad(
                    query_losses.sum(), list(leaves.values()), allow_unused=True, materialize_grads=True
                ),
            )
        )
    hessian = _hessian_products(loop.forward, consts, batch, p.steps, fast, last)
    meta = conjugate_gradient(lambda u: _plus(u, hessian(u), 1 / lam), g, options.cg_iterations, options.cg_tolerance)
    grads = [meta[k].sum(0) / tasks for k in params]  # the mean over tasks of each task's meta-gradient
    loss = with_gradient(
        query_losses.detach().mean(),
        list(params.values()),
        grads,
        "mode='implicit' computes iMAML's meta-gradient by conjugate gradient; it cannot be differentiated "
        "again (backward with create_graph=True).",
    )
    return MetaOutput(
        loss=loss,
        query_losses=query_losses.detach(),
        query_out=query_out.detach(),
        support_losses=stacked(done.support_losses, tasks, batch.support_x),
        fast=fast,
        step_query_losses=None,
    )


def _plus(a: Params, b: Params, scale: float) -> Params:
    """``a + scale * b``."""
    return {k: a[k] + scale * b[k] for k in a}
