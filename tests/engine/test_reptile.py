"""Reptile: ``mode="reptile"`` leaves the initial minus the adapted weights in ``.grad``.

Float64, against a hand-written Reptile loop over one task at a time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make
from torch.func import functional_call

import maml

STEPS, LR = 4, 0.05


def hand_written(model: torch.nn.Module, batch: maml.TaskBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reptile's direction ``theta - mean_t phi_t`` and the mean query loss at the adapted weights."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    adapted, losses = [], []
    for t in range(batch.num_tasks):
        fast = dict(params)
        for _ in range(STEPS):
            fast = {k: v.requires_grad_() for k, v in fast.items()}
            loss = F.mse_loss(functional_call(model, fast, (batch.support_x[t],)), batch.support_y[t])
            grads = torch.autograd.grad(loss, list(fast.values()))
            fast = {k: (v - LR * g).detach() for (k, v), g in zip(fast.items(), grads)}
        adapted.append(fast)
        losses.append(F.mse_loss(functional_call(model, fast, (batch.query_x[t],)), batch.query_y[t]))
    direction = [params[k] - torch.stack([a[k] for a in adapted]).mean(0) for k in params]
    return direction, torch.stack(losses).mean()


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_reptile_leaves_the_initial_minus_the_mean_adapted_weights_in_grad(batching):
    torch.set_default_dtype(torch.float64)
    try:
        model, batch, _ = make("mlp")
    finally:
        torch.set_default_dtype(torch.float32)
    direction, query_loss = hand_written(model, batch)
    learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, mode="reptile", batching=batching)
    loss = learner.meta_loss(batch)
    loss.backward()
    torch.testing.assert_close(loss.detach(), query_loss, rtol=0, atol=1e-12)
    for p, d in zip(model.parameters(), direction, strict=True):
        torch.testing.assert_close(p.grad, d, rtol=0, atol=1e-12)
    # Any optimizer applies it: SGD with lr eps is the paper's theta + eps * (mean phi - theta).
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    for p, b, d in zip(model.parameters(), before, direction):
        torch.testing.assert_close(p.detach(), b - 0.5 * d, rtol=0, atol=1e-12)


def test_reptile_refuses_what_it_cannot_learn():
    model, _, _ = make("mlp")
    for kwargs, what in (
        ({"learn_inner_lr": "scalar"}, "learn_inner_lr='scalar'"),
        ({"compile": True}, "compile=True"),
        ({"inner_optimizer": maml.MetaCurvature(model)}, "the rule MetaCurvature's own tensors"),
    ):
        with pytest.raises(ValueError, match=rf"^mode='reptile' with {what}: Reptile moves"):
            maml.MetaLearner(model, F.mse_loss, LR, STEPS, mode="reptile", **kwargs)
    learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, mode="reptile")
    _, batch, _ = make("mlp")
    with pytest.raises(ValueError, match="mode='reptile' differentiates none: drop step_weights"):
        learner.meta_loss(batch, step_weights=torch.ones(STEPS))
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(learner.meta_loss(batch), list(model.parameters()), create_graph=True)


def test_reptile_refuses_a_trained_parameter_it_would_never_move():
    model, batch, _ = make("mlp")
    head = [name for name, _ in model.named_parameters()][-2:]
    learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, mode="reptile", adapt=head)
    with pytest.raises(
        ValueError, match=r"^mode='reptile' needs every trainable parameter adapted .* 0\.bias, 0\.weight"
    ):
        learner.meta_loss(batch)
    for name, p in model.named_parameters():  # frozen, they are left alone as asked
        p.requires_grad_(name in head)
    learner.meta_loss(batch).backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if name in head)
