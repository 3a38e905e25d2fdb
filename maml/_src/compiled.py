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

from collections.abc import Callable, Mapping
import types
from typing import Any

import torch
from torch import Tensor

from .inner import Params, TaskForward

# rate_of[name]: the key of a learnable rate in ``rate_params``, or a fixed float.
RateOf = Mapping[str, str | float]
# (grads of params, grads of rates), (loss, query losses, query outputs, support losses, fast weights)
StepResult = tuple[tuple[Params, Params], tuple[Tensor, Tensor, Tensor, Tensor, Params]]


def meta_step(
    forward: TaskForward, rate_of: RateOf, first_order: bool
) -> Callable[[Params, Params, Params, Tensor, Tensor, Tensor, Tensor, int], StepResult]:
    """The uncompiled step: ``step(params, rate_params, consts, sx, sy, qx, qy, steps)``.

    Returns ``((d loss / d params, d loss / d rate_params), (loss, query_losses (T,),
    query_out (T, n_query, ...), support_losses (steps, T), fast (T, *shape)))``, where
    ``loss`` is the mean query loss over the ``T`` tasks after ``steps`` inner SGD steps.
    """

    def meta_loss(
        params: Params, rate_params: Params, consts: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor, steps: int
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Params]]:
        rates = {k: rate_params[r] if isinstance(r, str) else r for k, r in rate_of.items()}
        tasks = sx.shape[0]
        fast = {k: p.unsqueeze(0).expand(tasks, *p.shape) for k, p in params.items()}
        support_losses = []
        for _ in range(steps):

            def support_loss(f: Params) -> tuple[Tensor, Tensor]:
                losses, _ = forward(f, consts, sx, sy)
                # Each task's loss depends on its own slice of `f` only: the gradient of the
                # sum holds every task's own gradient in its slice.
                return losses.sum(), losses

            grads, losses = torch.func.grad(support_loss, has_aux=True)(fast)
            if first_order:  # the inner gradient as a constant (FOMAML)
                grads = {k: g.detach() for k, g in grads.items()}
            fast = {k: fast[k] - rates[k] * grads[k] for k in fast}
            support_losses.append(losses)
        query_losses, query_out = forward(fast, consts, qx, qy)
        support = torch.stack(support_losses) if support_losses else sx.new_zeros((0, tasks), dtype=torch.float32)
        return query_losses.mean(), (query_losses, query_out, support, fast)

    value_and_grad = torch.func.grad_and_value(meta_loss, argnums=(0, 1), has_aux=True)

    def step(*args: Any) -> StepResult:
        grads, (loss, (query_losses, query_out, support, fast)) = value_and_grad(*args)
        return grads, (loss, query_losses, query_out, support, fast)

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
