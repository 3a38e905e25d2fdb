"""iMAML: ``mode="implicit"``'s meta-gradient on a strongly convex inner problem with a closed form.

Ridge regression on fixed features: a linear model ``w`` with the support loss
``L_s(w) = mean((X w - y)^2)`` has the proximal solution ``w* = (A + lam I)^-1 (b + lam theta)``
with ``A = 2/n X^T X``, ``b = 2/n X^T y``, so the query loss ``L_q(w*(theta))`` has a meta-gradient
computed here two independent ways: by finite differences of the exactly solved problem, and
(as ``steps`` grow) by a hand-written unrolled second-order MAML loop on the regularised loss.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import make
from torch import nn
from torch.func import functional_call

import maml
from maml._src.implicit import conjugate_gradient

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
        model, F.mse_loss, 0.5, 200, mode=maml.Implicit(lam=LAM, cg_iterations=D, cg_tolerance=0)
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
    learner = maml.MetaLearner(model, F.mse_loss, 0.3, 100, mode=maml.Implicit(lam=LAM, cg_iterations=D))
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
    with pytest.raises(ValueError, match=r"Implicit\(lam=0\): the regularisation must be a finite number > 0"):
        maml.Implicit(lam=0)
    net = nn.Sequential(nn.Linear(D, 3), nn.Linear(3, 1)).double()
    learner = maml.MetaLearner(net, F.mse_loss, 0.5, 5, mode="implicit", adapt=["1.weight", "1.bias"])
    with pytest.raises(ValueError, match=r"0.bias, 0.weight is trained but not adapted"):
        learner.meta_loss(batch)


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, -1.0, 1.0, 10**400], ids=["nan", "inf", "-inf", "-1", "1", "int-1e400"]
)
def test_a_tolerance_that_would_zero_the_meta_gradient_is_refused(value):
    # NaN stops no CG step, inf (relative: anything >= 1) stops every task before its first: 0 either way.
    message = (
        f"Implicit(cg_tolerance={value!r}) must be a finite number >= 0 and < 1, relative to the norm of each "
        "task's query gradient, e.g. 1e-10."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        maml.Implicit(cg_tolerance=value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0])
def test_a_regularisation_that_is_not_finite_is_refused(value):
    message = f"Implicit(lam={value!r}): the regularisation must be a finite number > 0, e.g. 1.0."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        maml.Implicit(lam=value)


def test_each_task_stops_relative_to_its_own_right_hand_side():
    # One SPD system, three tasks whose right-hand sides differ by 12 orders of magnitude, and one of 0.
    g = torch.Generator().manual_seed(0)
    m = torch.randn(D, D, generator=g, dtype=torch.float64)
    a = torch.eye(D, dtype=torch.float64) + m @ m.T
    b = torch.randn(4, D, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [1e-6], [1e-12], [0.0]])
    solved = conjugate_gradient(lambda u: {"w": u["w"] @ a}, {"w": b}, iterations=2 * D, tolerance=1e-10)["w"]
    exact = torch.linalg.solve(a, b.T).T
    for t in range(3):
        assert float((solved[t] - exact[t]).norm() / exact[t].norm()) < 1e-8, t
    assert torch.equal(solved[3], torch.zeros(D, dtype=torch.float64))  # b = 0: the solution 0, not NaN


@pytest.mark.parametrize("scale", [1e-6, 1e-12])
def test_a_tiny_query_gradient_gets_the_dense_solve_not_zero(scale):
    """The query targets a hair (``scale``) from the adapted model's outputs: the query gradient is tiny.

    An absolute tolerance of 1e-10 stopped CG early (1e-6: 5e-5 off) or before its first step
    (1e-12: a meta-gradient of exactly 0); relative, it matches ``mean_t (I + H_t/lam)^-1 g_t``
    solved densely.
    """
    lam = 2.0
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, 0.1, 5, mode=maml.Implicit(lam, cg_iterations=50))
    out = learner.run(batch)
    fast = {k: v.detach() for k, v in out.fast.items()}  # the query targets do not move them
    noise = torch.randn(out.query_out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    near = maml.TaskBatch(batch.support_x, batch.support_y, batch.query_x, out.query_out + scale * noise)
    learner.meta_loss(near).backward()
    meta = torch.cat([p.grad.flatten() for p in model.parameters()])

    names, shapes = zip(*((n, p.shape) for n, p in model.named_parameters()))
    sizes = [math.prod(s) for s in shapes]

    def support_loss(v: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One task's support loss at the flat weights ``v``."""
        return loss_fn(functional_call(model, {n: c.view(s) for n, c, s in zip(names, v.split(sizes), shapes)}, x), y)

    leaves = {k: v.clone().requires_grad_() for k, v in fast.items()}
    query_losses, _ = learner.task_losses(leaves, near.query_x, near.query_y)  # the learner's own forward
    grads = torch.autograd.grad(query_losses.sum(), [leaves[n] for n in names])
    dense, tasks = torch.zeros_like(meta), batch.num_tasks
    for t in range(tasks):
        phi = torch.cat([fast[n][t].flatten() for n in names])
        hessian = torch.autograd.functional.hessian(
            functools.partial(support_loss, x=batch.support_x[t], y=batch.support_y[t]), phi
        )
        g = torch.cat([grad[t].flatten() for grad in grads])
        dense += torch.linalg.solve(torch.eye(len(phi), dtype=torch.float64) + hessian / lam, g) / tasks
    assert float(dense.norm()) > 0.1 * scale
    assert float((meta - dense).norm() / dense.norm()) < 1e-6


def test_integer_targets_give_what_float_targets_give():
    """F.mse_loss on Long targets: forward mode cannot type its tangent, so the Hessian products fall back, exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(2, 5, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    y = [torch.randint(0, 3, (2, 5, 1), generator=g) for _ in range(2)]
    learner = maml.MetaLearner(model, torch.nn.functional.mse_loss, 0.1, 3, mode="implicit")
    grads = torch.autograd.grad(learner.meta_loss(maml.TaskBatch(x[0], y[0], x[1], y[1])), list(model.parameters()))
    floats = maml.TaskBatch(x[0], y[0].double(), x[1], y[1].double())
    expected = torch.autograd.grad(learner.meta_loss(floats), list(model.parameters()))
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_evaluation_adapts_as_training_does():
    """Under no_grad (the scripts' validation and test) iMAML adapts on the proximal problem it trains with."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    g = torch.Generator().manual_seed(1)
    batch = maml.TaskBatch(*(torch.randn(3, 5, n, generator=g, dtype=torch.float64) for n in (3, 1, 3, 1)))
    learner = maml.MetaLearner(model, torch.nn.functional.mse_loss, 0.1, 10, mode=maml.Implicit(lam=0.1))
    trained = learner.run(batch)
    with torch.no_grad():
        evaluated = learner.run(batch)
        loss = learner.meta_loss(batch)
    plain = maml.MetaLearner(model, torch.nn.functional.mse_loss, 0.1, 10)
    with torch.no_grad():
        unregularised = plain.run(batch)
    for k, v in trained.fast.items():
        assert torch.allclose(evaluated.fast[k], v, rtol=0, atol=1e-12)
        one = learner.adapt(batch.support_x[1], batch.support_y[1])[k]
        assert torch.allclose(one, v[1], rtol=0, atol=1e-12)
        assert (unregularised.fast[k] - v).abs().max() > 1e-3  # the proximal term matters at lam 0.1
    assert torch.allclose(evaluated.query_losses, trained.query_losses, rtol=0, atol=1e-12)
    assert abs(float(loss) - float(trained.loss.detach())) < 1e-12
