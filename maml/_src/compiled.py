"""The meta-training step as one ``torch.compile``'d function: meta-loss and exact meta-gradient.

``torch.compile`` cannot differentiate a compiled graph twice, so the eager engine's
``autograd.grad(create_graph=True)`` followed by ``loss.backward()`` cannot be compiled. Written
with ``torch.func.grad`` instead, the meta-gradient is an ordinary function of the initial
parameters (an outer ``grad`` over an inner loop of ``grad``\\ s), which dynamo traces into one
graph and inductor fuses: the inner step, its double backward and the optimizer-free outer
backward become a handful of kernels instead of hundreds of eager operator calls.

Exactness with norm layers: ``vmap`` batches only the per-task forward pass inside both
``grad``\\ s, so no reverse-over-reverse batching rule is used (those are wrong for batch,
layer and instance norm, pytorch/functorch#534); the tests check every norm family in float64
against finite differences and against the eager engine.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .batch import support_at
from .forward import Params
from .loop import InnerLoop, MetaOutput, Problem, func_support_grad, meta_objective, per_task, query_step, stacked

__all__ = ["meta_step", "run"]

# (grads of params, rates, trained consts), (loss, query losses, query outputs, support losses, fast, step query losses)
StepResult = tuple[tuple[Params, Params, Params], tuple[Tensor, Tensor, Tensor, Tensor, Params, Tensor]]
Step = Callable[..., StepResult]


def meta_step(loop: InnerLoop, first_order: bool) -> Step:
    """The uncompiled step: ``step(params, rate_values, trained, consts, sx, sy, qx, qy, steps, step_weights, per_step)``.

    ``trained`` are the trainable parameters outside the adapt set, ``consts`` the rest of the
    model's tensors. Returns the gradients of the loss with respect to ``params``,
    ``rate_values`` and ``trained``, and ``(loss, query_losses (T,), query_out (T, n_query, ...),
    support_losses (steps, T), fast (T, *shape), step_query_losses (steps, T) or (0,))``, where
    ``loss`` is the mean query loss over the ``T`` tasks after ``steps`` inner steps, or the
    ``step_weights``-weighted sum of the means after each step. ``per_step``: ``sx`` and ``sy``
    hold one support set per inner step (``TaskBatch.per_step``).
    """
    loop = loop.unchecked()  # traced code cannot raise on a value: run() checks the losses after

    def meta_loss(
        params: Params,
        rate_values: Params,
        trained: Params,
        consts: Params,
        sx: Tensor,
        sy: Tensor,
        qx: Tensor,
        qy: Tensor,
        steps: int,
        step_weights: Tensor | None,
        per_step: bool,
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Params, Tensor]]:
        consts = {**consts, **trained}
        tasks = sx.shape[0]
        fast = per_task(params, tasks)
        support = functools.partial(support_at, sx, sy, per_step)
        support_grad = func_support_grad(loop.forward, consts, support, first_order=first_order)
        score = None if step_weights is None else (lambda fast, step: loop.forward(fast, consts, qx, qy, step=step)[0])
        done = loop.run(support_grad, fast, loop.rule.init(fast), rate_values, steps, score=score)
        query_losses, query_out = loop.forward(done.fast, consts, qx, qy, step=query_step(steps))
        support = stacked(done.support_losses, tasks, sx)
        # Without step weights an empty stand-in: the transforms' outputs must all be tensors.
        per_step = query_losses.new_zeros(0) if step_weights is None else torch.stack([*done.scores, query_losses])
        loss = meta_objective(query_losses, per_step, step_weights)
        return loss, (query_losses, query_out, support, done.fast, per_step)

    value_and_grad = torch.func.grad_and_value(meta_loss, argnums=(0, 1, 2), has_aux=True)

    def step(*args: Any) -> StepResult:
        grads, (loss, (query_losses, query_out, support, fast, per_step)) = value_and_grad(*args)
        return grads, (loss, query_losses, query_out, support, fast, per_step)

    return step


def run(step: Step, problem: Problem, *, chunk: int, step_weights: Tensor | None) -> MetaOutput:
    """The meta-loss with its meta-gradient computed now, by the compiled ``step``, ``chunk`` tasks at a time.

    With the loop, each call is one task (no grouped convolutions, one task's activations);
    with vmap, all tasks (or ``chunk_size``). The loss and gradient are the chunks' means
    weighted by their sizes, which is the mean over the meta-batch. ``loop.check`` runs on the
    support losses afterwards.
    """
    loop, params, rate_values, consts, batch, steps = problem
    tasks = batch.num_tasks
    trained = {k: v for k, v in consts.items() if v.requires_grad}
    inputs = [*params.values(), *rate_values.values(), *trained.values()]
    values = {k: v.detach() for k, v in params.items()}
    rates = {k: v.detach() for k, v in rate_values.items()}
    trained_values = {k: v.detach() for k, v in trained.items()}
    shared = {k: v.detach() for k, v in consts.items() if k not in trained}
    weights = None if step_weights is None else step_weights.detach()

    loss: Tensor | None = None
    grads: list[Tensor] = []
    parts = []
    for lo in range(0, tasks, chunk):
        part = batch[lo : lo + chunk]
        (g_params, g_rates, g_trained), (part_loss, *rest) = step(
            values,
            rates,
            trained_values,
            shared,
            part.support_x,
            part.support_y,
            part.query_x,
            part.query_y,
            steps,
            weights,
            part.per_step,
        )
        part_grads = [*g_params.values(), *g_rates.values(), *g_trained.values()]
        if chunk < tasks:  # the meta-batch's mean: the chunks' means weighted by their sizes
            weight = part.num_tasks / tasks
            part_loss, part_grads = part_loss * weight, [g * weight for g in part_grads]
        if loss is None:
            loss, grads = part_loss, part_grads
        else:
            loss, grads = loss + part_loss, [a + g for a, g in zip(grads, part_grads)]
        parts.append(rest)
    assert loss is not None

    def join(pieces: list[Tensor], dim: int = 0) -> Tensor:  # one chunk (vmap's default) needs no copy
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    support_losses = join([p[2] for p in parts], dim=1)  # (steps, T)
    if loop.check is not None and not bool(torch.isfinite(support_losses).all()):  # one synchronisation
        for i in range(steps):
            loop.check(support_losses[i], i, steps)
    return MetaOutput(
        loss=with_gradient(loss, inputs, grads),
        query_losses=join([p[0] for p in parts]),
        query_out=join([p[1] for p in parts]),
        support_losses=support_losses,
        fast={k: join([p[3][k] for p in parts]) for k in values},
        step_query_losses=None if step_weights is None else join([p[4] for p in parts], dim=1),
    )


def compile_step(step: Callable[..., StepResult]) -> Callable[..., StepResult]:
    """``torch.compile(step)`` with a compilation cache of its own.

    Dynamo keeps compiled graphs, and counts recompilations against ``recompile_limit``, per
    code object; every ``meta_step`` closure shares one, so a process with several learners
    (a sweep, tests) would fail on the ninth. A copy of the code object per learner keeps
    each learner's compilations apart. Shapes are static: a meta-training run has one.
    """
    code = step.__code__.replace()  # an equal but distinct code object
    own = types.FunctionType(code, step.__globals__, step.__name__, step.__defaults__, step.__closure__)
    return torch.compile(own, fullgraph=True, dynamic=False)


class _WithGradient(torch.autograd.Function):
    """``value``, whose gradient with respect to ``inputs`` is ``grads``, computed already."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, grads: tuple[Tensor, ...], what: str, *inputs: Tensor) -> Tensor:
        ctx.grads, ctx.what = grads, what
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: the gradient is a constant here, not a function
            raise RuntimeError(ctx.what)
        return (None, None, None, *(grad_output * g for g in ctx.grads))


_NOT_AGAIN = (
    "the meta-gradient of a MetaLearner with compile=True is computed by the compiled step and cannot be "
    "differentiated again (backward with create_graph=True); build the learner with compile=False to take "
    "higher derivatives of the meta-loss."
)


def with_gradient(value: Tensor, inputs: list[Tensor], grads: list[Tensor], error: str = _NOT_AGAIN) -> Tensor:
    """``value`` joined to the autograd graph of ``inputs``, with ``d value / d inputs = grads``.

    ``error``: the message of differentiating it again (its gradient is a constant).
    """
    return _WithGradient.apply(value, tuple(grads), error, *inputs)
