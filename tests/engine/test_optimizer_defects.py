"""The inner optimizers' edge cases against independent references: a parameter the support loss does not use
(``torch.optim``, higher), learned options at extreme raw values, a state loaded into another rule.

Float64 unless a test says otherwise.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import higher
import pytest
import torch
import torch.nn.functional as F
from test_optimizers import LR, TORCH, float64  # noqa: F401 - float64: the autouse fixture applies here too
from torch import Tensor, nn

import maml

# Every rule with its decay on (coupled, decoupled, ASGD's lambd) and a state where it has one; Rprop has no decay,
# but a state that torch.optim never starts for a parameter without a gradient.
DECAYING: dict[str, dict[str, Any]] = {
    "sgd": {"weight_decay": 0.1, "momentum": 0.5},
    "momentum": {"weight_decay": 0.1, "nesterov": True},
    "adam": {"weight_decay": 0.1, "amsgrad": True},
    "adamw": {"weight_decay": 0.1},
    "rmsprop": {"weight_decay": 0.1, "momentum": 0.5, "centered": True},
    "adagrad": {"weight_decay": 0.1, "initial_accumulator_value": 0.1},
    "adadelta": {"weight_decay": 0.1},
    "adamax": {"weight_decay": 0.1},
    "nadam": {"weight_decay": 0.1, "decoupled_weight_decay": True},
    "radam": {"weight_decay": 0.1},
    "rprop": {},
    "asgd": {"lambd": 0.1, "weight_decay": 0.1},
}


def torch_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as ``torch.optim`` takes them (the ``"momentum"`` rule is SGD at momentum 0.9 by default)."""
    return {"momentum": 0.9, **options} if name == "momentum" else dict(options)


class WithUnused(nn.Module):
    """An MLP beside a layer its forward pass never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 6)
        self.out = nn.Linear(6, 2)
        self.extra = nn.Linear(3, 2)  # never called: its gradient is None under autograd.grad(allow_unused=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def tasks(seed: int = 1, n: int = 3) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(seed)
    x, qx = torch.randn(n, 6, 3, generator=g), torch.randn(n, 6, 3, generator=g)
    return maml.TaskBatch(x, torch.randn(n, 6, 2, generator=g), qx, torch.randn(n, 6, 2, generator=g))


def torch_optim_fast(name: str, options: dict[str, Any], model: nn.Module, x: Tensor, y: Tensor, steps: int):
    """One task's fast weights by ``torch.optim`` itself, on a copy of ``model`` (it skips a ``.grad`` of None)."""
    model = copy.deepcopy(model)
    opt = TORCH[name](model.parameters(), lr=LR.get(name, 0.05), **torch_options(name, options))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: p.detach() for k, p in model.named_parameters()}


UNUSED_PATHS = [
    pytest.param({"batching": "vmap"}, id="vmap"),
    pytest.param({"batching": "loop"}, id="loop"),
    pytest.param({"batching": "loop", "mode": maml.Checkpointed(every=2)}, id="checkpointed-loop"),
    pytest.param({"batching": "vmap", "mode": maml.Checkpointed(hvp="forward_over_reverse")}, id="checkpointed-fwd"),
    pytest.param({"batching": "vmap", "mode": "first_order"}, id="first-order"),
]


@pytest.mark.parametrize("path", UNUSED_PATHS)
@pytest.mark.parametrize("name", list(DECAYING))
def test_a_parameter_the_support_loss_does_not_use_is_left_as_torch_optim_leaves_it(name, path):
    """Before the fix, SGD with weight decay 0.1 moved ``extra.weight`` by 0.0233 over these steps, torch.optim by 0."""
    torch.manual_seed(0)
    model, batch, steps = WithUnused(), tasks(), 4
    options = DECAYING[name]
    learner = maml.MetaLearner(
        model, F.mse_loss, LR.get(name, 0.05), steps, inner_optimizer=name, inner_optimizer_options=options, **path
    )
    fast = learner.run(batch).fast
    for t in range(batch.num_tasks):
        theirs = torch_optim_fast(name, options, model, batch.support_x[t], batch.support_y[t], steps)
        for k in ("extra.weight", "extra.bias"):
            assert torch.equal(fast[k][t].detach(), theirs[k]), (k, (fast[k][t] - theirs[k]).abs().max())
            assert torch.equal(theirs[k], dict(model.named_parameters())[k].detach())
        for k in ("hidden.weight", "hidden.bias", "out.weight", "out.bias"):
            torch.testing.assert_close(fast[k][t].detach(), theirs[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_compiled_step_leaves_an_unused_parameter_too(name):
    torch.manual_seed(0)
    model, batch, options = WithUnused(), tasks(), DECAYING[name]
    learner = maml.MetaLearner(
        model, F.mse_loss, LR.get(name, 0.05), 2, compile=True, inner_optimizer=name, inner_optimizer_options=options
    )
    fast = learner.run(batch).fast
    theirs = torch_optim_fast(name, options, model, batch.support_x[0], batch.support_y[0], 2)
    for k in theirs:
        torch.testing.assert_close(fast[k][0].detach(), theirs[k], rtol=1e-12, atol=0 if "extra" in k else 1e-14)


@pytest.mark.parametrize("name", ["sgd", "adamw", "asgd"])
def test_adapt_and_reptile_leave_an_unused_parameter_too(name):
    torch.manual_seed(0)
    model, batch = WithUnused(), tasks()
    options = DECAYING[name]
    for mode in ("second_order", "reptile"):
        learner = maml.MetaLearner(
            model, F.mse_loss, LR.get(name, 0.05), 3, mode=mode, inner_optimizer=name, inner_optimizer_options=options
        )
        fast = learner.adapt(batch.support_x[0], batch.support_y[0])
        theirs = torch_optim_fast(name, options, model, batch.support_x[0], batch.support_y[0], 3)
        for k in theirs:
            torch.testing.assert_close(fast[k].detach(), theirs[k], rtol=1e-12, atol=0 if "extra" in k else 1e-14)


class UsedFromSecondStep(nn.Module):
    """A model whose support pass uses ``extra`` from the second inner step on (its forward takes ``step``), and
    whose query pass after the last step uses it too: its value after the first step reaches the meta-loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 5)
        self.out = nn.Linear(5, 2)
        self.extra = nn.Linear(3, 2)

    def forward(self, x: Tensor, step: int = 0) -> Tensor:
        out = self.out(torch.tanh(self.body(x)))
        return out + self.extra(x) if step >= 1 else out


# Rules that count no steps, whose state torch.optim starts at zero (momentum without dampening starts at the first
# gradient alike): torch.optim counts each parameter's steps from its first gradient, the rules from the loop's first
# step, so the step-counting rules (Adam's bias corrections, ASGD's eta) differ for a parameter first used later.
LATE_USE = {
    "sgd": {"momentum": 0.5, "weight_decay": 0.1},
    "rmsprop": {"momentum": 0.5, "weight_decay": 0.1},
    "adadelta": {"weight_decay": 0.1},
}


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("name", list(LATE_USE))
def test_a_parameter_used_from_a_later_step_is_decayed_from_that_step_only(name, batching):
    """torch.optim decays a parameter at the steps its gradient is not None (here from the second)."""
    torch.manual_seed(0)
    model, batch, steps, options = UsedFromSecondStep(), tasks(), 3, LATE_USE[name]
    lr = LR.get(name, 0.05)
    learner = maml.MetaLearner(
        model, F.mse_loss, lr, steps, batching=batching, inner_optimizer=name, inner_optimizer_options=options
    )
    fast = learner.run(batch).fast
    for t in range(batch.num_tasks):
        theirs = copy.deepcopy(model)
        opt = TORCH[name](theirs.parameters(), lr=lr, **options)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(theirs(batch.support_x[t], step=step), batch.support_y[t]).backward()
            opt.step()
        for k, p in theirs.named_parameters():
            torch.testing.assert_close(fast[k][t].detach(), p.detach(), rtol=1e-12, atol=1e-14, msg=k)


def higher_meta_loss(name: str, options: dict[str, Any], model: nn.Module, batch: maml.TaskBatch, steps: int):
    """The meta-loss by ``higher.innerloop_ctx``, whose optimizers skip a gradient of None as torch.optim does."""
    opt = TORCH[name](model.parameters(), lr=LR.get(name, 0.05), **options)
    total: Tensor | float = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # higher warns about its RMSprop
        for t in range(batch.num_tasks):
            with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
                for k in range(steps):
                    diffopt.step(F.mse_loss(fmodel(batch.support_x[t], step=k), batch.support_y[t]))
                query = fmodel(batch.query_x[t], step=steps - 1)  # the query pass after step k gets step=k
                total = total + F.mse_loss(query, batch.query_y[t]) / batch.num_tasks
    return total


@pytest.mark.parametrize("path", UNUSED_PATHS[:4])
@pytest.mark.parametrize("name", list(LATE_USE))
def test_meta_gradient_with_a_parameter_used_from_a_later_step_equals_highers(name, path):
    """``extra`` is unused by the first support pass and used by the query pass: its meta-gradient is taken where
    the first step left it undecayed, as higher's (before the fix, at a decayed value)."""
    torch.manual_seed(0)
    model, batch, steps = UsedFromSecondStep(), tasks(), 3
    options = LATE_USE[name]
    learner = maml.MetaLearner(
        model, F.mse_loss, LR.get(name, 0.05), steps, inner_optimizer=name, inner_optimizer_options=options, **path
    )
    params = list(model.parameters())
    ours = torch.autograd.grad(learner.meta_loss(batch), params)
    theirs = torch.autograd.grad(higher_meta_loss(name, options, model, batch, steps), params)
    for (k, _), a, b in zip(model.named_parameters(), ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=k)


# ============================================================ learned options at extreme raw values (issue item 9)

# Every option mapped by exp (and Rprop's etaplus, by 1 + exp), with options that put it on the meta-loss's path.
EXP_MAPPED = [
    ("adam", "eps", {}),
    ("adamw", "eps", {}),
    ("rmsprop", "eps", {}),
    ("adagrad", "eps", {}),
    ("adadelta", "eps", {}),
    ("adamax", "eps", {}),
    ("nadam", "eps", {}),
    ("radam", "eps", {}),  # rectified from the sixth step on (rho_t > 5): eps is used there
    ("adagrad", "lr_decay", {"lr_decay": 0.1}),
    ("adagrad", "initial_accumulator_value", {"initial_accumulator_value": 0.1}),
    ("nadam", "momentum_decay", {}),
    ("asgd", "alpha", {}),
    ("asgd", "lambd", {}),
    ("rprop", "etaplus", {}),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("raw", [800.0, 709.8, -800.0])
@pytest.mark.parametrize("name, option, options", EXP_MAPPED, ids=[f"{n}-{o}" for n, o, _ in EXP_MAPPED])
def test_an_exp_mapped_option_stays_finite_in_range_with_a_finite_meta_gradient_at_any_raw(
    name, option, options, raw, dtype
):
    """Before the fix, raw 709.8 and 800 gave a NaN meta-gradient (exp overflowed to inf, clamped to the largest
    float with derivative inf * 0), Rprop's etaplus was inf there and exactly 1.0 at raw -800."""
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    learn = "etas" if option == "etaplus" else option
    learner = maml.MetaLearner(
        model,
        F.mse_loss,
        LR.get(name, 0.05),
        6 if name == "radam" else 3,
        inner_optimizer=name,
        inner_optimizer_options={**options, "learn": [learn]},
        check_finite=False,  # ASGD's lambd at its top decays the weights past any float: the loss may be inf
    )
    raw_tensor = learner.rule.learned[option].value
    with torch.no_grad():
        raw_tensor.fill_(raw)
    value = float(learner.rule.option(option, "0.weight", 0).detach())
    low = 1.0 if option == "etaplus" else 0.0
    assert math.isfinite(value) and value > low, value  # > 1 strictly for etaplus, in the dtype
    if option == "lambd":
        return  # its value is the point here: a weight decayed by lambd ~ 1e304 has no finite loss to differentiate
    learner.meta_loss(tasks()).backward()  # in the default dtype, set above
    for p in learner.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), p.grad


@pytest.mark.parametrize("raw", [-30.0, -3.0, 0.0, 2.5, 30.0])
def test_an_exp_mapped_option_at_an_ordinary_raw_is_exp_exactly(raw):
    rule = maml.Rprop(learn=["etas"])
    eps = maml.Adam(learn=["eps"])
    with torch.no_grad():
        rule.learned["etaplus"].value.fill_(raw)
        eps.learned["eps"].value.fill_(raw)
    assert float(eps.option("eps", "", 0).detach()) == math.exp(raw)
    assert float(rule.option("etaplus", "", 0).detach()) == 1 + math.exp(raw)


# ================================================================ a state saved under another rule (issue item 10)


def learner_with(inner_optimizer: str, options: dict[str, Any]) -> maml.MetaLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return maml.MetaLearner(
        model, F.mse_loss, 0.05, 2, inner_optimizer=inner_optimizer, inner_optimizer_options=options
    )


@pytest.mark.parametrize(
    "saved, loading, message",
    [
        (
            ("rmsprop", {"learn": ["alpha"]}),
            ("asgd", {"learn": ["alpha"]}),
            "this state was saved by a learner with inner_optimizer=RMSprop; this learner's is ASGD: build it with "
            "maml.RMSprop(...) or load a state saved by ASGD.",
        ),
        (
            ("adam", {"learn": ["betas"]}),
            ("nadam", {"learn": ["betas"]}),
            "this state was saved by a learner with inner_optimizer=Adam; this learner's is NAdam: build it with "
            "maml.Adam(...) or load a state saved by NAdam.",
        ),
        (
            ("adam", {"learn": ["betas"]}),
            ("adam", {"learn": ["betas", "eps"]}),
            "this state's Adam learned ['beta1', 'beta2'], but this learner's Adam learns ['beta1', 'beta2', 'eps']",
        ),
        (
            ("rmsprop", {"learn": ["alpha"]}),
            ("asgd", {}),
            "state holds a rule's own tensors (state['rule']: ['learned.alpha.value']), but this learner's rule "
            "'asgd' has none; build it with the same inner_optimizer as the saved one (e.g. maml.RMSprop(...)).",
        ),
    ],
    ids=["rmsprop-into-asgd", "adam-into-nadam", "other-learned-options", "into-fixed-options"],
)
def test_a_state_saved_under_another_rule_is_refused_naming_both_and_nothing_loads(saved, loading, message):
    """Before the fix, RMSprop's learned alpha (0.99) loaded into ASGD as 99 and Adam's betas into NAdam, silently."""
    state = learner_with(*saved).state_dict()
    learner = learner_with(*loading)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(1.0)  # differs from the saved model: a partial load would show
    before = {k: v.clone() for k, v in {**learner.model.state_dict(), **learner.rule.state_dict()}.items()}
    with pytest.raises(ValueError) as raised:
        learner.load_state_dict(state)
    assert str(raised.value).startswith(message), str(raised.value)
    after = {**learner.model.state_dict(), **learner.rule.state_dict()}
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing loaded


def test_a_state_round_trips_into_a_learner_of_the_same_rule_and_an_older_state_still_loads():
    saved = learner_with("rmsprop", {"learn": ["alpha"]})
    with torch.no_grad():
        saved.rule.learned["alpha"].value.fill_(1.5)
    state = saved.state_dict()
    assert state["inner_optimizer"] == {"class": "RMSprop", "module": "maml._src.optimizers", "learned": ["alpha"]}
    again = learner_with("rmsprop", {"learn": ["alpha"]})
    again.load_state_dict(state)
    assert float(again.rule.option("alpha", "", 0).detach()) == float(saved.rule.option("alpha", "", 0).detach())
    older = {k: v for k, v in state.items() if k != "inner_optimizer"}  # saved before the rule was recorded
    another = learner_with("rmsprop", {"learn": ["alpha"]})
    another.load_state_dict(older)
    assert torch.equal(another.rule.learned["alpha"].value, saved.rule.learned["alpha"].value)
    # Fixed options keep nothing of the rule: the model's weights load under another rule, as before.
    learner_with("asgd", {}).load_state_dict(learner_with("rmsprop", {}).state_dict())


# ================================================== TorchOpt's test_maml_meta_adam, ported (issue item 11)


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.95, 0.9995)])
@pytest.mark.parametrize("inner_lr, steps", [(1e-2, 5), (1e-3, 3), (1e-4, 2)])
def test_the_meta_gradient_of_torchopts_maml_meta_adam_on_random_inputs(inner_lr, steps, betas, weight_decay, maximize):
    """TorchOpt's ``test_maml_meta_adam`` grid (its ``eps_root=0``, torch.optim's form; its own accelerated op
    left out: on a ReLU net whose dead units get gradients of exactly 0 it differs from TorchOpt's plain op by
    1.7e-3), against ``torchopt.MetaAdam``.

    The tolerance is rounding: over 12 seeds of this grid the two agree to 3e-15 (the gradients are ~0.1), and
    perturbing the inputs by 1e-15 relative moves our meta-gradient by up to 2e-14, so 1e-12 leaves a margin of
    50 over the problem's own conditioning, and a real difference (an eps placement, a bias correction, a
    decay order) shows at 1e-6 or more.
    """
    torchopt = pytest.importorskip("torchopt")  # the peers extra (scripts/setup.sh) installs it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    xs, ys = torch.randn(64, 16), torch.randint(0, 10, (64,))
    options = {"betas": betas, "eps": 1e-8, "weight_decay": weight_decay, "maximize": maximize}
    peer = copy.deepcopy(model)
    initial = list(peer.parameters())
    inner = torchopt.MetaAdam(peer, lr=inner_lr, eps_root=0.0, moment_requires_grad=True, **options)
    for _ in range(steps):
        inner.step(F.cross_entropy(peer(xs), ys))
    theirs = torch.autograd.grad(F.cross_entropy(peer(xs), ys), initial)
    learner = maml.MetaLearner(
        model, F.cross_entropy, inner_lr, steps, inner_optimizer="adam", inner_optimizer_options=options
    )
    batch = maml.TaskBatch(xs[None], ys[None], xs[None], ys[None])
    ours = torch.autograd.grad(learner.meta_loss(batch), list(model.parameters()))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
