"""``compile=True``: the same meta-gradients as the eager engine, in float64, through torch.compile.

Each compile takes seconds (tens for the conv nets on 2 cores), so these tests pick configurations
that together cover every code path: vmap with each norm family the trap concerns (batch, layer,
instance norm), the per-task loop, chunks, learnable inner rates, first order, several steps.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import finite_difference_error, flat_grad, make

import maml

pytestmark = pytest.mark.inductor  # the compiler users run (tests/conftest.py)


def pair(
    case: str, steps: int, mode: str = "second_order", **kw
) -> tuple[maml.MetaLearner, maml.MetaLearner, maml.TaskBatch]:
    """An eager and a compiled learner on the same float64 model, and a meta-batch."""
    model, batch, loss_fn = make(case)
    lr = 0.3 if case.startswith("conv") else 0.1
    eager = maml.MetaLearner(model, loss_fn, inner_lr=lr, steps=steps, mode=mode, **kw)
    compiled = maml.MetaLearner(model, loss_fn, inner_lr=lr, steps=steps, mode=mode, compile=True, **kw)
    if eager.rate_parameters:  # equal rates in both, each rate its own value
        with torch.no_grad():
            for rate in eager.rate_parameters.values():
                rate.mul_(
                    1 + 0.5 * torch.rand(rate.shape, generator=torch.Generator().manual_seed(3), dtype=rate.dtype)
                )
        compiled.load_state_dict(eager.state_dict())
    return eager, compiled, batch


def assert_same_run(eager: maml.MetaLearner, compiled: maml.MetaLearner, batch: maml.TaskBatch) -> None:
    expected, got = flat_grad(eager, batch), flat_grad(compiled, batch)
    assert torch.allclose(got, expected, rtol=0, atol=1e-10 * expected.abs().max())
    a, b = eager.run(batch), compiled.run(batch)
    for x, y in [
        (a.loss, b.loss),
        (a.query_losses, b.query_losses),
        (a.query_out, b.query_out),
        (a.support_losses, b.support_losses),
        *((a.fast[k], b.fast[k]) for k in a.fast),
    ]:
        assert x.shape == y.shape
        assert torch.allclose(x.detach(), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "case, steps, kw",
    [
        ("mlp", 2, {"batching": "vmap", "learn_inner_lr": "per_parameter"}),
        ("mlp_batchnorm1d", 1, {"batching": "vmap", "chunk_size": 2}),
        ("conv_batchnorm_maxpool", 1, {"batching": "vmap", "learn_inner_lr": "per_parameter"}),
        ("conv_instancenorm", 1, {"batching": "loop"}),
    ],
    ids=["mlp-vmap-meta_sgd", "batchnorm1d-vmap-chunks", "batchnorm2d-vmap-meta_sgd", "instancenorm-loop"],
)
def test_compiled_equals_eager_second_order(case, steps, kw):
    eager, compiled, batch = pair(case, steps, **kw)
    assert_same_run(eager, compiled, batch)


def test_compiled_matches_finite_differences():
    _, compiled, batch = pair("mlp_layernorm", 2, batching="vmap", learn_inner_lr="scalar")
    assert finite_difference_error(compiled, batch) < 1e-6


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_compiled_first_order_equals_eager_first_order(batching):
    eager, compiled, batch = pair("mlp_batchnorm1d", 2, mode="first_order", batching=batching)
    assert_same_run(eager, compiled, batch)


def test_compiled_loss_joins_the_graph_like_the_eager_one():
    eager, compiled, batch = pair("mlp", 1, batching="vmap")
    params = list(compiled.parameters())

    # Scaled and added to another term, as in a regularized objective.
    def reg() -> torch.Tensor:
        return sum((p**2).sum() for p in params)

    expected = torch.autograd.grad(3 * eager.meta_loss(batch) + reg(), params)
    got = torch.autograd.grad(3 * compiled.meta_loss(batch) + reg(), params)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-14)
    # Initial parameters that come out of a graph of their own (as in nested meta-learning).
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)

    def start() -> dict[str, torch.Tensor]:
        return {k: scale * v for k, v in compiled.model.named_parameters()}

    (ge,) = torch.autograd.grad(eager.run(batch, params=start()).loss, scale)
    (gc,) = torch.autograd.grad(compiled.run(batch, params=start()).loss, scale)
    assert torch.allclose(gc, ge, rtol=1e-10)


def test_compiled_gradient_cannot_be_differentiated_again():
    _, compiled, batch = pair("mlp", 1, batching="vmap")
    params = list(compiled.parameters())
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "cannot be differentiated again (backward with create_graph=True); build the learner with compile=False"
        ),
    ):
        torch.autograd.grad(compiled.meta_loss(batch), params, create_graph=True)


def test_compiled_evaluation_under_no_grad_runs_eagerly():
    eager, compiled, batch = pair("mlp", 2, batching="vmap")
    with torch.no_grad():
        out = compiled.run(batch, steps=4)
    assert not compiled._compiled  # nothing was compiled for an evaluation
    with torch.no_grad():
        expected = eager.run(batch, steps=4)
    assert torch.equal(out.query_losses, expected.query_losses)


def test_a_compiled_step_is_compiled_once_for_a_run():
    """Later meta-batches of the same shapes reuse the first compilation: no state the step reads changes."""
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, batching="vmap", compile=True)
    learner.meta_loss(batch).backward()
    other = maml.TaskBatch(*(t + 0.5 for t in (batch.support_x, batch.support_y, batch.query_x, batch.query_y)))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (other, batch):
            learner.meta_loss(b).backward()


def test_compiled_reports_a_diverged_inner_loss():
    model, batch, loss_fn = make("mlp")
    bad = maml.TaskBatch(batch.support_x.clone(), batch.support_y, batch.query_x, batch.query_y)
    bad.support_x[1, 0, 0] = float("nan")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, compile=True)
    with pytest.raises(
        FloatingPointError,
        match=re.escape("the inner (support) loss is nan for task 1 at inner step 0 (0-based, of 2)"),
    ):
        learner.meta_loss(bad)


def test_compile_arguments():
    model, _, loss_fn = make("mlp")
    with pytest.raises(ValueError, match=re.escape("compile=True applies to mode='second_order' or 'first_order'")):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1, mode="checkpointed", compile=True)
    with pytest.raises(TypeError, match=re.escape("compile must be True or False, got 'yes' (str).")):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1, compile="yes")
