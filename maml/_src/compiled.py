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

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .inner import Params
from .loop import InnerLoop
from .step import func_support_grad, inner_step

# (grads of params, rates, trained consts), (loss, query losses, query outputs, support losses, fast, step query losses)
StepResult = tuple[tuple[Params, Params, Params], tuple[Tensor, Tensor, Tensor, Tensor, Params, Tensor]]


def meta_step(loop: InnerLoop, first_order: bool) -> Callable[..., StepResult]:
    """The uncompiled step: ``step(params, rate_values, trained, consts, sx, sy, qx, qy, steps, step_weights)``.

    ``trained`` are the trainable parameters outside the adapt set, ``consts`` the rest of the
    model's tensors. Returns the gradients of the loss with respect to ``params``,
    ``rate_values`` and ``trained``, and ``(loss, query_losses (T,), query_out (T, n_query, ...),
    support_losses (steps, T), fast (T, *shape), step_query_losses (steps, T) or (0,))``, where
    ``loss`` is the mean query loss over the ``T`` tasks after ``steps`` inner steps, or the
    ``step_weights``-weighted sum of the means after each step.
    """

    def meta_loss(
        params: Params, rate_values: Params, trained: Params, consts: Params,
        sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor, steps: int, step_weights: Tensor | None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Params, Tensor]]:  # fmt: skip
        consts = {**consts, **trained}
        tasks = sx.shape[0]
        fast = {k: p.unsqueeze(0).expand(tasks, *p.shape) for k, p in params.items()}
        state = loop.rule.init(fast)
        support_grad = func_support_grad(loop.forward, consts, sx, sy, first_order=first_order)
        support_losses, scores = [], []
        for step in range(steps):
            fast, state, losses = inner_step(support_grad, loop.rule, fast, state, loop.rates.at(rate_values, step), step)
            support_losses.append(losses)
            if step_weights is not None and step < steps - 1:
                scores.append(loop.forward(fast, consts, qx, qy)[0])
        query_losses, query_out = loop.forward(fast, consts, qx, qy)
        support = torch.stack(support_losses) if support_losses else sx.new_zeros((0, tasks), dtype=torch.float32)
        if step_weights is None:  # an empty stand-in: the transforms' outputs must all be tensors
            return query_losses.mean(), (query_losses, query_out, support, fast, query_losses.new_zeros(0))
        per_step = torch.stack([*scores, query_losses])  # (steps, T)
        return (step_weights * per_step.mean(1)).sum(), (query_losses, query_out, support, fast, per_step)

    value_and_grad = torch.func.grad_and_value(meta_loss, argnums=(0, 1, 2), has_aux=True)

    def step(*args: Any) -> StepResult:
        grads, (loss, (query_losses, query_out, support, fast, per_step)) = value_and_grad(*args)
        return grads, (loss, query_losses, query_out, support, fast, per_step)

    return step


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
    def forward(ctx: Any, value: Tensor, grads: tuple[Tensor, ...], *inputs: Tensor) -> Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: the gradient is a constant here, not a function
            raise RuntimeError(
                "the meta-gradient of a MetaLearner with compile=True is computed by the compiled step "
                "and cannot be differentiated again (backward with create_graph=True); build the "
                "learner with compile=False to take higher derivatives of the meta-loss."
            )
        return (None, None, *(grad_output * g for g in ctx.grads))


def with_gradient(value: Tensor, inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
    """``value`` joined to the autograd graph of ``inputs``, with ``d value / d inputs = grads``."""
    return _WithGradient.apply(value, tuple(grads), *inputs)
