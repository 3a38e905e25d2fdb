"""The inner step reaches the model: ``forward(x, step=k)`` in every pass, every mode; per-step batch norm.

Float64. The reference is a hand-written MAML loop over one task at a time that calls the model
with the step index: the support pass of update k and the query pass after
update k get ``step=k``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT_PATHS, finite_difference_error
from torch import nn
from torch.func import functional_call

import maml

STEPS, LR = 3, 0.2


class StepNet(nn.Module):
    """Conv, per-step batch norm (MAML++'s BNWB), ReLU, linear; the output also scales with the step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.norm = maml.nn.StepBatchNorm2d(3, STEPS)
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x), step))
        return self.head(h.flatten(1)) * (1 + 0.1 * step)


def net() -> StepNet:
    torch.manual_seed(0)
    model = StepNet().double()
    with torch.no_grad():  # per-step rows that differ, so a wrong index shows
        model.norm.weight.add_(0.2 * torch.randn(model.norm.weight.shape, dtype=torch.float64))
        model.norm.bias.add_(0.2 * torch.randn(model.norm.bias.shape, dtype=torch.float64))
    return model


def batch() -> maml.TaskBatch:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 1, 6, 6, generator=g, dtype=torch.float64)
    q = torch.randn(3, 6, 1, 6, 6, generator=g, dtype=torch.float64)
    return maml.TaskBatch(x, torch.randint(0, 3, (3, 6), generator=g), q, torch.randint(0, 3, (3, 6), generator=g))


def reference(model: nn.Module, b: maml.TaskBatch, step_weights: torch.Tensor | None) -> list[torch.Tensor]:
    """Meta-gradient of a hand-written second-order MAML loop, one task at a time."""
    params = dict(model.named_parameters())
    total = 0.0
    for t in range(b.num_tasks):
        fast = dict(params)
        task = 0.0
        for k in range(STEPS):
            out = functional_call(model, fast, (b.support_x[t],), {"step": k})
            grads = torch.autograd.grad(F.cross_entropy(out, b.support_y[t]), list(fast.values()), create_graph=True)
            fast = {n: p - LR * g for (n, p), g in zip(fast.items(), grads)}
            if step_weights is not None or k == STEPS - 1:
                query = F.cross_entropy(functional_call(model, fast, (b.query_x[t],), {"step": k}), b.query_y[t])
                task = task + (query if step_weights is None else step_weights[k] * query)
        total = total + task
    return list(torch.autograd.grad(total / b.num_tasks, list(params.values())))


MODES = [pytest.param({"batching": "vmap"}, id="vmap"), *EXACT_PATHS]
# Every path with the last step's loss and with the multi-step loss, but the compiled one (a slow compilation
# each) with the multi-step loss alone, which holds the last step's query pass too.
CASES = [
    pytest.param(mode.values[0], multi, id=f"{mode.id}-{'multi-step-loss' if multi else 'last-step'}")
    for mode in MODES
    for multi in (False, True)
    if multi or not mode.values[0].get("compile")
]


@pytest.mark.parametrize("options, multi_step", CASES)
def test_every_pass_gets_its_inner_step_in_every_mode(options, multi_step):
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64) if multi_step else None
    expected = reference(net(), batch(), weights)
    model = net()
    learner = maml.MetaLearner(model, F.cross_entropy, LR, STEPS, **{"batching": "vmap", **options})
    learner.meta_loss(batch(), step_weights=weights).backward()
    for (name, p), g in zip(model.named_parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-10, msg=name)


def test_per_step_batch_norm_matches_finite_differences():
    learner = maml.MetaLearner(net(), F.cross_entropy, LR, STEPS)
    assert finite_difference_error(learner, batch()) < 1e-6


def test_a_step_past_the_last_row_uses_the_last_row_and_sizes_are_checked():
    norm = maml.nn.StepBatchNorm2d(2, 2).double()
    with torch.no_grad():
        norm.weight[1] = 3.0
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(norm(x, step=5), norm(x, step=1))
    with pytest.raises(ValueError, match=r"StepBatchNorm2d: steps=0 must be an int >= 1"):
        maml.nn.StepBatchNorm2d(2, 0)


def test_a_model_without_step_is_called_without_it():
    calls = []

    class Plain(nn.Linear):
        def forward(self, x):  # no step: called as before
            calls.append(x.shape)
            return super().forward(x)

    learner = maml.MetaLearner(Plain(2, 1).double(), F.mse_loss, 0.1, 2, batching="loop")
    x = torch.randn(2, 4, 2, dtype=torch.float64)
    learner.meta_loss(maml.TaskBatch(x, x[..., :1], x, x[..., :1])).backward()
    assert calls


class NoStep(torch.nn.Module):
    """A custom model whose forward takes no step around a per-step batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = maml.nn.StepSequential(torch.nn.Conv2d(1, 2, 3), maml.nn.StepBatchNorm2d(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).flatten(1)


@pytest.mark.parametrize(
    "model, where",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), maml.nn.StepBatchNorm2d(2, 3)),
            "'1' takes the inner step, but the model, a plain nn.Sequential, does not",
        ),
        (
            lambda: maml.nn.StepSequential(
                torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), maml.nn.StepBatchNorm2d(2, 3))
            ),
            "'0.1' takes the inner step, but the nn.Sequential '0' does not",
        ),
        (NoStep, "'body.1' takes the inner step, but the model's forward (NoStep.forward) does not"),
    ],
)
def test_a_per_step_batch_norm_the_step_cannot_reach_is_refused(model, where):
    with pytest.raises(ValueError, match="^StepBatchNorm2d " + re.escape(where) + ".*maml.nn.StepSequential"):
        maml.MetaLearner(model(), torch.nn.functional.cross_entropy, 0.1, 3)
