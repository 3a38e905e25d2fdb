"""A learner follows what is set on it after it is built, as one built so would, or refuses in one line.

Float64 against a learner built fresh with the new setting: options set on a live learner, the
model's weights tied or untied after build, a rule's buffer reassigned; and the documented way to
use fast weights (``maml.call``) on a model that uses a module twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, regression_batch
from torch import nn

import maml


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)


def batch(tasks: int = 4) -> maml.TaskBatch:
    return regression_batch(torch.Generator().manual_seed(1), tasks=tasks)


def loss(learner: maml.MetaLearner) -> torch.Tensor:
    return learner.meta_loss(batch()).detach()


@pytest.mark.parametrize(
    "built, change, matters",
    [
        ({}, {"inner_lr": 0.5}, True),
        ({}, {"loss_fn": F.l1_loss}, True),
        ({}, {"steps": 3}, True),
        ({"inner_optimizer": "adam"}, {"inner_lr": 0.05}, True),
        ({"mode": "implicit"}, {"mode": maml.Implicit(lam=0.5)}, True),
        ({}, {"batching": "loop"}, False),  # the same values, by another path
        ({"batching": "vmap"}, {"chunk_size": 2}, False),
        ({"mode": "checkpointed"}, {"mode": maml.Checkpointed(every=1)}, False),
    ],
)
def test_an_option_set_on_a_live_learner_acts_as_built(built, change, matters):
    live = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=2, **built)
    before = loss(live)
    for name, value in change.items():
        setattr(live, name, value)
        assert getattr(live, name) is value
    fresh = maml.MetaLearner(**{"model": mlp(), "loss_fn": F.mse_loss, "inner_lr": 0.1, "steps": 2, **built, **change})
    expected = loss(fresh)
    assert torch.equal(expected, before) is not matters
    assert torch.equal(loss(live), expected)
    assert live.resolved_batching == fresh.resolved_batching
    assert repr(live) == repr(fresh)
    for key, value in change.items():
        assert f"{key}={value!r}" in repr(live) or value.__qualname__ in repr(live)


def test_a_live_setting_keeps_the_meta_gradient_exact():
    live = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=2)
    live.inner_lr, live.loss_fn = 0.3, F.smooth_l1_loss
    fresh = maml.MetaLearner(mlp(), F.smooth_l1_loss, inner_lr=0.3, steps=2)
    for learner in (live, fresh):
        learner.meta_loss(batch()).backward()
    for p, q in zip(live.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    "built, name, value, message",
    [
        ({}, "learn_inner_lr", "scalar", "MetaLearner.learn_inner_lr is fixed at construction; build a new"),
        ({}, "inner_optimizer", "adam", "MetaLearner.inner_optimizer is fixed at construction; build a new"),
        ({}, "model", nn.Linear(3, 1), "MetaLearner.model is fixed at construction; build a new MetaLearner"),
        ({}, "adapt", ["0.weight"], "MetaLearner.adapt is a method; the adapted parameters (learner.adapted)"),
        ({}, "rate_parameters", {}, "MetaLearner.rate_parameters is fixed at construction; set the rates in place"),
        ({}, "inner_Lr", 0.5, "MetaLearner has no option 'inner_Lr'; a live learner takes loss_fn, inner_lr"),
        ({}, "adapted", ("0.weight",), "MetaLearner.adapted is read-only; build a new MetaLearner(..., adapt=...)"),
        ({"learn_inner_lr": "scalar"}, "inner_lr", 0.5, "MetaLearner.inner_lr is the initial value of the learnable"),
        ({"learn_inner_lr": "per_layer_per_step"}, "steps", 3, "MetaLearner.steps is fixed with learn_inner_lr="),
        ({"mode": "checkpointed"}, "compile", True, "compile=True applies to mode='second_order' or 'first_order'"),
        ({}, "batching", "bogus", "batching='bogus' is not supported; choose one of"),
        ({}, "check_finite", "no", "check_finite must be True or False, got 'no'"),
    ],
)
def test_a_setting_it_cannot_take_is_refused_and_changes_nothing(built, name, value, message):
    learner = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=2, **built)
    before, shown = loss(learner), repr(learner)
    with pytest.raises((AttributeError, ValueError, TypeError)) as raised:
        setattr(learner, name, value)
    assert str(raised.value).startswith(message) or message in str(raised.value), raised.value
    assert "\n" not in str(raised.value)
    assert repr(learner) == shown and torch.equal(loss(learner), before)
    assert callable(learner.adapt)


def test_compile_set_on_a_live_learner_compiles_as_built():
    live = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=1)
    live.compile = True
    fresh = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=1, compile=True)
    assert live.compile is True and "compile=True" in repr(live)
    torch.testing.assert_close(loss(live), loss(fresh), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="^mode='reptile' with compile=True"):
        live.mode = "reptile"


class Tied(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.out = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
        if tie:
            self.l2.weight = self.l1.weight
        self.to(DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def untie(model: Tied) -> None:
    model.l2.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=DTYPE).reshape(3, 3))


def tie(model: Tied) -> None:
    model.l2.weight = model.l1.weight


def share(model: Tied) -> None:
    model.l2 = model.l1  # one module registered twice


@pytest.mark.parametrize("mode", ["second_order", "first_order", "checkpointed"])
@pytest.mark.parametrize("change, tied", [(untie, True), (tie, False), (share, False)])
def test_the_model_tied_or_untied_after_build_is_followed(mode, change, tied):
    model = Tied(tie=tied)
    live = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, steps=2, mode=mode)
    live.meta_loss(batch())  # a first call on the model as built
    change(model)
    fresh = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, steps=2, mode=mode)
    assert live.adapted == fresh.adapted
    grads = []
    for learner in (live, fresh):
        model.zero_grad(set_to_none=True)
        learner.meta_loss(batch()).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
        assert all(g is not None for g in grads[-1].values())
    torch.testing.assert_close(loss(live), loss(fresh), rtol=0, atol=0)
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=0, atol=1e-15)


def test_learnable_rates_per_parameter_cannot_follow_an_untied_weight():
    model = Tied()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, learn_inner_lr="per_parameter")
    untie(model)
    with pytest.raises(
        ValueError,
        match=r"^the model's parameters changed since the learner was built \(adapted: "
        r"added l2.weight, gone none\).*build a new MetaLearner",
    ):
        learner.meta_loss(batch())


class Tempered(nn.Module):
    """SGD scaled by ``exp(log_scale) * (1 + temp)``: a learnable tensor and a constant buffer."""

    linear = True

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros((), dtype=DTYPE))
        self.register_buffer("temp", torch.tensor(1.0, dtype=DTYPE))

    def init(self, params):
        return ()

    def update(self, grads, state, params, step, rates):
        scale = self.log_scale.exp() * (1 + self.temp)
        return {k: p - rates[k] * scale * grads[k] for k, p in params.items()}, ()


@pytest.mark.parametrize("mode", ["second_order", "checkpointed"])
def test_a_rule_buffer_reassigned_after_build_takes_effect(mode):
    rule = Tempered()
    live = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=2, mode=mode, inner_optimizer=rule)
    before = loss(live)
    rule.temp = torch.tensor(0.0, dtype=DTYPE)  # annealing a constant, the usual way
    fresh_rule = Tempered()
    fresh_rule.temp.fill_(0.0)
    fresh = maml.MetaLearner(mlp(), F.mse_loss, inner_lr=0.1, steps=2, mode=mode, inner_optimizer=fresh_rule)
    assert not torch.equal(before, loss(fresh))
    assert torch.equal(loss(live), loss(fresh))


def shared_model() -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    return nn.Sequential(lin, nn.Tanh(), lin).to(DTYPE)


@pytest.mark.parametrize("build", [shared_model, Tied])
def test_the_documented_call_keeps_a_shared_model_training(build):
    model = build()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=1)
    opt = torch.optim.SGD(learner.parameters(), lr=0.1)
    b = regression_batch(
        torch.Generator().manual_seed(1), tasks=3, outputs=model(torch.zeros(1, 3, dtype=DTYPE)).shape[-1]
    )
    fast = learner.adapt(b.support_x[0], b.support_y[0])
    expected = torch.func.functional_call(build(), fast, (b.query_x[0],))  # on a fresh copy: it breaks its model
    torch.testing.assert_close(maml.call(model, fast, b.query_x[0]), expected, rtol=0, atol=0)
    before = [p.detach().clone() for p in model.parameters()]
    learner.meta_loss(b).backward()
    opt.step()
    assert all(isinstance(p, nn.Parameter) and p.grad is not None for p in model.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_functional_call_breaks_a_shared_model_which_maml_call_does_not():
    """Why the docs name ``maml.call``: PyTorch's functional_call leaves plain tensors behind (pytorch/pytorch#164759)."""
    x = torch.randn(2, 3, dtype=DTYPE)
    fast = {k: v + 1 for k, v in shared_model().named_parameters()}
    model = shared_model()
    maml.call(model, fast, x)
    assert all(isinstance(p, nn.Parameter) for p in (model[0].weight, model[0].bias))
    torch.func.functional_call(model, fast, (x,))
    if isinstance(model[0].weight, nn.Parameter):
        pytest.skip("this torch's functional_call no longer replaces a shared module's Parameters")
    assert not isinstance(model[0].weight, nn.Parameter)


def test_maml_call_names_an_unknown_key():
    with pytest.raises(
        ValueError,
        match=r"^params has keys that are not parameters or buffers of the model: "
        r"'0.wieght' \(did you mean '0.weight'",
    ):
        maml.call(shared_model(), {"0.wieght": torch.zeros(3, 3)}, torch.zeros(1, 3))


@pytest.mark.parametrize("mode", ["second_order", "first_order", "checkpointed"])
def test_a_parameter_unfrozen_after_build_is_adapted_as_in_a_learner_built_then(mode):
    """Float64: unfreezing is followed as ties are; the learner then adapts it, as one built afterwards does."""
    model, b = mlp(), batch()
    model[0].weight.requires_grad_(False)
    learner = maml.MetaLearner(model, F.mse_loss, 0.1, 2, mode=mode)
    learner.meta_loss(b).backward()
    assert "0.weight" not in learner.adapted
    model[0].weight.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    got = learner.meta_loss(b)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert "0.weight" in learner.adapted
    fresh = maml.MetaLearner(model, F.mse_loss, 0.1, 2, mode=mode)
    model.zero_grad(set_to_none=True)
    expected = fresh.meta_loss(b)
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-12)
