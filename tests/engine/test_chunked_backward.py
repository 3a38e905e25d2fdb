"""``learner.backward(batch)``: the meta-gradient a chunk of tasks at a time equals ``meta_loss().backward()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make
from torch import nn

import maml

CASES = [
    pytest.param({"batching": "vmap"}, "sgd", id="second_order-vmap"),
    pytest.param({"batching": "loop"}, "adam", id="second_order-loop-adam"),
    pytest.param({"mode": "first_order"}, "momentum", id="first_order-momentum"),
    pytest.param({"mode": maml.Checkpointed(every=2)}, "sgd", id="checkpointed"),
    pytest.param({"learn_inner_lr": "per_layer_per_step"}, "sgd", id="lslr"),
    pytest.param({}, "metacurvature", id="meta-curvature"),
    pytest.param({"mode": "reptile"}, "sgd", id="reptile"),
    pytest.param({"mode": "implicit"}, "sgd", id="implicit"),
]


@pytest.mark.parametrize("options, rule", CASES)
@pytest.mark.parametrize("multi_step", [False, True], ids=["last", "msl"])
def test_backward_by_chunks_equals_one_backward(options, rule, multi_step):
    if multi_step and options.get("mode") in ("reptile", "implicit"):
        pytest.skip("no multi-step loss without an unrolled inner loop")
    weights = torch.tensor([0.3, 0.7], dtype=torch.float64) if multi_step else None

    def grads(chunked: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.set_default_dtype(torch.float64)
        try:
            model, batch, loss_fn = make("conv_groupnorm")
        finally:
            torch.set_default_dtype(torch.float32)
        inner = maml.MetaCurvature(model) if rule == "metacurvature" else rule
        learner = maml.MetaLearner(model, loss_fn, 0.1, 2, inner_optimizer=inner, **options)
        loss = learner.backward(batch, weights, chunk=2) if chunked else learner.meta_loss(batch, weights)
        if not chunked:
            loss.backward()
        return loss.detach(), [p.grad for p in learner.parameters()]

    (loss, ours), (ref_loss, ref) = grads(True), grads(False)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["second_order", "implicit"])
def test_the_output_of_a_chunked_backward_is_that_of_one_run(mode):
    """``return_output=True``: the chunks' outputs joined are what ``run`` returns for the whole batch."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = maml.MetaLearner(net, F.mse_loss, 0.1, steps=2, mode=mode, batching="loop")
    batch = maml.TaskBatch(*(torch.randn(5, 4, 1, dtype=torch.float64) for _ in range(4)))
    weights = None if mode == "implicit" else torch.tensor([0.25, 0.75], dtype=torch.float64)
    whole = learner.run(batch, step_weights=weights)
    joined = learner.backward(batch, weights, chunk=2, return_output=True)
    torch.testing.assert_close(joined.loss, whole.loss.detach(), rtol=1e-12, atol=0)
    for field in ("query_losses", "query_out", "support_losses", "step_query_losses"):
        got, want = getattr(joined, field), getattr(whole, field)
        assert (got is None) == (want is None), field
        if want is not None:
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
    for k in whole.fast:
        torch.testing.assert_close(joined.fast[k], whole.fast[k].detach(), rtol=1e-12, atol=1e-14)
        assert not joined.fast[k].requires_grad


@pytest.mark.parametrize("mode", ["second_order", "first_order"])
def test_backward_by_chunks_reaches_a_trainable_encoder_once(mode):
    """Inputs from an encoder are shared by every chunk: its gradient is the one-pass gradient."""
    model, batch, loss_fn = make("mlp")
    torch.manual_seed(0)
    encoder = nn.Linear(batch.support_x.shape[-1], batch.support_x.shape[-1]).double()
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, mode=mode)
    grads = []
    for chunk in (None, 1, 2):
        encoder.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        encoded = maml.TaskBatch(encoder(batch.support_x), batch.support_y, encoder(batch.query_x), batch.query_y)
        if chunk is None:
            learner.meta_loss(encoded).backward()
        else:
            learner.backward(encoded, chunk=chunk)
        grads.append(torch.cat([p.grad.flatten() for p in [*encoder.parameters(), *model.parameters()]]))
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0], rtol=0, atol=1e-13)
