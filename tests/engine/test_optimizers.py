"""torch.optim's optimizers as update rules: values against torch.optim, meta-gradients against finite
differences and higher, every execution path, learned hyperparameters.

Float64 throughout. The values are compared with ``torch.optim`` itself (the independent reference:
its own single-tensor kernels) step by step, on losses where one parameter's gradient is zero at one
step and another's at every step; the meta-gradients with central finite differences, ``gradcheck``
and higher's differentiable optimizers; every other execution path with eager second order.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import higher
import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT_PATHS, directional_error, make
from torch import Tensor, nn

import maml


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch.optim keeps its step counters and ASGD's eta in it
    yield
    torch.set_default_dtype(previous)


TORCH = {
    "sgd": torch.optim.SGD,
    "momentum": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "rprop": torch.optim.Rprop,
    "asgd": torch.optim.ASGD,
}
LR = {"adadelta": 1.0, "rprop": 0.01, "rmsprop": 0.01, "sgd": 0.1, "momentum": 0.1, "adagrad": 0.1}

# Each optimizer's option sets, in torch.optim's keywords (the rule takes the same).
OPTION_SETS: dict[str, list[dict[str, Any]]] = {
    "sgd": [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.3},
        {"momentum": 0.8, "nesterov": True},
        {"weight_decay": 0.1},
        {"maximize": True},
        {"momentum": 0.5, "dampening": 0.2, "weight_decay": 0.05, "maximize": True},
    ],
    "momentum": [{"momentum": 0.9}, {"momentum": 0.7, "nesterov": True, "weight_decay": 0.1}],
    "adam": [
        {},
        {"weight_decay": 0.1},
        {"amsgrad": True},
        {"maximize": True},
        {"betas": (0.8, 0.99), "eps": 1e-3},
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True},
    ],
    "adamw": [{}, {"amsgrad": True, "weight_decay": 0.05, "maximize": True}],
    "rmsprop": [
        {},
        {"centered": True},
        {"momentum": 0.9},
        {"centered": True, "momentum": 0.5, "weight_decay": 0.1},
        {"maximize": True, "alpha": 0.9},
    ],
    "adagrad": [{}, {"lr_decay": 0.1}, {"initial_accumulator_value": 0.5}, {"weight_decay": 0.1, "maximize": True}],
    "adadelta": [{}, {"rho": 0.5, "eps": 1e-4, "weight_decay": 0.1}, {"maximize": True}],
    "adamax": [{}, {"weight_decay": 0.1}, {"betas": (0.5, 0.9), "maximize": True}],
    "nadam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"momentum_decay": 0.01, "maximize": True},
    ],
    "radam": [
        {},  # rho_t > 5 from the sixth step: both branches within ten
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"betas": (0.9, 0.5), "maximize": True},  # never rectified
    ],
    "rprop": [{}, {"etas": (0.3, 1.5)}, {"step_sizes": (1e-3, 0.02)}, {"maximize": True}],
    "asgd": [{}, {"lambd": 0.1, "alpha": 0.5}, {"weight_decay": 0.1}, {"maximize": True, "lambd": 0.5}],
}
CASES = [(name, i) for name, sets in OPTION_SETS.items() for i in range(len(sets))]


def start() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (5, 3), "b1": (5,), "w2": (2, 5), "b2": (2,), "unused": (3,)}
    return {k: 0.5 * torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


X = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def loss_at(params: dict[str, Tensor], step: int) -> Tensor:
    """A small regression loss whose gradient is zero for ``b2`` at step 1 and for ``unused`` at every step."""
    h = torch.tanh(X @ params["w1"].T + params["b1"])
    out = h @ params["w2"].T + (params["b2"] if step != 1 else params["b2"].detach())
    return F.mse_loss(out, Y) + 0.1 * (params["w1"] ** 2).sum() * (step % 2)


def grads_at(params: dict[str, Tensor], step: int) -> dict[str, Tensor]:
    names = list(params)
    found = torch.autograd.grad(loss_at(params, step), [params[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, found, strict=True)}


def torch_optim_run(name: str, options: dict[str, Any], steps: int, groups=None) -> list[dict[str, Tensor]]:
    """The parameters after each step of the real ``torch.optim`` optimizer (``groups(step, opt)`` edits its groups)."""
    params = {k: v.clone().requires_grad_() for k, v in start().items()}
    opt = TORCH[name]([{"params": [p]} for p in params.values()], lr=LR.get(name, 0.05), **options)
    out = []
    for step in range(steps):
        if groups is not None:
            groups(step, opt)
        g = grads_at(params, step)
        for k, p in params.items():
            p.grad = g[k]  # zeros, not None: torch.optim skips a parameter without a gradient
        opt.step()
        out.append({k: p.detach().clone() for k, p in params.items()})
    return out


def rule_run(rule: Any, steps: int, rates: Any = None) -> list[dict[str, Tensor]]:
    params = start()
    state = rule.init(params)
    out = []
    for step in range(steps):
        grads = {k: g.detach() for k, g in grads_at({k: p.requires_grad_() for k, p in params.items()}, step).items()}
        params = {k: p.detach() for k, p in params.items()}
        lr = rates(step) if rates is not None else LR.get(rule_name(rule), 0.05)
        params, state = rule.update(grads, state, params, step, dict.fromkeys(params, lr))
        out.append({k: p.detach() for k, p in params.items()})
    return out


def rule_name(rule: Any) -> str:
    return {v: k for k, v in vars(maml).items() if isinstance(v, type)}.get(type(rule), type(rule).__name__).lower()


def build(name: str, options: dict[str, Any], **extra: Any) -> Any:
    """The rule ``name`` with ``options`` (as ``inner_optimizer=name, inner_optimizer_options=options`` builds it)."""
    from maml._src.optimizers import make_rule

    model = nn.Module()
    for k, v in start().items():
        model.register_parameter(k, nn.Parameter(v.clone()))
    return make_rule(name, {**options, **extra}, model, 10)


def close(ours: list[dict[str, Tensor]], theirs: list[dict[str, Tensor]]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-15, msg=f"step {step}, {k}")


# ================================================================================ values against torch.optim


@pytest.mark.parametrize("name, index", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_values_equal_torch_optim_over_1_3_and_10_steps(name, index):
    options = OPTION_SETS[name][index]
    for steps in (1, 3, 10):
        theirs = torch_optim_run(name, options, steps)
        close(rule_run(build(name, options), steps), theirs)
        # A rate as a tensor (a learned rate's path) and every float option learned at its start value
        # (their parametrisations' path) step alike.
        rule = build(name, options, learn=learnable(name, options))
        close(rule_run(rule, steps, rates=lambda s: torch.tensor(LR.get(name, 0.05))), theirs)


def learnable(name: str, options: dict[str, Any]) -> list[str]:
    """The float options of ``name`` that may be learned from their values in ``options`` (inside their range)."""
    rule = build(name, options)
    inside = []
    for option in [*rule.PAIRS, *rule.RANGES]:
        names = rule.PAIRS.get(option, (option,))
        if any(rule._paired(n) for n in names) and option not in rule.PAIRS:
            continue
        values = [rule._values[n] for n in names]
        kinds = [rule.RANGES[n] for n in names]
        if all(v > (1.0 if k == "above_one" else 0.0) and (k != "unit" or v < 1) for v, k in zip(values, kinds)):
            inside.append(option)
    return inside


# A schedule of an option per parameter tensor and step (a learned "per_layer_per_step" option) is torch.optim with
# one group per tensor whose option is set before each step.
SCHEDULES = [
    ("sgd", {"momentum": 0.9, "dampening": 0.2}, "momentum"),
    ("adam", {"amsgrad": True}, "betas"),
    ("rmsprop", {"centered": True, "momentum": 0.5}, "alpha"),
    ("nadam", {}, "betas"),
    ("adamax", {}, "betas"),
    ("radam", {}, "betas"),
    ("adadelta", {}, "rho"),
    ("adagrad", {"lr_decay": 0.1, "weight_decay": 0.1}, "weight_decay"),
    ("rprop", {}, "etas"),
]


@pytest.mark.parametrize("name, options, option", SCHEDULES, ids=[f"{n}-{o}" for n, _, o in SCHEDULES])
def test_a_per_tensor_per_step_option_equals_torch_optim_with_its_groups_set_each_step(name, options, option):
    rule = build(name, options, learn={option: "per_layer_per_step"})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in rule.learned.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))  # a different value per tensor and step
    names = rule.PAIRS.get(option, (option,))
    keys = list(start())

    def value(n: str, k: str, step: int) -> float:
        return float(rule.option(n, k, step).detach())

    def groups(step: int, opt: torch.optim.Optimizer) -> None:
        for k, group in zip(keys, opt.param_groups, strict=True):
            values = tuple(value(n, k, step) for n in names)
            group[option] = values if option in rule.PAIRS else values[0]

    close(rule_run(rule, 10), torch_optim_run(name, options, 10, groups))


def test_a_learned_option_stays_in_range_and_finite_wherever_the_outer_step_moves_it():
    rule = build("adam", {}, learn=["betas", "eps"])
    for raw in (-60.0, 60.0):
        with torch.no_grad():
            for p in rule.learned.parameters():
                p.fill_(raw)
        for n in ("beta1", "beta2"):
            assert 0 < float(rule.option(n, "w1", 0).detach()) < 1
        assert float(rule.option("eps", "w1", 0).detach()) > 0
        for params in rule_run(rule, 3):
            assert all(torch.isfinite(p).all() for p in params.values())


# ======================================================================= meta-gradients: finite differences


def learner_for(name: str, options: dict[str, Any], *, model=None, steps: int = 3, **kwargs: Any) -> Any:
    net, batch, loss_fn = make("mlp") if model is None else model
    learner = maml.MetaLearner(
        net,
        loss_fn,
        LR.get(name, 0.05),
        steps,
        inner_optimizer=name,
        inner_optimizer_options=options,
        batching=kwargs.pop("batching", "vmap"),
        **kwargs,
    )
    return learner, batch


# Each optimizer with its float options learned (started inside their ranges) where they are learnable.
LEARNED: dict[str, dict[str, Any]] = {
    "sgd": {
        "momentum": 0.5,
        "dampening": 0.1,
        "weight_decay": 0.01,
        "learn": ["momentum", "dampening", "weight_decay"],
    },
    "momentum": {"momentum": 0.6, "nesterov": True, "learn": {"momentum": "per_layer_per_step"}},
    "adam": {"amsgrad": True, "weight_decay": 0.01, "learn": {"betas": "per_parameter", "eps": "scalar"}, "eps": 1e-3},
    "adamw": {"learn": ["betas", "weight_decay"], "eps": 1e-3},
    "rmsprop": {"momentum": 0.3, "centered": True, "eps": 1e-2, "learn": ["alpha", "momentum", "eps"]},
    "adagrad": {"lr_decay": 0.05, "initial_accumulator_value": 0.1, "learn": ["lr_decay", "initial_accumulator_value"]},
    "adadelta": {
        "weight_decay": 0.01,
        "learn": {"rho": "per_layer_per_step", "eps": "scalar", "weight_decay": "scalar"},
    },
    "adamax": {"learn": ["betas", "eps"], "eps": 1e-2},
    "nadam": {"learn": ["betas", "momentum_decay"], "eps": 1e-3},
    "radam": {"betas": (0.9, 0.9), "learn": ["betas"], "eps": 1e-3},
    "rprop": {"learn": ["etas"]},
    "asgd": {"lambd": 0.2, "weight_decay": 0.01, "learn": ["lambd", "alpha", "weight_decay"]},
}


@pytest.mark.parametrize("name", list(LEARNED))
@pytest.mark.parametrize("learn_inner_lr", [None, "per_layer_per_step"])
def test_meta_gradients_equal_finite_differences(name, learn_inner_lr):
    """Second order, the model's parameters, the learned rates and the learned options (radam: rectified from the
    second step at beta2 = 0.9; rprop: its etas and rates through the step sizes, its parameters through the identity)."""
    model = None
    if name == "rprop":  # a ReLU's dead units have gradients of exactly 0, whose sign a difference flips
        net, batch, loss_fn = make("mlp")
        torch.manual_seed(0)
        model = (nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), batch, loss_fn)
    learner, batch = learner_for(name, LEARNED[name], model=model, steps=3, learn_inner_lr=learn_inner_lr)
    params = list(learner.parameters())
    own = list(learner.rule.parameters())
    assert own and {id(p) for p in own} <= {id(p) for p in params}  # the learned options are meta-parameters
    assert directional_error(lambda: learner.meta_loss(batch), params, order=4) < 1e-8


@pytest.mark.parametrize("name", list(LEARNED))
def test_gradcheck_of_the_meta_loss_in_each_learned_option(name):
    learner, batch = learner_for(name, LEARNED[name], steps=2)
    for holder in learner.rule.learned.values():
        for attr, original in list(holder._parameters.items()):

            def meta_loss(x: Tensor, holder=holder, attr=attr, original=original) -> Tensor:
                holder._parameters[attr] = x  # what functional_call does: the learner threads the tensor it finds
                try:
                    return learner.meta_loss(batch)
                finally:
                    holder._parameters[attr] = original

            x = original.detach().clone().requires_grad_()
            assert torch.autograd.gradcheck(meta_loss, (x,), eps=1e-6, atol=1e-7, rtol=1e-5), (name, attr)


# ============================================================================ every path, one meta-gradient


def meta_grads(name: str, **kwargs: Any) -> list[Tensor]:
    learner, batch = learner_for(name, LEARNED[name], steps=3, learn_inner_lr="scalar", **kwargs)
    learner.meta_loss(batch).backward()
    return [p.grad for p in learner.parameters()]


PATHS = [p for p in EXACT_PATHS if p.id != "compiled"]


@pytest.mark.parametrize("options", PATHS)
@pytest.mark.parametrize("name", list(LEARNED))
def test_every_path_gives_second_orders_meta_gradient(name, options):
    reference = meta_grads(name)
    for ours, theirs in zip(meta_grads(name, **options), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["radam", "nadam"])
def test_compiled_gives_second_orders_meta_gradient(name):
    reference = meta_grads(name)
    for ours, theirs in zip(meta_grads(name, compile=True), reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_training_and_evaluation_adapt_alike():
    learner, batch = learner_for("nadam", LEARNED["nadam"])
    trained = learner.run(batch).fast
    with torch.no_grad():
        evaluated = learner.run(batch).fast
    for k in trained:
        torch.testing.assert_close(trained[k].detach(), evaluated[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(LEARNED))
def test_a_parameter_whose_gradient_is_always_zero_gets_finite_meta_gradients(name):
    net, batch, loss_fn = make("mlp")
    net.register_parameter("unused", nn.Parameter(torch.randn(4)))
    learner, batch = learner_for(name, LEARNED[name], model=(net, batch, loss_fn), learn_inner_lr="per_parameter")
    learner.meta_loss(batch).backward()
    for p in learner.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    assert torch.count_nonzero(net.unused.grad if net.unused.grad is not None else torch.zeros(1)) == 0


# ================================================================================ against higher's optimizers


def higher_meta_loss(name, options, learner, batch, override_of=None) -> Tensor:
    """The meta-loss by ``higher.innerloop_ctx`` with ``torch.optim``'s optimizer ``name``.

    higher's Adam divides by ``sqrt(v) + eps`` and scales the step by ``sqrt(1 - beta2^t)``, where
    torch.optim divides by ``sqrt(v) / sqrt(1 - beta2^t) + eps``: the same update once higher's eps is
    overridden by ``eps * sqrt(1 - beta2^t)`` at step t, which is done here.
    """
    model = learner.model
    opt = TORCH[name](model.parameters(), lr=learner.inner_lr, **options)
    total = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # higher warns about its RMSprop and Rprop
        for t in range(batch.num_tasks):
            with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
                for k in range(learner.steps):
                    override = dict(override_of(k)) if override_of else {}
                    if name == "adam":
                        override["eps"] = [
                            options.get("eps", 1e-8) * math.sqrt(1 - options.get("betas", (0.9, 0.999))[1] ** (k + 1))
                        ]
                    diffopt.step(
                        learner.loss_fn(fmodel(batch.support_x[t]), batch.support_y[t]), override=override or None
                    )
                total = total + learner.loss_fn(fmodel(batch.query_x[t]), batch.query_y[t]) / batch.num_tasks
    return total


HIGHER = {  # higher's differentiable optimizers (no AdamW, NAdam, RAdam)
    "sgd": {"momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05},
    "adam": {"betas": (0.8, 0.99), "weight_decay": 0.05},
    "adadelta": {"rho": 0.8, "weight_decay": 0.05},
    "adagrad": {"lr_decay": 0.1, "initial_accumulator_value": 0.1},
    "adamax": {"betas": (0.8, 0.9), "weight_decay": 0.05},
    "asgd": {"lambd": 0.1, "alpha": 0.5, "weight_decay": 0.05},
    "rmsprop": {"momentum": 0.5, "centered": True, "weight_decay": 0.05},
    "rprop": {"etas": (0.4, 1.3)},
}
HIGHER_PATHS = [
    pytest.param({}, id="vmap"),
    pytest.param({"batching": "loop"}, id="loop"),
    pytest.param({"mode": maml.Checkpointed(every=2)}, id="checkpointed-every2"),
    pytest.param({"mode": maml.Checkpointed(hvp="forward_over_reverse")}, id="checkpointed-fwd"),
]


@pytest.mark.parametrize("path", HIGHER_PATHS)
@pytest.mark.parametrize("name", list(HIGHER))
def test_meta_gradients_equal_highers(name, path):
    learner, batch = learner_for(name, HIGHER[name], steps=3, **path)
    params = list(learner.model.parameters())
    ours = torch.autograd.grad(learner.meta_loss(batch), params)
    theirs = torch.autograd.grad(higher_meta_loss(name, HIGHER[name], learner, batch), params)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name, option", [("sgd", "momentum"), ("adadelta", "rho"), ("rmsprop", "alpha")])
def test_a_learned_option_and_learned_rates_equal_highers_differentiable_override(name, option):
    """higher takes a hyperparameter as a tensor (``override``); the learner learns it through its
    parametrisation: the meta-gradients agree through the chain rule. (Not ASGD: higher computes its
    ``eta`` with ``math.pow``, a float, so its lr and ``lambd`` lose their derivative after the first step.)"""
    options = {k: v for k, v in HIGHER[name].items()}
    learner, batch = learner_for(name, {**options, "learn": [option]}, steps=3, learn_inner_lr="scalar")
    raw = learner.rule.learned[option].value
    value = learner.rule.option(option, "", 0).detach().requires_grad_()
    lr = learner.rate_parameters["inner_lr"]
    ours = torch.autograd.grad(learner.meta_loss(batch), [*learner.model.parameters(), lr, raw])
    rate = lr.detach().clone().requires_grad_()
    loss = higher_meta_loss(name, options, learner, batch, override_of=lambda k: {"lr": [rate], option: [value]})
    theirs = torch.autograd.grad(loss, [*learner.model.parameters(), rate, value])
    theirs = (*theirs[:-1], theirs[-1] * value.detach() * (1 - value.detach()))  # d sigmoid(raw) / d raw
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ===================================================================================== the learner's surface


def test_learned_options_are_saved_resumed_shown_and_meta_parameters():
    learner, batch = learner_for("adam", {"learn": {"betas": "per_layer_per_step"}})
    with torch.no_grad():
        learner.rule.learned["beta1"].get_parameter("0/weight").add_(0.5)
    state = learner.state_dict()
    assert any(k.startswith("learned.beta1") for k in state["rule"])
    again, _ = learner_for("adam", {"learn": {"betas": "per_layer_per_step"}})
    again.load_state_dict(state)
    torch.testing.assert_close(again.meta_loss(batch), learner.meta_loss(batch), rtol=0, atol=0)
    assert "beta1=" in repr(learner.rule) and "(learned, per_layer_per_step)" in repr(learner.rule)
    ids = {id(p) for p in learner.parameters()}
    assert all(id(p) in ids for p in learner.rule.parameters())
    fixed, _ = learner_for("adam", {})
    with pytest.raises(ValueError, match="rule's own tensors"):
        fixed.load_state_dict(state)


@pytest.mark.parametrize(
    "rule, error, text",
    [
        (lambda: maml.SGD(learn="momentum"), ValueError, r"learned momentum must start inside \(0, 1\)"),
        (
            lambda: maml.Adam(learn="beta"),
            ValueError,
            r"'beta', which is not a float option of Adam; it learns 'betas'",
        ),
        (lambda: maml.Adam(learn={"betas": "per_step"}), ValueError, r"learn\['betas'\]='per_step' is not a layout"),
        (lambda: maml.Adam(learn={"eps": "per_parameter"}), ValueError, r"pass model=model"),
        (lambda: maml.Adam(learn=3), TypeError, r"learn=3 must name the options to learn"),
        (lambda: maml.Rprop(etas=(0.5, 0.9)), ValueError, r"etas\[1\]=0.9 is out of range"),
        (
            lambda: maml.SGD(dampening=1.5),
            ValueError,
            r"dampening=1.5 is out of range; it must be a float in \[0, 1\]\.",
        ),
        (lambda: maml.Adam(eps=0.0), ValueError, r"eps=0.0 is out of range; it must be a float in \(0, inf\)\."),
        (lambda: maml.AdamW(decoupled_weight_decay=False), TypeError, r"decoupled by definition"),
        (lambda: maml.SGD(nesterov=True), ValueError, r"Nesterov momentum needs a momentum > 0"),
    ],
)
def test_bad_options_are_named_with_the_fix(rule, error, text):
    with pytest.raises(error, match=text):
        rule()


def test_a_named_rules_errors_name_inner_optimizer_options():
    net, _, loss_fn = make("mlp")
    with pytest.raises(ValueError, match=r"inner_optimizer_options.*'rprop'.*etas"):
        maml.MetaLearner(net, loss_fn, 0.1, inner_optimizer="rprop", inner_optimizer_options={"etas": (2.0, 1.2)})
    with pytest.raises(ValueError, match=r"inner_optimizer_options has 't0'.*'asgd' does not take"):
        maml.MetaLearner(net, loss_fn, 0.1, inner_optimizer="asgd", inner_optimizer_options={"t0": 10.0})
