"""An independent reference for the MAML family's meta-gradients (tests/engine/test_family.py checks the engine
against it): the meta-loss one task at a time, with ``torch.autograd.grad`` (``create_graph=True``) and the inner
update rules (SGD, momentum, Nesterov, Adam) restated from ``torch.optim``'s definitions; the model is evaluated
at its fast weights by ``torch.func.functional_call`` and nothing else of the engine is used.

The reference is itself checked against ``higher``, ``torch.optim`` and finite differences (test_family.py's
``test_reference_*`` tests), so a disagreement with the engine points at the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from helpers import DTYPE
from torch import Tensor, nn
from torch.func import functional_call

import maml

# A configuration is the family options of MetaLearner (adapt, learn_inner_lr, inner_optimizer,
# inner_optimizer_options) plus "step_weights" (a tuple, passed to meta_loss / run as a tensor).
Config = dict[str, Any]


def rule_of(cfg: Config) -> str:
    return cfg.get("inner_optimizer", "sgd")


class _Sqrt0(torch.autograd.Function):
    """``sqrt(v)`` with derivative 0 where ``v == 0``.

    Adam's second moment is 0 exactly where every gradient so far was 0, and there its first
    moment is 0 too: the update ``m / (sqrt(v) + eps)`` does not depend on ``sqrt(v)`` to first
    order, so 0 is the true contribution (autograd's would be ``0 * inf = nan``). The reference's
    meta-gradient differentiates through this once, never twice.
    """

    @staticmethod
    def forward(ctx: Any, v: Tensor) -> Tensor:
        root = v.sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        positive = root > 0
        return torch.where(positive, grad / (2 * torch.where(positive, root, torch.ones_like(root))), 0.0)


def ref_update(
    cfg: Config, k: int, lr: float | Tensor, p: Tensor, g: Tensor, state: Any, sqrt: Callable = _Sqrt0.apply
):
    """One parameter's inner step ``k`` (0-based) of the rule: ``(new p, new state)``."""
    rule, opts = rule_of(cfg), cfg.get("inner_optimizer_options") or {}
    if rule == "sgd":
        return p - lr * g, None
    if rule == "momentum":  # torch.optim.SGD(momentum=mu, nesterov=...), dampening 0
        mu, nesterov = opts.get("momentum", 0.9), opts.get("nesterov", False)
        buf = g if k == 0 else mu * state + g
        return p - lr * (g + mu * buf if nesterov else buf), buf
    assert rule == "adam"  # torch.optim.Adam(betas, eps)
    (b1, b2), eps = opts.get("betas", (0.9, 0.999)), opts.get("eps", 1e-8)
    m, v = state if k else (torch.zeros_like(g), torch.zeros_like(g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    t = k + 1
    return p - lr / (1 - b1**t) * m / (sqrt(v) / math.sqrt(1 - b2**t) + eps), (m, v)


def trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def resolve_adapt(adapt: Any, names: list[str]) -> list[str]:
    if adapt is None:
        return list(names)
    if callable(adapt):
        return [n for n in names if adapt(n)]
    assert set(adapt) <= set(names)
    return [n for n in names if n in set(adapt)]


def ref_rates(model: nn.Module, adapted: list[str], kind: str | None, inner_lr: float, steps: int) -> dict[str, Tensor]:
    """The learnable rates, laid out as the API documents, at their initial value ``inner_lr``."""
    params = dict(model.named_parameters())
    if kind is None:
        return {}
    if kind == "scalar":
        return {"inner_lr": torch.tensor(inner_lr, dtype=DTYPE, requires_grad=True)}
    if kind == "per_parameter":
        return {n: torch.full_like(params[n], inner_lr).requires_grad_() for n in adapted}
    assert kind == "per_layer_per_step"
    return {n: torch.full((steps,), inner_lr, dtype=DTYPE, requires_grad=True) for n in adapted}


def rate_at(rates: dict[str, Tensor], kind: str | None, inner_lr: float, name: str, k: int) -> float | Tensor:
    if kind is None:
        return inner_lr
    if kind == "scalar":
        return rates["inner_lr"]
    if kind == "per_parameter":
        return rates[name]
    return rates[name][min(k, rates[name].shape[0] - 1)]  # more steps than built: the last step's rate


@dataclass
class Ref:
    loss: Tensor  # the meta-loss, differentiable w.r.t. the model's trainable parameters and ``rates``
    step_query_losses: Tensor | None  # (steps, T) values, with step weights
    query_losses: Tensor  # (T,) values after the last step
    fast: list[dict[str, Tensor]]  # per task: the adapted parameters' fast weights (values)
    rates: dict[str, Tensor]


def reference(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch: maml.TaskBatch,
    cfg: Config,
    *,
    inner_lr: float,
    steps: int,
    first_order: bool,
    rates: dict[str, Tensor] | None = None,
    eval_steps: int | None = None,
    adapted: list[str] | None = None,
    sqrt: Callable = _Sqrt0.apply,
) -> Ref:
    """The meta-loss one task at a time: ``steps`` (or ``eval_steps``) inner steps of the rule on the
    support loss, gradients by ``torch.autograd.grad`` (``create_graph=True``, or detached for first
    order, so the rule's state is built from constants too), then the query loss after the last
    step (or the step-weighted query losses after every step), averaged over the tasks.

    ``rates``: the learnable rates (default: built here from ``cfg`` at ``inner_lr`` for ``steps``).
    ``adapted``: the adapted parameters' names (default: ``cfg["adapt"]`` over the trainable ones).
    """
    named = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    if adapted is None:
        adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    kind = cfg.get("learn_inner_lr")
    if rates is None:
        rates = ref_rates(model, adapted, kind, inner_lr, steps)
    n_steps = steps if eval_steps is None else eval_steps
    sw = cfg.get("step_weights")
    assert sw is None or len(sw) == n_steps
    tasks = batch.num_tasks

    def loss_at(fast: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, {**named, **fast, **buffers}, (x,), strict=True), y)

    total: Tensor | float = 0.0
    per_step = torch.zeros(n_steps, tasks, dtype=DTYPE)
    last = torch.zeros(tasks, dtype=DTYPE)
    fasts = []
    for t in range(tasks):
        sx, sy, qx, qy = batch.support_x[t], batch.support_y[t], batch.query_x[t], batch.query_y[t]
        fast = {n: named[n] for n in adapted}
        state: dict[str, Any] = {n: None for n in adapted}
        for k in range(n_steps):
            grads = torch.autograd.grad(
                loss_at(fast, sx, sy), [fast[n] for n in adapted], create_graph=not first_order, retain_graph=True
            )
            new = {}
            for n, g in zip(adapted, grads):
                g = g.detach() if first_order else g
                new[n], state[n] = ref_update(cfg, k, rate_at(rates, kind, inner_lr, n, k), fast[n], g, state[n], sqrt)
            fast = new
            if sw is not None:
                q = loss_at(fast, qx, qy)
                per_step[k, t] = q.detach()
                total = total + sw[k] * q / tasks
        q = loss_at(fast, qx, qy)
        last[t] = q.detach()
        if sw is None:
            total = total + q / tasks
        fasts.append({n: v.detach() for n, v in fast.items()})
    assert isinstance(total, Tensor)
    return Ref(total, per_step if sw is not None else None, last, fasts, rates)
