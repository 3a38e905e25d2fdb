"""experiments.omniglot's default is the reference's protocol (cbfinn/maml: main.py, maml.py, utils.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import maml
from experiments import omniglot, peers
from experiments.harness import recipes


def test_the_default_config_is_the_references_for_5_and_20_ways():
    five = omniglot.OmniglotConfig().resolved()
    assert (five.network, five.loss, five.rotations) == ("strided", "reference", "all")
    assert (five.steps, five.inner_lr, five.meta_batch, five.shots, five.query) == (1, 0.4, 32, 1, 1)
    assert (five.meta_lr, five.filters, five.iterations, five.eval_tasks) == (0.001, 64, 60_000, 600)
    twenty = omniglot.OmniglotConfig(ways=20, shots=5).resolved()
    assert (twenty.steps, twenty.inner_lr, twenty.meta_batch, twenty.query) == (5, 0.1, 16, 5)


def test_the_strided_network_has_the_references_shapes_padding_and_initialisation():
    torch.manual_seed(0)
    model = omniglot.build_model(5)
    shapes = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape[1:])))
    model(torch.rand(3, 1, 28, 28))
    convs = [s for s, layer in zip(shapes, model) if isinstance(layer, nn.Conv2d)]
    assert convs == [(64, 14, 14), (64, 7, 7), (64, 4, 4), (64, 2, 2)]
    assert shapes[-2:] == [(64,), (5,)]  # the mean over the 2x2 positions, then the linear layer
    # TensorFlow's 'SAME' at stride 2: the odd pixel of padding at the bottom and right (28 -> pad 0, 1).
    conv, x = model[0], torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(conv(x), F.conv2d(F.pad(x, (0, 1, 0, 1)), conv.weight, conv.bias, stride=2))
    # Batch norm: an offset and no scale, epsilon 1e-3, the batch's statistics.
    norm = model[1]
    assert [n for n, _ in norm.named_parameters()] == ["offset"] and norm.eps == 1e-3
    assert not list(model.buffers())
    # Xavier-uniform convolutions, a standard-normal output layer, zero biases and offsets.
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            fan_in, fan_out = layer.weight[0].numel(), layer.weight[:, 0].numel()
            assert layer.weight.abs().max() <= math.sqrt(6 / (fan_in + fan_out))
            assert not layer.bias.any()
    head = model[-1]
    assert 0.8 < head.weight.std() < 1.2 and not head.bias.any()
    assert omniglot.meta_only(model) == {"1.offset", "4.offset", "7.offset", "10.offset"}


def test_the_inner_step_is_the_references_sum_of_per_example_losses_over_k_at_update_lr():
    """One batch, second order: our fast weights are a hand-written step on sum(CE_i) / K at update_lr 0.4.

    The reference's ``xent`` is ``softmax_cross_entropy_with_logits / update_batch_size``, a vector;
    ``tf.gradients`` differentiates its sum. Its batch-norm offsets are outside ``weights``: not adapted.
    """
    cfg = omniglot.OmniglotConfig().resolved()
    torch.manual_seed(0)
    model = omniglot.build_model(cfg.ways).double()
    g = torch.Generator().manual_seed(1)
    ways, shots, tasks_ = cfg.ways, cfg.shots, 3
    x = torch.rand(tasks_, ways * shots, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.arange(ways).repeat_interleave(shots).expand(tasks_, -1)
    batch = maml.TaskBatch(x, y, x.flip(1), y.flip(1))
    learner = maml.MetaLearner(
        model,
        omniglot.loss_function(cfg.loss, ways),
        inner_lr=cfg.inner_lr,
        steps=cfg.steps,
        adapt=recipes.adapt_set(model, cfg.adapt, omniglot.meta_only(model)),
    )
    fast = learner.run(batch).fast
    adapted = {k: v for k, v in model.named_parameters() if not k.endswith("offset")}
    assert set(fast) == set(adapted)
    for t in range(tasks_):
        loss = F.cross_entropy(model(x[t]), y[t], reduction="none").sum() / shots
        grads = torch.autograd.grad(loss, list(adapted.values()))
        for (name, p), grad in zip(adapted.items(), grads):
            torch.testing.assert_close(fast[name][t], p - 0.4 * grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["maml", "anil"])
def test_adapt_sets_leave_the_batch_norm_offsets_to_the_outer_loop(algorithm):
    model = omniglot.build_model(5, filters=4)
    adapt = recipes.adapt_set(
        model, recipes.recipe(omniglot.OmniglotConfig, algorithm).get("adapt", "all"), omniglot.meta_only(model)
    )
    learner = maml.MetaLearner(model, F.cross_entropy, inner_lr=0.4, adapt=adapt)
    expected = (
        ["13.weight", "13.bias"]
        if algorithm == "anil"
        else [n for n in dict(model.named_parameters()) if "offset" not in n]
    )
    assert list(learner.adapted) == expected
    # ...and the outer loop learns them: their meta-gradient is not zero.
    x = torch.rand(2, 5, 1, 28, 28)
    y = torch.arange(5).expand(2, -1)
    learner.meta_loss(maml.TaskBatch(x, y, x, y)).backward()
    assert all(model[i].offset.grad.abs().sum() > 0 for i in (1, 4, 7, 10))


def test_the_maxpool_network_and_mean_loss_stay_reachable():
    model = omniglot.build_model(5, filters=8, network="maxpool")
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 5)
    assert omniglot.meta_only(model) == set()
    logits, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(omniglot.loss_function("mean", 5)(logits, y), F.cross_entropy(logits, y))
    torch.testing.assert_close(omniglot.loss_function("reference", 5)(logits, y), 5 * F.cross_entropy(logits, y))


@pytest.mark.parametrize("mode", ["second_order", "first_order"])
def test_the_learn2learn_engine_computes_the_toolkits_meta_gradient(mode):
    """The peer row trains with learn2learn's MAML; on one batch its meta-loss and meta-gradient are the toolkit's."""
    torch.manual_seed(0)
    model = omniglot.build_model(5, filters=8).double()
    learner = maml.MetaLearner(
        model,
        omniglot.loss_function("reference", 5),
        inner_lr=0.4,
        steps=2,
        mode=mode,
        adapt=recipes.adapt_set(model, "all", omniglot.meta_only(model)),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 5, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.arange(5).expand(3, -1)
    batch = maml.TaskBatch(x, y, x.flip(1), y.flip(1))
    peer = peers.Learn2LearnMAML(learner)
    ours, theirs = learner.run(batch), peer.run(batch)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(ours.loss, params), torch.autograd.grad(theirs.loss, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for field in ("query_losses", "query_out", "support_losses"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours.fast, theirs.fast, rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # evaluation is the toolkit's
        torch.testing.assert_close(peer.run(batch).query_out, learner.run(batch).query_out)


def test_the_learn2learn_engine_refuses_what_its_maml_does_not_have():
    cfg = omniglot.OmniglotConfig(engine="learn2learn", learn_inner_lr="per_parameter")
    with pytest.raises(
        ValueError,
        match=r"^--engine learn2learn runs learn2learn's MAML .* so --learn-inner-lr "
        r"per_parameter does not apply; drop it or use --engine maml\.$",
    ):
        omniglot.validate_config(cfg)
    with pytest.raises(ValueError, match="not --mode checkpointed"):
        omniglot.validate_config(omniglot.OmniglotConfig(engine="learn2learn", mode="checkpointed"))
