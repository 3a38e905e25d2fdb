"""The checkpointed mode's forward-over-reverse backward (``maml.Checkpointed(hvp="forward_over_reverse")``).

Every meta-gradient is held, in float64, against second order's (the engine's own exact mode,
itself proven against an independent reference, higher and finite differences in
tests/engine/test_family.py and tests/engine/test_meta_gradients.py): the largest difference over every
meta-parameter, relative to the norm of the meta-gradient, must be below 1e-10. Tiny models and
two or three tasks keep the file fast; each property has a test of its own.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import finite_difference_error, image_batch, perturbed, regression_batch
from torch import Tensor, nn

import maml

DTYPE = torch.float64
FOR = maml.Checkpointed(hvp="forward_over_reverse")
Loss = Callable[[Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------- models


def mlp(norm: Callable[[int], nn.Module] | None = None, act: type[nn.Module] = nn.Tanh, out: int = 1) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(3, 6)]
    if norm is not None:
        layers.append(norm(6))
    body = nn.Sequential(*layers, act(), nn.Linear(6, 6), act())
    return nn.Sequential(OrderedDict(body=body, head=nn.Linear(6, out)))


def conv(norm: Callable[[int], nn.Module]) -> nn.Module:
    # 6x6 images -> 2 channels of 3x3 after pooling -> 3 ways.
    body = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), norm(2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    return nn.Sequential(OrderedDict(body=body, head=nn.Linear(18, 3)))


def generic(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in float64 at a generic point (norm affine parameters not exactly 1/0)."""
    torch.manual_seed(seed)
    return perturbed(model)


def regression(tasks: int = 3, n: int = 4, out: int = 1, seed: int = 1) -> maml.TaskBatch:
    return regression_batch(torch.Generator().manual_seed(seed), tasks, n, outputs=out)


def images(tasks: int = 3, ways: int = 3, shots: int = 1, query: int = 2, seed: int = 1) -> maml.TaskBatch:
    return image_batch(torch.Generator().manual_seed(seed), tasks, ways, shots, query, side=6)


NORMS: dict[str, tuple[Callable[[], nn.Module], Callable[[], maml.TaskBatch], Loss]] = {
    "batchnorm1d": (lambda: mlp(lambda c: nn.BatchNorm1d(c, track_running_stats=False)), regression, F.mse_loss),
    "layernorm": (lambda: mlp(nn.LayerNorm), regression, F.mse_loss),
    "batchnorm2d": (lambda: conv(lambda c: nn.BatchNorm2d(c, track_running_stats=False)), images, F.cross_entropy),
    "groupnorm": (lambda: conv(lambda c: nn.GroupNorm(1, c)), images, F.cross_entropy),
    "instancenorm": (lambda: conv(lambda c: nn.InstanceNorm2d(c, affine=True)), images, F.cross_entropy),
}


# ------------------------------------------------------------------------------------ comparison


def spread(learner: maml.MetaLearner) -> None:
    """Gives every learnable rate its own value, so a mix-up between parameters or steps cannot cancel out."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rate in learner.rate_parameters.values():
            rate.mul_(1 + 0.5 * torch.rand(rate.shape, generator=g, dtype=rate.dtype))


def meta_grad(
    learner: maml.MetaLearner, batch: maml.TaskBatch, step_weights: Tensor | None = None, seed: int | None = None
) -> Tensor:
    """The meta-gradient over every meta-parameter, flattened (``seed``: the random stream before the call)."""
    if seed is not None:
        torch.manual_seed(seed)
    params = [p for p in learner.parameters() if p.requires_grad]
    grads = torch.autograd.grad(learner.meta_loss(batch, step_weights=step_weights), params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])


def error(got: Tensor, expected: Tensor) -> float:
    """Largest difference relative to the meta-gradient's norm."""
    assert torch.isfinite(got).all(), "non-finite meta-gradient"
    assert expected.norm() > 0
    return float((got - expected).abs().max() / expected.norm())


def pair(
    model: nn.Module,
    loss_fn: Loss,
    *,
    inner_lr: float = 0.1,
    steps: int = 3,
    every: int | None = None,
    tasks: int | None = None,
    **kw: Any,
) -> tuple[maml.MetaLearner, maml.MetaLearner]:
    """Second order and checkpointed-forward-over-reverse learners on the same model (rates spread alike).

    ``every`` and ``tasks`` are the checkpointed mode's (``maml.Checkpointed``); with vmap,
    ``tasks`` is second order's ``chunk_size`` too (the same tasks batched together).
    """
    chunked = {"chunk_size": tasks} if tasks is not None and kw.get("batching") != "loop" else {}
    second = maml.MetaLearner(model, loss_fn, inner_lr=inner_lr, steps=steps, **kw, **chunked)
    mode = maml.Checkpointed(every=every, hvp="forward_over_reverse", tasks=tasks)
    mixed = maml.MetaLearner(model, loss_fn, inner_lr=inner_lr, steps=steps, mode=mode, **kw)
    spread(second)
    spread(mixed)
    return second, mixed


def assert_exact(
    model: nn.Module, loss_fn: Loss, batch: maml.TaskBatch, step_weights: Tensor | None = None, **kw: Any
) -> None:
    second, mixed = pair(model, loss_fn, **kw)
    assert error(meta_grad(mixed, batch, step_weights), meta_grad(second, batch, step_weights)) < 1e-10


# ------------------------------------------------------------------------- rules x learnable rates

RULES = {
    "sgd": {},
    "momentum": {"inner_optimizer": "momentum", "inner_optimizer_options": {"momentum": 0.9}},
    "nesterov": {"inner_optimizer": "momentum", "inner_optimizer_options": {"momentum": 0.8, "nesterov": True}},
    "adam": {"inner_optimizer": "adam", "inner_optimizer_options": {"betas": (0.8, 0.99), "eps": 1e-6}},
}
RATE_LR = {"sgd": 0.1, "momentum": 0.05, "nesterov": 0.05, "adam": 0.02}


@pytest.mark.parametrize("learn_inner_lr", [None, "scalar", "per_parameter", "per_layer_per_step"])
@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_and_rate_equals_second_order(rule, learn_inner_lr):
    # 3 steps in segments of 2: the rule's state crosses a segment, and a segment has a step
    # whose gradient the replay kept and a last one whose gradient it did not.
    batching = "vmap" if learn_inner_lr in ("scalar", "per_layer_per_step") else "loop"
    assert_exact(
        generic(mlp()),
        F.mse_loss,
        regression(),
        inner_lr=RATE_LR[rule],
        batching=batching,
        learn_inner_lr=learn_inner_lr,
        every=2,
        **RULES[rule],
    )


@pytest.mark.parametrize("batching", ["loop", "vmap"])
def test_adam_with_exactly_zero_gradients_is_finite_and_exact(batching):
    # A dead ReLU unit per layer and a support feature that is always 0: exact zeros in the support
    # gradient, where Adam's second moment stays 0 and its safe square root's derivative is 0.
    model = generic(mlp(act=nn.ReLU))
    with torch.no_grad():
        model.body[0].bias[1] = -50.0
        model.body[2].bias[3] = -50.0
    batch = regression()
    support_x = batch.support_x.clone()
    support_x[..., 0] = 0.0
    batch = maml.TaskBatch(support_x, batch.support_y, batch.query_x, batch.query_y)
    assert_exact(model, F.mse_loss, batch, inner_lr=0.02, batching=batching, every=2, **RULES["adam"])


# -------------------------------------------------------------------------------------- adapt sets


@pytest.mark.parametrize("batching", ["loop", "vmap"])
@pytest.mark.parametrize(
    "adapt, rule",
    [(["head.weight", "head.bias"], "sgd"), (lambda name: name.startswith("body."), "adam")],
    ids=["anil", "boil"],
)
def test_adapt_sets_get_second_order_cross_terms(adapt, rule, batching):
    # The parameters outside the adapt set (a LayerNorm's among them) get the mixed second derivative.
    model = generic(mlp(nn.LayerNorm))
    assert_exact(
        model,
        F.mse_loss,
        regression(),
        inner_lr=RATE_LR[rule],
        batching=batching,
        adapt=adapt,
        learn_inner_lr="per_parameter",
        every=2,
        **RULES[rule],
    )


def test_a_frozen_parameter_outside_the_adapt_set_is_a_constant():
    model = generic(mlp())
    model.body[0].weight.requires_grad_(False)
    assert_exact(
        model, F.mse_loss, regression(), batching="loop", adapt=["head.weight", "head.bias"], **RULES["momentum"]
    )


# ------------------------------------------------------------------------------------- norm layers


@pytest.mark.parametrize("batching", ["loop", "vmap"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_every_norm_family_equals_second_order(norm, batching):
    # Under vmap, jvp(grad(vmap)) is exact where reverse-over-reverse batching rules are not.
    build, batch, loss_fn = NORMS[norm]
    lr = 0.3 if loss_fn is F.cross_entropy else 0.1
    assert_exact(generic(build()), loss_fn, batch(), inner_lr=lr, batching=batching, steps=2, learn_inner_lr="scalar")


# ---------------------------------------------------------------------- chunks, segments, batching


@pytest.mark.parametrize("batching", ["loop", "vmap"])
@pytest.mark.parametrize("chunk_size, steps, every", [(1, 4, 3), (2, 5, 2), (None, 3, 3), (2, 2, 1)])
def test_chunks_and_segments_equal_second_order(chunk_size, steps, every, batching):
    # 3 tasks in chunks of 1 or 2 (a ragged last one); segments of 1 to all steps, ragged too.
    build, batch, loss_fn = NORMS["batchnorm2d"]
    second, mixed = pair(
        generic(build()),
        loss_fn,
        inner_lr=0.3,
        steps=steps,
        batching=batching,
        tasks=chunk_size,
        every=every,
        learn_inner_lr="per_layer_per_step",
        **RULES["nesterov"],
    )
    b = batch()
    assert error(meta_grad(mixed, b), meta_grad(second, b)) < 1e-10
    a, e = mixed.run(b), second.run(b)
    for field in ("loss", "query_losses", "query_out", "support_losses"):
        assert torch.allclose(getattr(a, field), getattr(e, field), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batching", ["loop", "vmap"])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_step_weights_equal_second_order(rule, batching):
    # MAML++'s multi-step loss: the query score after every step is pulled back inside the segments.
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=DTYPE)
    assert_exact(
        generic(mlp()),
        F.mse_loss,
        regression(),
        weights,
        inner_lr=RATE_LR[rule],
        steps=4,
        batching=batching,
        tasks=2,
        every=3,
        learn_inner_lr="per_layer_per_step",
        adapt=["head.weight", "head.bias", "body.2.weight"],
        **RULES[rule],
    )


# ----------------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("batching, chunk_size, every", [("loop", 2, 2), ("vmap", 2, 3), ("vmap", None, 1)])
def test_dropout_draws_second_orders_masks(batching, chunk_size, every):
    # Every replayed forward pass (the values, the jvp over grad, the query scores) restores its
    # step's random-number state: the same masks, losses and meta-gradient as second order.
    model = generic(nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1)))
    batch = regression()
    second, mixed = pair(model, F.mse_loss, inner_lr=0.3, steps=3, batching=batching, tasks=chunk_size, every=every)
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=DTYPE)
    assert error(meta_grad(mixed, batch, weights, seed=5), meta_grad(second, batch, weights, seed=5)) < 1e-10
    torch.manual_seed(5)
    a = mixed.run(batch, step_weights=weights)
    torch.manual_seed(5)
    e = second.run(batch, step_weights=weights)
    for field in ("loss", "query_losses", "support_losses", "step_query_losses"):
        assert torch.allclose(getattr(a, field), getattr(e, field), rtol=1e-12, atol=1e-14)
    assert (
        error(meta_grad(mixed, batch, weights, seed=6), meta_grad(second, batch, weights, seed=5)) > 1e-6
    )  # other masks


# -------------------------------------------------------------------------------------------- losses


def targets(batch: maml.TaskBatch, kind: Callable[[Tensor], Tensor]) -> maml.TaskBatch:
    return maml.TaskBatch(batch.support_x, kind(batch.support_y), batch.query_x, kind(batch.query_y))


# loss, targets from (T, n, out) Gaussian ones, out
LOSSES: dict[str, tuple[Loss, Callable[[maml.TaskBatch], maml.TaskBatch], int]] = {
    # F.mse_loss inside jvp(grad(...)) raises "ZeroTensors are immutable" for a target without a tangent.
    "mse_loss": (F.mse_loss, lambda b: b, 1),
    "cross_entropy": (F.cross_entropy, lambda b: targets(b, lambda y: y.argmax(-1)), 3),  # class labels
    "cross_entropy_soft": (F.cross_entropy, lambda b: targets(b, lambda y: y.softmax(-1)), 3),  # probabilities
}


@pytest.mark.parametrize("batching", ["loop", "vmap"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_losses(loss, batching):
    loss_fn, make_targets, out = LOSSES[loss]
    batch = make_targets(regression(out=out))
    assert_exact(
        generic(mlp(out=out)), loss_fn, batch, batching=batching, adapt=["head.weight", "head.bias", "body.0.bias"]
    )


class Attention(nn.Module):
    """Self-attention over sequences ``(n, 4, 3)`` by ``F.scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(3, 6)
        self.head = nn.Linear(2, 1)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(-2))


@pytest.mark.parametrize("batching", ["loop", "vmap"])
def test_attention_runs_on_the_math_kernel(batching):
    g = torch.Generator().manual_seed(1)
    batch = maml.TaskBatch(*(torch.randn(2, 3, *s, generator=g, dtype=DTYPE) for s in [(4, 3), (1,), (4, 3), (1,)]))
    assert_exact(generic(Attention()), F.mse_loss, batch, batching=batching, steps=2)


def test_matches_finite_differences():
    build, batch, loss_fn = NORMS["batchnorm2d"]
    learner = maml.MetaLearner(
        generic(build()),
        loss_fn,
        inner_lr=0.3,
        steps=3,
        batching="loop",
        learn_inner_lr="per_parameter",
        mode=maml.Checkpointed(every=2, hvp="forward_over_reverse"),
        **RULES["momentum"],
    )
    spread(learner)
    assert finite_difference_error(learner, batch()) < 1e-6


# ------------------------------------------------------------------------------ the switch and errors


def raises(exc: type[Exception], text: str) -> Any:
    return pytest.raises(exc, match=re.escape(text))


def test_default_is_reverse_over_reverse_and_the_switch_is_settable():
    model, batch = generic(mlp()), regression()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=2, mode="checkpointed", learn_inner_lr="scalar")
    assert learner.mode == maml.Checkpointed() and learner.mode.hvp == "reverse_over_reverse"
    assert maml.CHECKPOINT_HVPS == ("reverse_over_reverse", "forward_over_reverse")
    before = meta_grad(learner, batch)
    learner.mode = FOR
    assert error(meta_grad(learner, batch), before) < 1e-10
    with raises(
        ValueError,
        "Checkpointed.hvp='forward-over-reverse' is not supported (did you mean 'forward_over_reverse'?); "
        "choose one of 'reverse_over_reverse', 'forward_over_reverse'.",
    ):
        learner.mode = maml.Checkpointed(hvp="forward-over-reverse")


def test_error_unknown_checkpoint_hvp():
    with raises(
        ValueError,
        "Checkpointed.hvp='reverse_over_revers' is not supported (did you mean 'reverse_over_reverse' "
        "or 'forward_over_reverse'?); "
        "choose one of 'reverse_over_reverse', 'forward_over_reverse'.",
    ):
        maml.Checkpointed(hvp="reverse_over_revers")


def test_the_options_of_one_mode_name_the_mode_that_takes_them():
    """Options of the checkpointed mode, and iMAML's, are their mode objects' own (one release of help)."""
    learner = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1)
    for name, way in [
        ("checkpoint_hvp", "maml.Checkpointed(hvp=...)"),
        ("checkpoint_every", "maml.Checkpointed(every=...)"),
        ("implicit", "maml.Implicit(lam=..., cg_iterations=...)"),
    ]:
        with raises(AttributeError, f"MetaLearner.{name} is the mode's own now: set learner.mode = {way}."):
            setattr(learner, name, None)
    with raises(ValueError, "chunk_size=2 is tasks per vmapped call; the checkpointed mode's tasks replayed together"):
        maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, mode="checkpointed", chunk_size=2)
    with raises(ValueError, "Mode('checkpointed') has options: pass mode='checkpointed' or maml.Checkpointed(...)."):
        maml.Mode("checkpointed")


def test_a_loss_without_forward_mode_derivatives_names_the_switch():
    # PyTorch has no forward-mode derivative of huber_loss_backward; reverse over reverse takes it.
    model, batch = generic(mlp()), regression()
    learner = maml.MetaLearner(model, F.huber_loss, inner_lr=0.1, steps=2, mode=FOR)
    with raises(
        RuntimeError, "Checkpointed(hvp='forward_over_reverse') takes the support loss's Hessian-vector products"
    ):
        meta_grad(learner, batch)
    learner.mode = "checkpointed"
    expected = meta_grad(maml.MetaLearner(model, F.huber_loss, inner_lr=0.1, steps=2), batch)
    assert error(meta_grad(learner, batch), expected) < 1e-10


def test_saved_tensor_hooks_name_the_switch():
    # torch.func refuses saved-tensor hooks (e.g. save_on_cpu) around the backward pass; reverse over reverse runs there.
    model, batch = generic(mlp()), regression()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=2, mode=FOR)
    with (
        torch.autograd.graph.save_on_cpu(),
        raises(RuntimeError, "Use maml.Checkpointed(hvp='reverse_over_reverse') (the default)"),
    ):
        meta_grad(learner, batch)
    expected = meta_grad(learner, batch)
    learner.mode = "checkpointed"
    with torch.autograd.graph.save_on_cpu():
        assert error(meta_grad(learner, batch), expected) < 1e-10


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("mode", [maml.Checkpointed(), maml.Checkpointed(every=2, hvp="forward_over_reverse")])
def test_the_checkpointed_meta_gradient_refuses_to_be_differentiated_again(mode, batching):
    """Its gradients are values (replayed steps' pullbacks): a second derivative is refused, not silently zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    batch = regression_batch(torch.Generator().manual_seed(0))
    learner = maml.MetaLearner(model, F.mse_loss, 0.1, 3, mode=mode, batching=batching)
    with pytest.raises(
        RuntimeError,
        match=r"^mode='checkpointed' computes the meta-gradient from replayed steps, as values: it cannot be "
        r"differentiated again \(backward with create_graph=True, a gradient penalty, gradgradcheck\); use "
        r"mode='second_order'",
    ):
        torch.autograd.grad(learner.meta_loss(batch), list(model.parameters()), create_graph=True)
    learner.meta_loss(batch).backward()  # without create_graph, as ever
    assert all(p.grad is not None for p in model.parameters())
