"""Every mode evaluates as it trains: ``run`` under ``torch.no_grad()`` and ``adapt`` give the training path's values."""

from __future__ import annotations

import pytest
import torch
from helpers import make

import maml

# The options that pick another path inside a mode, each with its evaluation.
PATHS = [
    pytest.param("second_order", {}, id="second_order"),
    pytest.param("first_order", {}, id="first_order"),
    pytest.param("checkpointed", {}, id="checkpointed"),
    pytest.param(maml.Checkpointed(every=2, hvp="forward_over_reverse"), {}, id="checkpointed-fwd"),
    pytest.param("reptile", {}, id="reptile"),
    pytest.param(maml.Implicit(lam=0.1), {}, id="implicit"),
]


def test_the_table_holds_every_mode():
    assert {maml.Mode.of(p.values[0]).name for p in PATHS} == set(maml.MODES)


@pytest.mark.parametrize("case", ["mlp", "conv_batchnorm_maxpool"])
@pytest.mark.parametrize("mode, options", PATHS)
def test_run_without_gradients_adapts_as_training_does(case, mode, options):
    model, batch, loss_fn = make(case)
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=3, mode=mode, batching="vmap", **options)
    trained = learner.run(batch)
    with torch.no_grad():
        evaluated = learner.run(batch)
    torch.testing.assert_close(evaluated.query_losses, trained.query_losses.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(evaluated.support_losses, trained.support_losses.detach(), rtol=1e-12, atol=1e-14)
    for k, fast in trained.fast.items():
        torch.testing.assert_close(evaluated.fast[k], fast.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode, options", PATHS)
def test_adapt_gives_the_fast_weights_of_run(mode, options):
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=3, mode=mode, batching="vmap", **options)
    with torch.no_grad():
        fast = learner.run(batch).fast
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            one = learner.adapt(batch.support_x[1], batch.support_y[1])
        for k, v in fast.items():
            torch.testing.assert_close(one[k].detach(), v[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["reptile", "implicit"])
def test_step_weights_are_refused_where_no_inner_loop_is_unrolled_with_or_without_gradients(mode):
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, mode=mode)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="drop step_weights"):
            learner.run(batch, step_weights=torch.ones(2, dtype=torch.float64))
