"""iMAML (issue 23): ``mode="implicit"``'s meta-gradient on a strongly convex inner problem with a closed form.

Ridge regression on fixed features: a linear model ``w`` with the support loss
``L_s(w) = mean((X w - y)^2)`` has the proximal solution ``w* = (A + lam I)^-1 (b + lam theta)``
with ``A = 2/n X^T X``, ``b = 2/n X^T y``, so the query loss ``L_q(w*(theta))`` has a meta-gradient
computed here two independent ways: by finite differences of the exactly solved problem, and
(as ``steps`` grow) by a hand-written unrolled second-order MAML loop on the regularised loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import maml

LAM, D, TASKS = 0.7, 4, 3


def problem(seed: int = 0) -> tuple[nn.Linear, maml.TaskBatch]:
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, D, generator=g, dtype=torch.float64))
    x = 0.5 * torch.randn(TASKS, 8, D, generator=g, dtype=torch.float64)
    q = 0.5 * torch.randn(TASKS, 6, D, generator=g, dtype=torch.float64)
    y, qy = (
        torch.randn(TASKS, 8, 1, generator=g, dtype=torch.float64),
        torch.randn(TASKS, 6, 1, generator=g, dtype=torch.float64),
    )
    return model, maml.TaskBatch(x, y, q, qy)


def exact_meta_loss(theta: torch.Tensor, batch: maml.TaskBatch) -> torch.Tensor:
    """The mean query loss at the exact proximal solutions (theta: ``(1, D)``)."""
    total = 0.0
    for t in range(TASKS):
        x, y = batch.support_x[t], batch.support_y[t]
        n = x.shape[0]
        a, b = 2 / n * x.T @ x, 2 / n * x.T @ y
        w = torch.linalg.solve(a + LAM * torch.eye(D, dtype=x.dtype), b + LAM * theta.T)
        total = total + F.mse_loss(batch.query_x[t] @ w, batch.query_y[t])
    return total / TASKS


def test_the_implicit_meta_gradient_equals_that_of_the_exactly_solved_problem():
    model, batch = problem()
    learner = maml.MetaLearner(
        model, F.mse_loss, 0.5, 200, mode="implicit", implicit=maml.Implicit(lam=LAM, cg_iterations=D, cg_tolerance=0)
    )
    learner.meta_loss(batch).backward()
    theta = model.weight.detach().clone()
    eps = 1e-6
    numeric = torch.zeros_like(theta)
    for i in range(D):
        e = torch.zeros_like(theta)
        e[0, i] = eps
        numeric[0, i] = (exact_meta_loss(theta + e, batch) - exact_meta_loss(theta - e, batch)) / (2 * eps)
    torch.testing.assert_close(model.weight.grad, numeric, rtol=0, atol=1e-8)
    analytic = torch.autograd.grad(exact_meta_loss(theta.requires_grad_(), batch), theta)[0]
    torch.testing.assert_close(model.weight.grad, analytic, rtol=0, atol=1e-10)


def unrolled(model: nn.Linear, batch: maml.TaskBatch, steps: int, lr: float) -> torch.Tensor:
    """Second-order MAML's meta-gradient through ``steps`` steps on the regularised support loss."""
    theta = model.weight
    total = 0.0
    for t in range(TASKS):
        w = theta
        for _ in range(steps):
            loss = F.mse_loss(batch.support_x[t] @ w.T, batch.support_y[t]) + LAM / 2 * ((w - theta) ** 2).sum()
            (g,) = torch.autograd.grad(loss, w, create_graph=True)
            w = w - lr * g
        total = total + F.mse_loss(batch.query_x[t] @ w.T, batch.query_y[t])
    return torch.autograd.grad(total / TASKS, theta)[0]


def test_the_unrolled_maml_gradient_approaches_it_as_steps_grow():
    model, batch = problem(1)
    learner = maml.MetaLearner(
        model, F.mse_loss, 0.3, 100, mode="implicit", implicit=maml.Implicit(lam=LAM, cg_iterations=D)
    )
    learner.meta_loss(batch).backward()
    errors = [float((unrolled(model, batch, k, 0.3) - model.weight.grad).norm()) for k in (1, 3, 10, 30, 100)]
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-10, errors


def test_memory_does_not_keep_the_inner_loop():
    model, batch = problem()
    learner = maml.MetaLearner(model, F.mse_loss, 0.5, 50, mode="implicit")
    loss = learner.meta_loss(batch)
    # The loss's graph leads straight to the parameters: no node of any inner step is kept.
    nodes = [f for f, _ in loss.grad_fn.next_functions if f is not None]
    assert [type(f).__name__ for f in nodes] == ["AccumulateGrad"]


def test_implicit_refuses_what_it_cannot_learn():
    model, batch = problem()
    with pytest.raises(ValueError, match=r"^mode='implicit' with learn_inner_lr='scalar': iMAML's meta-gradient"):
        maml.MetaLearner(model, F.mse_loss, 0.5, 5, mode="implicit", learn_inner_lr="scalar")
    with pytest.raises(ValueError, match=r"only applies to mode='implicit'"):
        maml.MetaLearner(model, F.mse_loss, 0.5, 5, implicit=maml.Implicit())
    with pytest.raises(ValueError, match=r"Implicit\(lam=0\): the regularisation must be a number > 0"):
        maml.Implicit(lam=0)
    net = nn.Sequential(nn.Linear(D, 3), nn.Linear(3, 1)).double()
    learner = maml.MetaLearner(net, F.mse_loss, 0.5, 5, mode="implicit", adapt=["1.weight", "1.bias"])
    with pytest.raises(ValueError, match=r"0.bias, 0.weight is trained but not adapted"):
        learner.meta_loss(batch)
