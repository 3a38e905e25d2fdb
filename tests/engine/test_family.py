"""The MAML family, exact in every mode: adapt sets (ANIL, BOIL), MAML++ (per-layer per-step
rates, multi-step loss), and momentum and Adam inner loops.

Every meta-gradient is held, in float64, against an independent per-task reference (``reference`` in
tests/reference.py: one task at a time, ``torch.autograd.grad`` with ``create_graph=True``, the update
rules restated there), against central finite differences of the engine's own meta-loss, and, for
momentum and Adam, against ``higher``'s differentiable optimizers and the values of ``torch.optim``.
The reference is itself checked against ``higher``, ``torch.optim`` and finite differences
(the ``test_reference_*`` tests), so a disagreement points at the engine.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import Case, build_case, directional_error, image_batch, regression_batch
from reference import Config, Ref, rate_at, ref_rates, reference, resolve_adapt, rule_of, trainable
from torch import Tensor, nn
from torch.func import functional_call

import maml

with warnings.catch_warnings():  # keep the import quiet like tests/engine/test_peers.py
    warnings.simplefilter("ignore")
    import higher

DTYPE = torch.float64
HEAD = ["head.weight", "head.bias"]  # ANIL: adapt the head only


def body(name: str) -> bool:
    """BOIL's adapt set as a predicate: every parameter of the body."""
    return name.startswith("body.")


# ---------------------------------------------------------------------------------------------- models


def _mlp(act: Callable[[], nn.Module] = nn.Tanh) -> nn.Module:
    return nn.Sequential(
        OrderedDict(body=nn.Sequential(nn.Linear(3, 8), act(), nn.Linear(8, 8), act()), head=nn.Linear(8, 1))
    )


def _conv_bn() -> nn.Module:
    # 6x6 images -> 3 channels of 3x3 after pooling -> 3 ways.
    return nn.Sequential(
        OrderedDict(
            body=nn.Sequential(
                nn.Conv2d(1, 3, 3, padding=1),
                nn.BatchNorm2d(3, track_running_stats=False),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
            ),
            head=nn.Linear(27, 3),
        )
    )


def _kill(model: nn.Module, batch: maml.TaskBatch) -> tuple[nn.Module, maml.TaskBatch]:
    """Exact zeros in the support gradient, where Adam's second moment stays 0.

    A dead ReLU unit in each body layer (a bias of -50 keeps it off for every input, also a few
    finite-difference steps away): the gradients of its incoming weights and bias and of its
    outgoing weights are exactly 0. And a support input feature that is always 0 (but not in
    the query set): the gradient of its input weights is exactly 0 in the inner loop, yet the
    meta-gradient of those weights is not (the query loss uses them).
    """
    with torch.no_grad():
        model.body[0].bias[1] = -50.0
        model.body[2].bias[3] = -50.0
    support_x = batch.support_x.clone()
    support_x[..., 0] = 0.0
    return model, maml.TaskBatch(support_x, batch.support_y, batch.query_x, batch.query_y)


# The inner rate of each case by inner optimizer (the family's reference runs each rule at its own).
LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.02}
RATES = {"mlp": LR, "conv_bn": {"sgd": 0.3, "momentum": 0.1, "adam": 0.03}, "mlp_dead": LR}
CASES = {
    "mlp": Case(_mlp, regression_batch, F.mse_loss),
    "conv_bn": Case(_conv_bn, functools.partial(image_batch, query=2, side=6), F.cross_entropy),
    "mlp_dead": Case(lambda: _mlp(nn.ReLU), regression_batch, F.mse_loss, _kill),
}


def make(case: str, seed: int = 0) -> tuple[nn.Module, maml.TaskBatch, Callable[[Tensor, Tensor], Tensor]]:
    """A float64 model at a generic point (defaults perturbed), a meta-batch of 3 tasks and the loss."""
    return build_case(CASES[case], seed)


# ------------------------------------------------------------------------------- family configurations

LEARNER_KEYS = ("adapt", "learn_inner_lr", "inner_optimizer", "inner_optimizer_options")

SW3 = (0.2, 0.3, 0.5)
SW5 = (0.1, 0.1, 0.2, 0.25, 0.35)
MOMENTUM = {"inner_optimizer": "momentum", "inner_optimizer_options": {"momentum": 0.9}}
NESTEROV = {"inner_optimizer": "momentum", "inner_optimizer_options": {"momentum": 0.8, "nesterov": True}}
ADAM = {"inner_optimizer": "adam", "inner_optimizer_options": {"betas": (0.9, 0.999), "eps": 1e-8}}
ADAM_LOOSE = {"inner_optimizer": "adam", "inner_optimizer_options": {"betas": (0.8, 0.99), "eps": 1e-6}}

# Each new option alone, then combinations (every option x mode x batching in test_matches_reference).
OPTIONS: dict[str, Config] = {
    "anil": {"adapt": HEAD},
    "boil": {"adapt": body},
    "lslr": {"learn_inner_lr": "per_layer_per_step"},
    "momentum": MOMENTUM,
    "nesterov": NESTEROV,
    "adam": ADAM,
    "adam_defaults": {"inner_optimizer": "adam"},
    "step_weights": {"step_weights": SW3},
    "maml++": {"learn_inner_lr": "per_layer_per_step", "step_weights": SW3},
    "anil-adam-meta_sgd": {"adapt": HEAD, **ADAM_LOOSE, "learn_inner_lr": "per_parameter"},
    "boil-nesterov-scalar-sw": {"adapt": body, **NESTEROV, "learn_inner_lr": "scalar", "step_weights": SW3},
    "lslr-adam-sw": {"learn_inner_lr": "per_layer_per_step", **ADAM_LOOSE, "step_weights": SW3},
    "anil-lslr-momentum": {"adapt": HEAD, "learn_inner_lr": "per_layer_per_step", **MOMENTUM},
}
CONV_OPTIONS = ["anil", "boil-nesterov-scalar-sw", "lslr-adam-sw"]


def learner_kwargs(cfg: Config) -> dict[str, Any]:
    return {k: cfg[k] for k in LEARNER_KEYS if k in cfg}


def step_weights(cfg: Config) -> Tensor | None:
    sw = cfg.get("step_weights")
    return None if sw is None else torch.tensor(sw, dtype=DTYPE)


def spread(rates: dict[str, Tensor]) -> None:
    """Gives every learnable rate its own value (the same, by key, wherever it is applied), so
    that a mix-up between parameters or steps cannot cancel out."""
    with torch.no_grad():
        for key, rate in rates.items():
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            rate.mul_(1 + 0.5 * torch.rand(rate.shape, generator=g, dtype=rate.dtype))


# ---------------------------------------------------------------------------- comparing meta-gradients


def adapt_has(adapt: Any, key: str) -> bool:
    """Whether the adapt set (a list or a predicate) holds the parameter of a meta_params key."""
    name = key.removeprefix("model:")
    return adapt(name) if callable(adapt) else name in adapt


def meta_params(model: nn.Module, rates: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every meta-parameter, keyed 'model:<name>' (trainable ones) and 'rate:<key>'."""
    out = {f"model:{n}": p for n, p in model.named_parameters() if p.requires_grad}
    out.update({f"rate:{k}": r for k, r in rates.items()})
    return out


def grads_of(loss: Tensor, params: dict[str, Tensor]) -> dict[str, Tensor]:
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def rel(got: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """||got - expected|| / ||expected|| over every meta-parameter concatenated (same keys required)."""
    assert list(got) == list(expected), (list(got), list(expected))
    a = torch.cat([got[k].detach().flatten() for k in expected])
    b = torch.cat([expected[k].detach().flatten() for k in expected])
    assert torch.isfinite(a).all(), "non-finite meta-gradient"
    assert torch.isfinite(b).all()
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------------------- the peers


def _detached(grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    return [None if g is None else g.detach() for g in grads]


def higher_loss(model, loss_fn, batch, cfg, *, inner_lr, steps, first_order, rates) -> Tensor:
    """The same meta-loss by ``higher.innerloop_ctx`` with ``torch.optim.SGD(momentum=...)`` or
    ``torch.optim.Adam``: one parameter group per adapted parameter, its rate passed as a
    (differentiable) ``lr`` override at every step; first order by detaching the gradients
    (``grad_callback``). higher's Adam divides by ``sqrt(v) + eps`` and scales the step by
    ``sqrt(1 - beta2^t)``; torch.optim.Adam divides by ``sqrt(v) / sqrt(1 - beta2^t) + eps``: the
    same update once higher's eps is overridden by ``eps * sqrt(1 - beta2^t)`` at step t."""
    named = dict(model.named_parameters())
    adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    rule, opts, kind = rule_of(cfg), cfg.get("inner_optimizer_options") or {}, cfg.get("learn_inner_lr")
    groups = [{"params": [named[n]]} for n in adapted]
    if rule == "adam":
        b1, b2 = opts.get("betas", (0.9, 0.999))
        eps = opts.get("eps", 1e-8)
        opt = torch.optim.Adam(groups, lr=inner_lr, betas=(b1, b2), eps=eps)
    else:
        momentum = opts.get("momentum", 0.9) if rule == "momentum" else 0.0
        opt = torch.optim.SGD(groups, lr=inner_lr, momentum=momentum, nesterov=opts.get("nesterov", False))
    sw = cfg.get("step_weights")
    tasks = batch.num_tasks
    total: Tensor | float = 0.0
    for t in range(tasks):
        sx, sy, qx, qy = batch.support_x[t], batch.support_y[t], batch.query_x[t], batch.query_y[t]
        with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
            for k in range(steps):
                override: dict[str, list[Any]] = {}
                if kind is not None:
                    override["lr"] = [rate_at(rates, kind, inner_lr, n, k) for n in adapted]
                if rule == "adam":
                    override["eps"] = [eps * math.sqrt(1 - b2 ** (k + 1))]
                diffopt.step(
                    loss_fn(fmodel(sx), sy), override=override or None, grad_callback=_detached if first_order else None
                )
                if sw is not None:
                    total = total + sw[k] * loss_fn(fmodel(qx), qy) / tasks
            if sw is None:
                total = total + loss_fn(fmodel(qx), qy) / tasks
    assert isinstance(total, Tensor)
    return total


def torch_optim_fast(model, loss_fn, batch, cfg, *, inner_lr, steps, rates, task) -> dict[str, Tensor]:
    """One task's fast weights by a real ``torch.optim.SGD(momentum=...)`` / ``torch.optim.Adam``
    (values only), one parameter group per adapted parameter, its lr set at every step."""
    named = dict(model.named_parameters())
    adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    rule, opts, kind = rule_of(cfg), cfg.get("inner_optimizer_options") or {}, cfg.get("learn_inner_lr")
    assert kind in (None, "scalar", "per_layer_per_step")  # torch.optim's lr is a number
    fast = {n: named[n].detach().clone().requires_grad_() for n in adapted}
    consts = {n: p.detach() for n, p in named.items() if n not in fast}
    consts.update(model.named_buffers())
    groups = [{"params": [fast[n]]} for n in adapted]
    if rule == "adam":
        opt = torch.optim.Adam(
            groups, lr=inner_lr, betas=opts.get("betas", (0.9, 0.999)), eps=opts.get("eps", 1e-8), foreach=False
        )
    else:
        momentum = opts.get("momentum", 0.9) if rule == "momentum" else 0.0
        opt = torch.optim.SGD(
            groups, lr=inner_lr, momentum=momentum, nesterov=opts.get("nesterov", False), foreach=False
        )
    for k in range(steps):
        for group, n in zip(opt.param_groups, adapted):
            rate = rate_at(rates, kind, inner_lr, n, k)
            group["lr"] = float(rate.detach()) if isinstance(rate, Tensor) else rate
        opt.zero_grad()
        loss_fn(
            functional_call(model, {**consts, **fast}, (batch.support_x[task],), strict=True), batch.support_y[task]
        ).backward()
        opt.step()
    return {n: v.detach() for n, v in fast.items()}


# ------------------------------------------------------------------------------------------ the engine


def build(
    case: str, cfg: Config, mode: str | maml.Mode, batching: str, steps: int = 3, seed: int = 0, **kw: Any
) -> tuple[maml.MetaLearner, maml.TaskBatch, float]:
    """A learner with the family options of ``cfg`` (its learnable rates spread), its meta-batch and inner_lr."""
    model, batch, loss_fn = make(case, seed)
    lr = RATES[case][rule_of(cfg)]
    learner = maml.MetaLearner(
        model, loss_fn, inner_lr=lr, steps=steps, mode=mode, batching=batching, **learner_kwargs(cfg), **kw
    )
    spread(learner.rate_parameters)
    return learner, batch, lr


def engine_loss(learner: maml.MetaLearner, batch: maml.TaskBatch, cfg: Config, steps: int | None = None) -> Tensor:
    kw: dict[str, Any] = {}
    if cfg.get("step_weights") is not None:  # passed only when used, so the other options do not depend on it
        kw["step_weights"] = step_weights(cfg)
    if steps is None:
        return learner.meta_loss(batch, **kw)
    return learner.run(batch, steps=steps, **kw).loss


def engine_grads(
    learner: maml.MetaLearner, batch: maml.TaskBatch, cfg: Config, steps: int | None = None
) -> dict[str, Tensor]:
    return grads_of(engine_loss(learner, batch, cfg, steps), meta_params(learner.model, learner.rate_parameters))


def reference_for(
    learner: maml.MetaLearner, batch: maml.TaskBatch, cfg: Config, lr: float, *, first_order: bool, **kw: Any
) -> tuple[Ref, dict[str, Tensor]]:
    """The reference on the learner's model (the same parameter tensors) with rates of its own,
    built from ``cfg`` and spread like the learner's; checks that the learner's rates have the
    documented layout and values. Returns the reference and its meta-gradient."""
    model = learner.model
    adapted = kw.get("adapted") or resolve_adapt(cfg.get("adapt"), trainable(model))
    rates = ref_rates(model, adapted, cfg.get("learn_inner_lr"), lr, learner.steps)
    spread(rates)
    assert list(learner.rate_parameters) == list(rates), "learnable rates keyed differently"
    for key, r in rates.items():
        assert learner.rate_parameters[key].shape == r.shape, key
        assert torch.equal(learner.rate_parameters[key].detach(), r.detach()), key
    ref = reference(
        model, learner.loss_fn, batch, cfg, inner_lr=lr, steps=learner.steps, first_order=first_order, rates=rates, **kw
    )
    return ref, grads_of(ref.loss, meta_params(model, rates))


MODES = ["second_order", "first_order", "checkpointed"]
EXACT_MODES = ["second_order", "checkpointed"]
BATCHINGS = ["vmap", "loop"]
CKPT = maml.Checkpointed(every=2, tasks=1)  # segments cut through the rule's state; ragged chunks of tasks


def spec(mode: str) -> str | maml.Mode:
    return CKPT if mode == "checkpointed" else mode


# =================================================================== the reference, checked on its own


@pytest.mark.parametrize("first_order", [False, True], ids=["second_order", "first_order"])
@pytest.mark.parametrize(
    "name",
    [
        "momentum",
        "nesterov",
        "adam",
        "adam_defaults",
        "anil-adam-meta_sgd",
        "boil-nesterov-scalar-sw",
        "lslr-adam-sw",
        "anil-lslr-momentum",
        "maml++",
    ],
)
def test_reference_equals_higher(name, first_order):
    cfg = OPTIONS[name]
    model, batch, loss_fn = make("mlp")
    lr = LR[rule_of(cfg)]
    adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    rates = ref_rates(model, adapted, cfg.get("learn_inner_lr"), lr, 3)
    spread(rates)
    params = meta_params(model, rates)
    ref = reference(model, loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=first_order, rates=rates)
    peer = higher_loss(model, loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=first_order, rates=rates)
    assert abs(float(ref.loss.detach()) - float(peer.detach())) <= 1e-12 * abs(float(peer.detach()))
    assert rel(grads_of(ref.loss, params), grads_of(peer, params)) < 1e-10


@pytest.mark.parametrize("first_order", [False, True], ids=["second_order", "first_order"])
def test_reference_adam_at_zero_second_moment_equals_higher(first_order):
    # Exact zeros in the support gradient: the reference's sqrt (derivative 0 at 0) against
    # higher's mask of the second moment; both finite, the naive sqrt is not.
    model, batch, loss_fn = make("mlp_dead")
    ref = reference(model, loss_fn, batch, ADAM, inner_lr=LR["adam"], steps=3, first_order=first_order)
    params = meta_params(model, {})
    peer = higher_loss(model, loss_fn, batch, ADAM, inner_lr=LR["adam"], steps=3, first_order=first_order, rates={})
    assert rel(grads_of(ref.loss, params), grads_of(peer, params)) < 1e-10
    if not first_order:
        naive = reference(model, loss_fn, batch, ADAM, inner_lr=LR["adam"], steps=3, first_order=False, sqrt=torch.sqrt)
        assert not all(torch.isfinite(g).all() for g in grads_of(naive.loss, params).values())


def test_higher_adam_differs_from_torch_adam_without_the_eps_override():
    # Guards the override in higher_loss: without it higher's Adam is another function (by O(eps)).
    cfg = {"inner_optimizer": "adam", "inner_optimizer_options": {"betas": (0.9, 0.999), "eps": 1e-3}}
    model, batch, loss_fn = make("mlp")
    ref = reference(model, loss_fn, batch, cfg, inner_lr=0.02, steps=3, first_order=False)
    inner_opt = torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.9, 0.999), eps=1e-3)
    with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, diffopt):
        for _ in range(3):
            diffopt.step(loss_fn(fmodel(batch.support_x[0]), batch.support_y[0]))
        plain = float(loss_fn(fmodel(batch.query_x[0]), batch.query_y[0]).detach())
    assert abs(plain - float(ref.query_losses[0])) > 1e-9


@pytest.mark.parametrize(
    "name", ["momentum", "nesterov", "adam", "adam_defaults", "lslr-adam-sw", "anil-lslr-momentum"]
)
def test_reference_fast_weights_equal_torch_optim(name):
    cfg = OPTIONS[name]
    model, batch, loss_fn = make("mlp")
    lr = LR[rule_of(cfg)]
    adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    rates = ref_rates(model, adapted, cfg.get("learn_inner_lr"), lr, 3)
    spread(rates)
    ref = reference(model, loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=False, rates=rates)
    for t in range(batch.num_tasks):
        expected = torch_optim_fast(model, loss_fn, batch, cfg, inner_lr=lr, steps=3, rates=rates, task=t)
        assert list(ref.fast[t]) == list(expected)
        for n in expected:
            assert torch.allclose(ref.fast[t][n], expected[n], rtol=1e-13, atol=1e-15), n


@pytest.mark.parametrize(
    "case, name",
    [
        ("mlp", "anil-adam-meta_sgd"),
        ("mlp", "boil-nesterov-scalar-sw"),
        ("mlp", "lslr-adam-sw"),
        ("mlp_dead", "adam"),
        ("conv_bn", "lslr-adam-sw"),
    ],
)
def test_reference_matches_finite_differences(case, name):
    cfg = OPTIONS[name]
    model, batch, loss_fn = make(case)
    lr = RATES[case][rule_of(cfg)]
    adapted = resolve_adapt(cfg.get("adapt"), trainable(model))
    rates = ref_rates(model, adapted, cfg.get("learn_inner_lr"), lr, 3)
    spread(rates)
    params = list(meta_params(model, rates).values())

    def loss() -> Tensor:
        # The differences need values only (the same in first order, at less cost), yet the inner loop's gradients.
        values_only = not torch.is_grad_enabled()
        with torch.enable_grad():
            return reference(
                model, loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=values_only, rates=rates
            ).loss

    assert directional_error(loss, params, order=4) < 1e-6


def test_reference_cases_are_what_they_claim():
    # ANIL/BOIL on these models: the non-adapted parameters' second-order meta-gradients differ
    # from first order's (the cross terms are there to be found).
    for case in ("mlp", "conv_bn"):
        for adapt in (HEAD, body):
            model, batch, loss_fn = make(case)
            lr = RATES[case]["sgd"]
            cfg = {"adapt": adapt}
            so, fo = (
                reference(model, loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=f).loss for f in (False, True)
            )
            frozen = {k: p for k, p in meta_params(model, {}).items() if not adapt_has(adapt, k)}
            assert rel(grads_of(fo, frozen), grads_of(so, frozen)) > 1e-3
    # mlp_dead: every kind of exact zero is in the support gradient (and stays: a zero gradient moves nothing).
    model, batch, loss_fn = make("mlp_dead")
    params = dict(model.named_parameters())
    grads = dict(
        zip(params, torch.autograd.grad(loss_fn(model(batch.support_x[0]), batch.support_y[0]), list(params.values())))
    )
    assert (grads["body.0.weight"][:, 0] == 0).all() and (grads["body.0.weight"][1] == 0).all()
    assert (grads["body.2.weight"][:, 1] == 0).all() and (grads["head.weight"][:, 3] == 0).all()
    assert (grads["body.0.weight"][0, 1:] != 0).all()


# ================================================================= the engine against the reference (a)


MATRIX = [(n, m, b) for n in OPTIONS for m in MODES for b in BATCHINGS]
MATRIX += [(n, m, b) for n in CONV_OPTIONS for m in MODES for b in BATCHINGS]
MATRIX_CASES = ["mlp"] * (len(OPTIONS) * 6) + ["conv_bn"] * (len(CONV_OPTIONS) * 6)


@pytest.mark.parametrize(
    "case, name, mode, batching",
    [(c, *row) for c, row in zip(MATRIX_CASES, MATRIX)],
    ids=[f"{c}-{n}-{m}-{b}" for c, (n, m, b) in zip(MATRIX_CASES, MATRIX)],
)
def test_matches_reference(case, name, mode, batching):
    cfg = OPTIONS[name]
    learner, batch, lr = build(case, cfg, spec(mode), batching)
    got = engine_grads(learner, batch, cfg)
    ref, expected = reference_for(learner, batch, cfg, lr, first_order=mode == "first_order")
    assert rel(got, expected) < 1e-10
    out = learner.run(batch, **({"step_weights": step_weights(cfg)} if "step_weights" in cfg else {}))
    assert torch.allclose(out.loss, ref.loss, rtol=1e-12)
    assert torch.allclose(out.query_losses, ref.query_losses, rtol=1e-12)
    for n, v in out.fast.items():
        # A conv bias before BatchNorm has a support gradient of rounding noise (the norm removes
        # it), which Adam scales up to steps of size lr: its fast weight is noise in any two
        # implementations. Its meta-gradient is exact regardless (checked above).
        if case == "conv_bn" and n == "body.0.bias" and cfg.get("inner_optimizer") == "adam":
            continue
        assert torch.allclose(v.detach(), torch.stack([f[n] for f in ref.fast]), rtol=1e-12, atol=1e-14), n
    assert sorted(out.fast) == sorted(ref.fast[0])  # exactly the adapted parameters have fast weights


# ============================================================== the engine against finite differences (b)


@pytest.mark.parametrize(
    "case, name, mode, batching",
    [
        ("mlp", "anil-adam-meta_sgd", "second_order", "vmap"),
        ("mlp", "anil-adam-meta_sgd", "checkpointed", "loop"),
        ("mlp", "boil-nesterov-scalar-sw", "second_order", "loop"),
        ("mlp", "boil-nesterov-scalar-sw", "checkpointed", "vmap"),
        ("mlp", "maml++", "second_order", "vmap"),
        ("mlp", "lslr-adam-sw", "checkpointed", "vmap"),
        ("mlp", "anil-lslr-momentum", "second_order", "vmap"),
        ("conv_bn", "lslr-adam-sw", "second_order", "vmap"),
    ],
)
def test_matches_finite_differences(case, name, mode, batching):
    cfg = OPTIONS[name]
    learner, batch, _ = build(case, cfg, spec(mode), batching)
    params = list(meta_params(learner.model, learner.rate_parameters).values())
    assert directional_error(lambda: engine_loss(learner, batch, cfg), params, order=4) < 1e-6


# ================================================================= checkpointed equals second order (c)

CKPT_VARIANTS: dict[str, Config] = {
    "sgd": {},
    "sgd-lslr-anil-sw": {"learn_inner_lr": "per_layer_per_step", "adapt": HEAD, "step_weights": SW5},
    "momentum-meta_sgd-sw": {**MOMENTUM, "learn_inner_lr": "per_parameter", "step_weights": SW5},
    "nesterov-scalar-boil": {**NESTEROV, "learn_inner_lr": "scalar", "adapt": body},
    "adam-lslr-sw": {**ADAM_LOOSE, "learn_inner_lr": "per_layer_per_step", "step_weights": SW5},
    "adam-anil": {**ADAM, "adapt": HEAD},
    "momentum": MOMENTUM,
}


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("name", list(CKPT_VARIANTS))
@pytest.mark.parametrize("case", ["mlp", "conv_bn"])
def test_checkpointed_equals_second_order(case, name, batching):
    # 5 steps in segments of 2 (2 + 2 + 1): the rule's state crosses every segment boundary.
    cfg = CKPT_VARIANTS[name]
    so, batch, _ = build(case, cfg, "second_order", batching, steps=5)
    ck, _, _ = build(case, cfg, CKPT, batching, steps=5)
    assert rel(engine_grads(ck, batch, cfg), engine_grads(so, batch, cfg)) < 1e-10
    kw = {"step_weights": step_weights(cfg)} if "step_weights" in cfg else {}
    a, b = ck.run(batch, **kw), so.run(batch, **kw)
    assert torch.allclose(a.loss, b.loss, rtol=1e-12)
    for field in ("query_losses", "query_out", "support_losses") + (("step_query_losses",) if kw else ()):
        assert torch.allclose(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14), field
    for n in b.fast:
        assert torch.allclose(a.fast[n], b.fast[n], rtol=1e-12, atol=1e-14), n


# =============================================================== ANIL / BOIL: cross terms, never None (d)


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("adapt", [HEAD, body], ids=["anil", "boil"])
@pytest.mark.parametrize("case", ["mlp", "conv_bn"])
def test_non_adapted_parameters_get_second_order_cross_terms(case, adapt, mode, batching):
    cfg = {"adapt": adapt}
    exact, batch, _ = build(case, cfg, spec(mode), batching)
    first, _, _ = build(case, cfg, "first_order", batching)
    for learner in (exact, first):
        learner.meta_loss(batch).backward()
        missing = [n for n, p in learner.model.named_parameters() if p.grad is None]
        assert not missing, f"{learner.mode}: no .grad for {missing}"
    frozen = [n for n, _ in exact.model.named_parameters() if not adapt_has(adapt, n)]
    assert frozen and len(frozen) < len(list(exact.model.parameters()))
    e = torch.cat([exact.model.get_parameter(n).grad.flatten() for n in frozen])
    f = torch.cat([first.model.get_parameter(n).grad.flatten() for n in frozen])
    assert float((e - f).norm() / e.norm()) > 1e-3


# ============================================= a frozen-then-unfrozen body: the adapt set resolved when built (e)


def _frozen_then_unfrozen(adapt: list[str] | None, mode: str | maml.Mode, batching: str, **kw: Any):
    model, batch, loss_fn = make("mlp")
    for n, p in model.named_parameters():
        p.requires_grad_(not body(n))
    learner = maml.MetaLearner(
        model,
        loss_fn,
        inner_lr=LR["sgd"],
        steps=3,
        mode=mode,
        batching=batching,
        **({} if adapt is None else {"adapt": adapt}),
        **kw,
    )
    for p in model.parameters():
        p.requires_grad_(True)
    return learner, batch


def _assert_adapts(learner: maml.MetaLearner, batch: maml.TaskBatch, adapted: list[str]) -> None:
    """The learner's ``.grad`` is the exact meta-gradient of adapting ``adapted``; no error, no parameter without
    ``.grad``."""
    learner.meta_loss(batch).backward()
    got = {f"model:{n}": p.grad for n, p in learner.model.named_parameters()}
    missing = [k for k, g in got.items() if g is None]
    assert not missing, f"no .grad (silently) for {missing}"
    model = learner.model
    ref = reference(
        model,
        learner.loss_fn,
        batch,
        {},
        inner_lr=LR["sgd"],
        steps=3,
        first_order=learner.mode == "first_order",
        adapted=adapted,
    )
    assert rel(got, grads_of(ref.loss, meta_params(model, {}))) < 1e-10


FROZEN_CONFIGS = [
    ("second_order", "vmap", {}),
    ("second_order", "loop", {}),
    ("first_order", "vmap", {}),
    ("first_order", "loop", {}),
    (CKPT, "vmap", {}),
    ("checkpointed", "loop", {}),
]


@pytest.mark.parametrize(
    "mode, batching, kw", FROZEN_CONFIGS, ids=[f"{maml.Mode.of(m).name}-{b}" for m, b, _ in FROZEN_CONFIGS]
)
@pytest.mark.parametrize("adapt", [None, HEAD], ids=["default", "anil"])
def test_a_body_unfrozen_after_build_is_adapted_where_adapt_selects_it(adapt, mode, batching, kw):
    """Unfreezing is followed as a tie is: adapt=None adapts the body now, as a learner built now would; a list
    that names the head alone keeps adapting the head (the body is meta-learned, as any trainable parameter
    outside ``adapt``)."""
    learner, batch = _frozen_then_unfrozen(adapt, mode, batching, **kw)
    _assert_adapts(learner, batch, [n for n, _ in learner.model.named_parameters()] if adapt is None else HEAD)


# ========================================== per-layer per-step rates with more (or fewer) evaluation steps (f)


@pytest.mark.parametrize("eval_steps", [5, 2])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("mode", MODES)
def test_per_layer_per_step_rates_at_other_step_counts(mode, batching, rule, eval_steps):
    # Built with 3 steps: 5 steps reuse the last step's rate for steps 4 and 5; 2 steps use the
    # first two rates (the third one's meta-gradient is exactly 0).
    cfg = {"learn_inner_lr": "per_layer_per_step", **({} if rule == "sgd" else ADAM)}
    learner, batch, lr = build("mlp", cfg, spec(mode), batching, steps=3)
    assert all(r.shape == (3,) for r in learner.rate_parameters.values())
    got = engine_grads(learner, batch, cfg, steps=eval_steps)
    ref, expected = reference_for(learner, batch, cfg, lr, first_order=mode == "first_order", eval_steps=eval_steps)
    assert rel(got, expected) < 1e-10
    if eval_steps == 2:
        assert all((got[f"rate:{k}"][2] == 0).all() for k in learner.rate_parameters)
    with torch.no_grad():  # evaluation
        out = learner.run(batch, steps=eval_steps)
    assert torch.allclose(out.query_losses, ref.query_losses, rtol=1e-12)


# ========================================================================== mode switch on a live learner (g)


def test_mode_switch_on_a_live_learner():
    cfg = {"learn_inner_lr": "per_layer_per_step", **MOMENTUM, "adapt": HEAD}
    learner, batch, lr = build("mlp", cfg, "second_order", "vmap")
    _, so = reference_for(learner, batch, cfg, lr, first_order=False)
    _, fo = reference_for(learner, batch, cfg, lr, first_order=True)
    assert rel(so, fo) > 1e-3
    for mode, expected in [
        ("second_order", so),
        ("first_order", fo),
        ("checkpointed", so),
        ("first_order", fo),
        ("second_order", so),
    ]:
        learner.mode = mode
        assert learner.mode == mode
        assert rel(engine_grads(learner, batch, cfg), expected) < 1e-10, mode
    with pytest.raises(ValueError, match=r"(?s)mode.*'fist_order'"):
        learner.mode = "fist_order"
    assert learner.mode == "second_order"  # unchanged by the refused value
    assert rel(engine_grads(learner, batch, cfg), so) < 1e-10


# ================================================================== Adam at an exactly zero gradient (h)


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("mode", MODES)
def test_adam_with_exactly_zero_gradients_is_finite_and_exact(mode, batching):
    cfg = {**ADAM, "learn_inner_lr": "per_layer_per_step"}
    learner, batch, lr = build("mlp_dead", cfg, spec(mode), batching)
    got = engine_grads(learner, batch, cfg)
    assert all(torch.isfinite(g).all() for g in got.values())
    _, expected = reference_for(learner, batch, cfg, lr, first_order=mode == "first_order")
    assert rel(got, expected) < 1e-10
    # The never-updated input column still has a meta-gradient (through the query loss).
    assert got["model:body.0.weight"][:, 0].abs().sum() > 0
    if mode != "first_order":
        params = list(meta_params(learner.model, learner.rate_parameters).values())
        assert directional_error(lambda: engine_loss(learner, batch, cfg), params, order=4) < 1e-6


# ======================================================================= momentum and Adam vs higher (i)

HIGHER = ["momentum", "nesterov", "adam", "adam_defaults", "anil-adam-meta_sgd", "anil-lslr-momentum", "lslr-adam-sw"]


HIGHER_CONFIGS = [(n, m, "vmap") for n in HIGHER for m in MODES]
HIGHER_CONFIGS += [
    ("nesterov", "second_order", "loop"),
    ("adam", "first_order", "loop"),
    ("lslr-adam-sw", "checkpointed", "loop"),
]


@pytest.mark.parametrize("name, mode, batching", HIGHER_CONFIGS, ids=["-".join(c) for c in HIGHER_CONFIGS])
def test_equals_higher(name, mode, batching):
    cfg = OPTIONS[name]
    learner, batch, lr = build("mlp", cfg, spec(mode), batching)
    got = engine_grads(learner, batch, cfg)
    rates = {k: r.detach().clone().requires_grad_() for k, r in learner.rate_parameters.items()}
    peer = higher_loss(
        learner.model, learner.loss_fn, batch, cfg, inner_lr=lr, steps=3, first_order=mode == "first_order", rates=rates
    )
    assert rel(got, grads_of(peer, meta_params(learner.model, rates))) < 1e-10


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize(
    "name", ["momentum", "nesterov", "adam", "adam_defaults", "lslr-adam-sw", "anil-lslr-momentum"]
)
def test_fast_weights_equal_torch_optim(name, batching):
    cfg = OPTIONS[name]
    learner, batch, lr = build("mlp", cfg, "second_order", batching)
    fast = learner.run(batch).fast
    rates = {k: r.detach() for k, r in learner.rate_parameters.items()}
    for t in range(batch.num_tasks):
        expected = torch_optim_fast(
            learner.model, learner.loss_fn, batch, cfg, inner_lr=lr, steps=3, rates=rates, task=t
        )
        assert sorted(fast) == sorted(expected)
        for n in expected:
            assert torch.allclose(fast[n][t].detach(), expected[n], rtol=1e-12, atol=1e-14), (t, n)


# ============================================================================ the multi-step loss and API


@pytest.mark.parametrize("mode", MODES)
def test_step_query_losses(mode):
    cfg = {"step_weights": SW3, **ADAM}
    learner, batch, lr = build("mlp", cfg, spec(mode), "vmap")
    plain = learner.run(batch)
    assert plain.step_query_losses is None
    out = learner.run(batch, step_weights=step_weights(cfg))
    ref, _ = reference_for(learner, batch, cfg, lr, first_order=mode == "first_order")
    assert out.step_query_losses.shape == (3, batch.num_tasks)
    assert torch.allclose(out.step_query_losses, ref.step_query_losses, rtol=1e-12)
    assert torch.allclose(out.query_losses, out.step_query_losses[-1], rtol=1e-12)
    assert torch.allclose(plain.loss, out.step_query_losses[-1].mean(), rtol=1e-12)
    expected = (step_weights(cfg) * out.step_query_losses.mean(dim=1)).sum()
    assert torch.allclose(out.loss, expected, rtol=1e-12)
    assert torch.allclose(learner.meta_loss(batch, step_weights=step_weights(cfg)), expected, rtol=1e-12)
    # All weight on the last step is the plain meta-loss, gradient included.
    last = torch.tensor([0.0, 0.0, 1.0], dtype=DTYPE)
    params = meta_params(learner.model, learner.rate_parameters)
    assert (
        rel(grads_of(learner.meta_loss(batch, step_weights=last), params), grads_of(learner.meta_loss(batch), params))
        < 1e-12
    )


def test_rate_layout_and_parameters():
    learner, _, lr = build(
        "mlp", {"adapt": HEAD, "learn_inner_lr": "per_layer_per_step"}, "second_order", "vmap", steps=4
    )
    assert list(learner.rate_parameters) == HEAD
    for rate in learner.rate_parameters.values():
        assert isinstance(rate, nn.Parameter) and rate.shape == (4,) and rate.dtype == DTYPE
    params = list(learner.parameters())
    expected = [*learner.model.parameters(), *learner.rate_parameters.values()]
    assert len(params) == len(expected) and all(a is b for a, b in zip(params, expected))
    model, _, loss_fn = make("mlp")
    fresh = maml.MetaLearner(model, loss_fn, inner_lr=0.25, steps=2, adapt=body, learn_inner_lr="per_layer_per_step")
    assert list(fresh.rate_parameters) == [n for n, _ in model.named_parameters() if body(n)]
    assert all(torch.equal(r, torch.full((2,), 0.25, dtype=DTYPE)) for r in fresh.rate_parameters.values())


def test_adapt_predicate_equals_adapt_list():
    a, batch, _ = build("mlp", {"adapt": body}, "second_order", "vmap")
    b, _, _ = build("mlp", {"adapt": [n for n, _ in a.model.named_parameters() if body(n)]}, "second_order", "vmap")
    assert rel(engine_grads(a, batch, {}), engine_grads(b, batch, {})) == 0


# ============================================================================================ compile=True


def _compiled_case(cfg: Config, mode: str, batching: str, case: str = "mlp"):
    eager, batch, lr = build(case, cfg, mode, batching)
    compiled, _, _ = build(case, cfg, mode, batching, compile=True)
    return eager, compiled, batch, lr


def test_compiled_second_order_family():
    # ANIL + Adam (with exact zeros in the head's support gradient: a dead unit) + LSLR + multi-step loss.
    cfg = {"adapt": HEAD, **ADAM, "learn_inner_lr": "per_layer_per_step", "step_weights": SW3}
    eager, compiled, batch, lr = _compiled_case(cfg, "second_order", "vmap", case="mlp_dead")
    got = engine_grads(compiled, batch, cfg)
    _, expected = reference_for(compiled, batch, cfg, lr, first_order=False)
    assert rel(got, expected) < 1e-10
    assert rel(got, engine_grads(eager, batch, cfg)) < 1e-10
    _, first = reference_for(compiled, batch, cfg, lr, first_order=True)
    body_keys = [k for k in got if k.startswith("model:body.")]
    assert rel({k: got[k] for k in body_keys}, {k: first[k] for k in body_keys}) > 1e-3  # cross terms
    compiled.meta_loss(batch, step_weights=step_weights(cfg)).backward()
    assert all(p.grad is not None for p in compiled.parameters())
    a, b = compiled.run(batch, step_weights=step_weights(cfg)), eager.run(batch, step_weights=step_weights(cfg))
    assert torch.allclose(a.step_query_losses, b.step_query_losses, rtol=1e-10)
    params = list(meta_params(compiled.model, compiled.rate_parameters).values())
    assert directional_error(lambda: engine_loss(compiled, batch, cfg), params, order=4) < 1e-6


def test_compiled_first_order_family_and_mode_switch():
    # BOIL + Nesterov momentum + Meta-SGD + multi-step loss, one task at a time; then the
    # derivative order switched on the live compiled learner, and back.
    cfg = {"adapt": body, **NESTEROV, "learn_inner_lr": "per_parameter", "step_weights": SW3}
    eager, compiled, batch, lr = _compiled_case(cfg, "first_order", "loop")
    got = engine_grads(compiled, batch, cfg)
    _, first = reference_for(compiled, batch, cfg, lr, first_order=True)
    _, second = reference_for(compiled, batch, cfg, lr, first_order=False)
    assert rel(got, first) < 1e-10
    assert rel(got, engine_grads(eager, batch, cfg)) < 1e-10
    compiled.meta_loss(batch, step_weights=step_weights(cfg)).backward()
    assert all(p.grad is not None for p in compiled.parameters())
    for mode, expected in [("second_order", second), ("first_order", first)]:
        compiled.mode = mode
        assert rel(engine_grads(compiled, batch, cfg), expected) < 1e-10, mode
    with pytest.raises(ValueError, match="checkpointed"):  # compile=True does not take the checkpointed mode
        compiled.mode = "checkpointed"
    assert compiled.mode == "first_order"


def test_compiled_body_unfrozen_after_build_keeps_adapting_the_head_its_adapt_names():
    learner, batch = _frozen_then_unfrozen(HEAD, "second_order", "vmap", compile=True)
    _assert_adapts(learner, batch, HEAD)


# ============================================================================================ errors (j)


def _learner(**kw: Any) -> maml.MetaLearner:
    model, _, loss_fn = make("mlp")
    return maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=3, **kw)


def test_error_unknown_inner_optimizer():
    with pytest.raises(ValueError, match=r"(?s)inner_optimizer.*'adm'.*'adam'"):
        _learner(inner_optimizer="adm")


@pytest.mark.parametrize(
    "optimizer, options, bad",
    [
        ("adam", {"beta": (0.9, 0.99)}, "beta"),
        ("momentum", {"momentun": 0.9}, "momentun"),
        ("sgd", {"betas": (0.9, 0.99)}, "betas"),
        ("adam", {"betas": (0.9, 1.5)}, "betas"),
        ("momentum", {"momentum": -0.1}, "momentum"),
        ("adam", {"eps": 0.0}, "eps"),
    ],
)
def test_error_bad_inner_optimizer_options(optimizer, options, bad):
    with pytest.raises(ValueError, match=rf"(?s)inner_optimizer_options.*{bad}"):
        _learner(inner_optimizer=optimizer, inner_optimizer_options=options)


def test_error_adapt():
    with pytest.raises(ValueError, match=r"(?s)adapt.*'head\.weigth'.*'head\.weight'"):
        _learner(adapt=["head.weigth", "head.bias"])
    with pytest.raises(ValueError, match=r"adapt"):
        _learner(adapt=[])
    with pytest.raises(ValueError, match=r"adapt"):
        _learner(adapt=lambda name: False)  # selects nothing


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.2, 0.3, 0.2, 0.3], [[0.2, 0.3, 0.5]]], ids=["short", "long", "2d"])
def test_error_step_weights_shape(weights):
    learner = _learner()
    model, batch, _ = make("mlp")
    with pytest.raises(ValueError, match=r"step_weights"):
        learner.meta_loss(batch, step_weights=torch.tensor(weights, dtype=DTYPE))


def test_error_learn_inner_lr_names_the_choices():
    with pytest.raises(ValueError, match=r"(?s)learn_inner_lr.*'per_layer_per_stp'.*'per_layer_per_step'"):
        _learner(learn_inner_lr="per_layer_per_stp")
