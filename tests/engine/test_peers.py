"""The same meta-gradient as learn2learn's MAML and higher's innerloop_ctx (float64, no norm layers).

Both peers are installed by scripts/setup.sh, so these tests run in CI rather than skip.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import make

import maml

with warnings.catch_warnings():  # gym, imported by learn2learn, warns about its own deprecation
    warnings.simplefilter("ignore")
    import higher
    import learn2learn as l2l

INNER_LR = 0.1
CASES = ["mlp", "conv_groupnorm"]  # conv_groupnorm: convolutions and max-pool, per-task norm statistics


def ours(case: str, steps: int, mode: str, batching: str) -> list[torch.Tensor]:
    model, batch, loss_fn = make(case)
    learner = maml.MetaLearner(model, loss_fn, inner_lr=INNER_LR, steps=steps, mode=mode, batching=batching)
    learner.meta_loss(batch).backward()
    return [p.grad for p in model.parameters()]


def learn2learn_grads(case: str, steps: int, first_order: bool) -> list[torch.Tensor]:
    model, batch, loss_fn = make(case)
    meta = l2l.algorithms.MAML(model, lr=INNER_LR, first_order=first_order)
    for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
        task = meta.clone()
        for _ in range(steps):
            task.adapt(loss_fn(task(sx), sy))
        (loss_fn(task(qx), qy) / batch.num_tasks).backward()
    return [p.grad for p in model.parameters()]


def higher_grads(case: str, steps: int) -> list[torch.Tensor]:
    model, batch, loss_fn = make(case)
    inner_opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
        with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, diffopt):
            for _ in range(steps):
                diffopt.step(loss_fn(fmodel(sx), sy))
            (loss_fn(fmodel(qx), qy) / batch.num_tasks).backward()
    return [p.grad for p in model.parameters()]


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-13), (g - e).abs().max()


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_second_order_equals_learn2learn(case, steps, batching):
    expected = learn2learn_grads(case, steps, first_order=False)
    assert_same(ours(case, steps, "second_order", batching), expected)
    assert_same(ours(case, steps, "checkpointed", batching), expected)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_first_order_equals_learn2learn_first_order(case, steps, batching):
    assert_same(ours(case, steps, "first_order", batching), learn2learn_grads(case, steps, first_order=True))


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_second_order_equals_higher(case, steps, batching):
    assert_same(ours(case, steps, "second_order", batching), higher_grads(case, steps))


def test_the_peers_differ_between_first_and_second_order():
    # Guards the comparisons above against a peer whose first_order flag does nothing.
    so, fo = learn2learn_grads("mlp", 3, False), learn2learn_grads("mlp", 3, True)
    assert max(float((a - b).abs().max()) for a, b in zip(so, fo)) > 1e-3
