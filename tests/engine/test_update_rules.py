"""Update rules as objects: a rule with meta-learned tensors of its own, exact in every mode.

Float64 throughout. Meta-Curvature is checked against learn2learn's ``GBML`` with its
``MetaCurvatureTransform`` (an independent implementation of the paper's released code) and
against finite differences; a ten-line user rule with a parameter of its own against the
eager second-order meta-gradient in every other mode.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT_PATHS, finite_difference_error, make
from torch import nn

import maml

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # learn2learn imports gym, which warns about NumPy 2
    import learn2learn as l2l


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # learn2learn builds its curvatures in the default dtype
    yield
    torch.set_default_dtype(previous)


class ScaledSGD(nn.Module):
    """The docs' "bring your own rule": SGD whose step is scaled by a learned factor per parameter tensor."""

    linear = True  # linear in (params, grads) at fixed rates and scales

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = [name for name, _ in model.named_parameters()]
        self.log_scales = nn.Parameter(torch.zeros(len(self.names)))

    def init(self, params):
        return ()

    def update(self, grads, state, params, step, rates):
        scale = {name: self.log_scales[i].exp() for i, name in enumerate(self.names)}
        return {k: p - rates[k] * scale[k] * grads[k] for k, p in params.items()}, ()


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 2), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)
    ).double()


def image_batch(tasks: int = 3) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tasks, 6, 1, 6, 6, generator=g)
    q = torch.randn(tasks, 6, 1, 6, 6, generator=g)
    return maml.TaskBatch(
        x, torch.randint(0, 3, (tasks, 6), generator=g), q, torch.randint(0, 3, (tasks, 6), generator=g)
    )


def perturbed(rule: nn.Module, seed: int = 2) -> nn.Module:
    """Curvatures away from the identity, so that a wrong axis or transpose shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in rule.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return rule


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("first_order", [False, True])
def test_meta_curvature_equals_learn2learns_gbml(batching, first_order):
    net, batch, steps, lr = conv_net(), image_batch(), 2, 0.3
    gbml = l2l.algorithms.GBML(conv_net(), transform=l2l.optim.MetaCurvatureTransform, lr=lr, first_order=first_order)
    rule = perturbed(maml.MetaCurvature(net))
    # learn2learn's names: mc_in is the output axis (left), mc_out the input axis (right), mc_f the filter.
    with torch.no_grad():
        for ours, theirs in zip(rule.curvatures, gbml.compute_update.transforms_modules):
            for a, b in (("left", "mc_in"), ("right", "mc_out"), ("filter", "mc_f"), ("scale", "mc")):
                if hasattr(ours, a):
                    getattr(theirs, b).copy_(getattr(ours, a))
    mode = "first_order" if first_order else "second_order"
    learner = maml.MetaLearner(net, F.cross_entropy, lr, steps, mode=mode, batching=batching, inner_optimizer=rule)
    learner.meta_loss(batch).backward()

    total = 0
    for t in range(batch.num_tasks):
        clone = gbml.clone()
        for _ in range(steps):
            clone.adapt(F.cross_entropy(clone(batch.support_x[t]), batch.support_y[t]))
        total = total + F.cross_entropy(clone(batch.query_x[t]), batch.query_y[t])
    (total / batch.num_tasks).backward()

    for (name, p), q in zip(net.named_parameters(), gbml.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)
    for ours, theirs in zip(rule.curvatures, gbml.compute_update.transforms_modules):
        for a, b in (("left", "mc_in"), ("right", "mc_out"), ("filter", "mc_f"), ("scale", "mc")):
            if hasattr(ours, a):
                torch.testing.assert_close(getattr(ours, a).grad, getattr(theirs, b).grad, rtol=0, atol=1e-10, msg=a)


@pytest.mark.parametrize("case", ["mlp", "conv_groupnorm"])
def test_meta_curvature_matches_finite_differences(case):
    model, batch, loss_fn = make(case)  # float64: the default dtype here
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2, inner_optimizer=perturbed(maml.MetaCurvature(model)))
    assert finite_difference_error(learner, batch) < 1e-6


MODES = EXACT_PATHS


@pytest.mark.parametrize("make_rule", [ScaledSGD, maml.MetaCurvature], ids=["user-rule", "meta-curvature"])
@pytest.mark.parametrize("options", MODES)
def test_a_rule_with_its_own_parameters_is_exact_in_every_mode(make_rule, options):
    def grads(**kwargs):
        net = conv_net()
        rule = perturbed(make_rule(net))
        learner = maml.MetaLearner(net, F.cross_entropy, 0.3, 3, inner_optimizer=rule, **{"batching": "vmap", **kwargs})
        learner.meta_loss(image_batch()).backward()
        return [p.grad for p in learner.parameters()]

    reference = grads()
    for ours, theirs in zip(grads(**options), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_first_order_compiled_equals_first_order_eager_for_a_rule_with_parameters():
    def grads(**kwargs):
        net = conv_net()
        rule = perturbed(maml.MetaCurvature(net))
        learner = maml.MetaLearner(
            net, F.cross_entropy, 0.3, 2, mode="first_order", batching="vmap", inner_optimizer=rule, **kwargs
        )
        learner.meta_loss(image_batch()).backward()
        return [p.grad for p in learner.parameters()]

    for ours, theirs in zip(grads(compile=True), grads(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_a_rules_tensors_are_meta_parameters_saved_and_loaded():
    net = conv_net()
    rule = maml.MetaCurvature(net)
    learner = maml.MetaLearner(net, F.cross_entropy, 0.3, inner_optimizer=rule)
    assert [id(p) for p in learner.parameters()][-len(list(rule.parameters())) :] == [id(p) for p in rule.parameters()]
    state = learner.state_dict()
    other_net = conv_net()
    other = maml.MetaLearner(other_net, F.cross_entropy, 0.3, inner_optimizer=perturbed(maml.MetaCurvature(other_net)))
    other.load_state_dict(state)
    for a, b in zip(rule.parameters(), other.rule.parameters(), strict=True):
        assert torch.equal(a, b)


def test_named_rule_states():
    params = {"w": torch.ones(2)}
    assert maml.Momentum().init(params).buffer["w"].shape == (2,)
    state = maml.Adam().init(params)
    assert isinstance(state, maml.AdamState) and set(state._fields) == {"exp_avg", "exp_avg_sq"}
    _, new = maml.Adam().update({"w": torch.ones(2)}, state, params, 0, {"w": 0.1})
    assert isinstance(new, maml.AdamState)


def test_an_object_that_is_no_rule_and_options_beside_a_rule_object_are_refused():
    net = conv_net()
    with pytest.raises(TypeError, match=r"inner_optimizer=42 is neither a rule's name .* no init or update method"):
        maml.MetaLearner(net, F.cross_entropy, 0.1, inner_optimizer=42)
    with pytest.raises(ValueError, match=r"inner_optimizer_options=\{'momentum': 0.9\} configure a rule given by name"):
        maml.MetaLearner(
            net, F.cross_entropy, 0.1, inner_optimizer=maml.SGD(), inner_optimizer_options={"momentum": 0.9}
        )


# ---------------------------------------------------------------- the rule's output is read by key


class ReversedSGD:
    """Plain SGD whose ``update`` builds its dict in reverse key order: valid, as the contract keys by name."""

    linear = True

    def init(self, params):
        return ()

    def update(self, grads, state, params, step, rates):
        return {k: params[k] - rates[k] * grads[k] for k in reversed(list(params))}, ()


class ReversedMomentum(maml.Momentum):
    """Momentum whose new parameters and buffers come in reverse key order."""

    def update(self, grads, state, params, step, rates):
        new, buf = super().update(grads, state, params, step, rates)
        flip = lambda d: {k: d[k] for k in reversed(list(d))}  # noqa: E731
        return flip(new), maml.MomentumState(flip(buf.buffer))


def three_square_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False)
    )


@pytest.mark.parametrize(
    "rule, same", [(ReversedSGD(), "sgd"), (ReversedMomentum(0.9), "momentum")], ids=["sgd", "momentum"]
)
@pytest.mark.parametrize(
    "options", [{}, *EXACT_PATHS, {"mode": "first_order"}], ids=lambda o: "-".join(map(str, o.values())) or "eager"
)
def test_a_rule_returning_its_keys_in_another_order_is_exact_in_every_mode(rule, same, options):
    g = torch.Generator().manual_seed(1)
    batch = maml.TaskBatch(*(torch.randn(4, 5, 3, generator=g) for _ in range(4)))
    params = {"inner_lr": 0.3, "steps": 3, **options}
    mine = maml.MetaLearner(three_square_layers(), F.mse_loss, inner_optimizer=rule, **params)
    named = maml.MetaLearner(three_square_layers(), F.mse_loss, inner_optimizer=same, **params)
    loss, expected = mine.meta_loss(batch), named.meta_loss(batch)
    grads = torch.autograd.grad(loss, list(mine.parameters()))
    expected_grads = torch.autograd.grad(expected, list(named.parameters()))
    assert abs(float(loss.detach()) - float(expected.detach())) <= 1e-12
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- a rule that breaks the contract


class Broken:
    """SGD with one defect, chosen by ``kind``."""

    linear = False

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def init(self, params):
        return None if self.kind == "init-none" else ()

    def update(self, grads, state, params, step, rates):
        new = {k: p - rates[k] * grads[k] for k, p in params.items()}
        first = next(iter(new))
        if self.kind == "missing":
            del new[first]
        elif self.kind == "extra":
            new["bonus"] = new[first]
        elif self.kind == "renamed":
            new["renamed." + first] = new.pop(first)
        elif self.kind == "no-task-dim":
            new[first] = new[first][0]
        elif self.kind == "transposed":
            new[first] = new[first].transpose(-1, -2)
        elif self.kind == "float32":
            new[first] = new[first].float()
        elif self.kind == "numpy":
            new[first] = new[first].detach().numpy()
        elif self.kind == "not-a-pair":
            return new
        elif self.kind == "state-keys":
            return new, ({"other": grads[first]},)
        return new, ()


@pytest.mark.parametrize(
    "kind, error, text",
    [
        ("missing", ValueError, "update's new parameters must have exactly the keys of the parameters it was given"),
        ("extra", ValueError, "unexpected 'bonus'"),
        ("renamed", ValueError, "missing '0.weight'; unexpected 'renamed.0.weight'"),
        (
            "no-task-dim",
            ValueError,
            "update's new parameters['0.weight'] is (4, 3) torch.float64 on cpu, but the parameter it belongs to is (4, 4, 3)",
        ),
        ("transposed", ValueError, "update's new parameters['0.weight'] is (4, 3, 4)"),
        ("float32", ValueError, "torch.float32 on cpu, but the parameter it belongs to is (4, 4, 3) torch.float64"),
        ("numpy", TypeError, "update's new parameters['0.weight'] is a ndarray; it must be a torch.Tensor"),
        ("not-a-pair", TypeError, "update returned dict; it must return a pair (new parameters, new state)"),
        ("init-none", TypeError, "init returned a NoneType as its state"),
        ("state-keys", ValueError, "update's state[0] must have exactly the keys"),
    ],
)
@pytest.mark.parametrize("mode", ["second_order", "checkpointed", "first_order"])
def test_a_rule_that_breaks_the_contract_is_named_at_its_first_call(kind, error, text, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    g = torch.Generator().manual_seed(1)
    batch = maml.TaskBatch(
        torch.randn(4, 5, 3, generator=g),
        torch.randn(4, 5, 1, generator=g),
        torch.randn(4, 5, 3, generator=g),
        torch.randn(4, 5, 1, generator=g),
    )
    with pytest.raises(error) as raised:
        learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, inner_optimizer=Broken(kind), mode=mode)
        learner.meta_loss(batch).backward()
    message = str(raised.value)
    if mode == "checkpointed":  # its memory planner's probe is the first call: on the first task alone
        text = text.replace("to is (4,", "to is (1,").replace("(4, 3, 4)", "(1, 3, 4)")
    assert message.startswith("the update rule Broken: ") and text in message, message
    assert "\n" not in message
