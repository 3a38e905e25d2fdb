"""An inner objective of the user's choosing (``inner_loss_fn``) and inner data that changes per step
(``TaskBatch(per_step=True)``), exact in every mode, batching and inner optimizer (float64).

References, none of them the engine: a hand-written ``higher`` loop with the same inner loss and each step's
own support set (second order), the same loop by hand with detached inner gradients (first order) or without a
graph (Reptile), central finite differences of the meta-loss (every exact path, learned rates and options), and
iMAML's closed form on ridge regression.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, EXACT_PATHS, directional_error, make
from torch import Tensor, nn

import maml

with warnings.catch_warnings():  # gym, imported by learn2learn (beside higher), warns about its own deprecation
    warnings.simplefilter("ignore")
    import higher

LR, STEPS, SETS, LAM = 0.1, 3, 2, 0.7


def quartic(out: Tensor, y: Tensor) -> Tensor:
    """An inner loss other than the outer one."""
    return (out - y).pow(4).mean()


def proximal(out: Tensor, y: Tensor, *, fast: dict[str, Tensor], initial: dict[str, Tensor]) -> Tensor:
    """The support loss plus a proximal term to the initial weights (reads both)."""
    return F.mse_loss(out, y) + LAM / 2 * sum((fast[k] - initial[k]).pow(2).sum() for k in fast)


def unlabelled(out: Tensor, y: Tensor, *, fast: dict[str, Tensor], step: int) -> Tensor:
    """No labels (``y`` ignored), a weight-norm term, and a weight that changes with the step."""
    return (1 + step) * out.pow(2).mean() + 0.01 * sum(v.pow(2).sum() for v in fast.values())


INNER_LOSSES = {"quartic": quartic, "proximal": proximal, "unlabelled": unlabelled}


def reads(fn) -> set[str]:
    return set(maml._src.forward.InnerLoss.of(fn).keywords)


def call_inner(fn, out: Tensor, y: Tensor, fast: dict[str, Tensor], initial: dict[str, Tensor], step: int) -> Tensor:
    """The reference's call of an inner loss: the keywords it names, from the reference's own tensors."""
    given = {"fast": fast, "initial": initial, "step": step}
    return fn(out, y, **{k: given[k] for k in reads(fn)})


def per_step_batch(batch: maml.TaskBatch, sets: int = SETS, seed: int = 5) -> maml.TaskBatch:
    """``batch`` with ``sets`` support sets a task: the first is the batch's own, the others drawn anew."""
    g = torch.Generator().manual_seed(seed)
    xs = [batch.support_x] + [torch.randn(batch.support_x.shape, generator=g, dtype=DTYPE) for _ in range(sets - 1)]
    ys = [batch.support_y] + [torch.randn(batch.support_y.shape, generator=g, dtype=DTYPE) for _ in range(sets - 1)]
    return maml.TaskBatch(torch.stack(xs, 1), torch.stack(ys, 1), batch.query_x, batch.query_y, per_step=True)


def support(batch: maml.TaskBatch, t: int, k: int) -> tuple[Tensor, Tensor]:
    if batch.per_step:
        s = k % batch.support_x.shape[1]
        return batch.support_x[t, s], batch.support_y[t, s]
    return batch.support_x[t], batch.support_y[t]


def higher_grads(model: nn.Module, batch: maml.TaskBatch, inner, steps: int = STEPS) -> list[Tensor]:
    """A hand-written higher loop: each step's own support set, the inner loss at higher's fast weights."""
    names = [k for k, _ in model.named_parameters()]
    initial = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.zero_grad()
    for t in range(batch.num_tasks):
        with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
            for k in range(steps):
                x, y = support(batch, t, k)
                fast = dict(zip(names, fmodel.parameters()))
                diffopt.step(call_inner(inner, fmodel(x), y, fast, initial, k))
            # The toolkit's meta-loss is the mean over tasks; higher's loop sums: divide by T.
            (F.mse_loss(fmodel(batch.query_x[t]), batch.query_y[t]) / batch.num_tasks).backward()
    return [p.grad.clone() for p in model.parameters()]


def by_hand(model: nn.Module, batch: maml.TaskBatch, inner, *, graph: bool) -> tuple[list[Tensor], list[Tensor]]:
    """First order (``graph``: the query loss's gradient at the fast weights, inner gradients constants) and
    Reptile (no graph: ``theta - mean phi``), by hand with ``torch.func.functional_call``."""
    params = dict(model.named_parameters())
    grads = [torch.zeros_like(p) for p in params.values()]
    directions = [torch.zeros_like(p) for p in params.values()]
    for t in range(batch.num_tasks):
        fast = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        for k in range(STEPS):
            x, y = support(batch, t, k)
            loss = call_inner(inner, torch.func.functional_call(model, fast, (x,)), y, fast, params, k)
            g = torch.autograd.grad(loss, list(fast.values()))
            fast = {n: (v - LR * gi).detach().requires_grad_() for (n, v), gi in zip(fast.items(), g)}
        q = F.mse_loss(torch.func.functional_call(model, fast, (batch.query_x[t],)), batch.query_y[t])
        for i, gi in enumerate(torch.autograd.grad(q, list(fast.values()))):
            grads[i] += gi / batch.num_tasks
        for i, (n, p) in enumerate(params.items()):
            directions[i] += (p.detach() - fast[n].detach()) / batch.num_tasks
    return grads, directions


def learner_grads(model: nn.Module, batch: maml.TaskBatch, inner, **options) -> list[Tensor]:
    learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, inner_loss_fn=inner, **options)
    model.zero_grad()
    learner.meta_loss(batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same(got: list[Tensor], expected: list[Tensor], rtol: float = 1e-10) -> None:
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, rtol=rtol, atol=1e-13), (g - e).abs().max()


@pytest.mark.parametrize("per_step", [False, True], ids=["one-set", "per-step"])
@pytest.mark.parametrize("inner", list(INNER_LOSSES), ids=list(INNER_LOSSES))
@pytest.mark.parametrize("path", [pytest.param({"batching": "vmap"}, id="vmap"), *EXACT_PATHS])
def test_every_exact_path_equals_a_higher_loop_with_the_same_inner_loss_and_data(path, inner, per_step):
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch) if per_step else batch
    expected = higher_grads(model, batch, INNER_LOSSES[inner])
    assert_same(learner_grads(model, batch, INNER_LOSSES[inner], **path), expected)


@pytest.mark.parametrize("per_step", [False, True], ids=["one-set", "per-step"])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_first_order_and_reptile_equal_their_loops_by_hand(batching, per_step):
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch) if per_step else batch
    grads, directions = by_hand(model, batch, proximal, graph=True)
    assert_same(learner_grads(model, batch, proximal, mode="first_order", batching=batching), grads)
    assert_same(learner_grads(model, batch, proximal, mode="reptile", batching=batching), directions)


@pytest.mark.parametrize("per_step", [False, True], ids=["one-set", "per-step"])
def test_norm_layers_and_convolutions_with_an_inner_loss_equal_higher(per_step):
    model, batch, _ = make("conv_batchnorm_maxpool")
    batch = per_step_batch(batch) if per_step else batch
    if per_step:  # class labels for the new sets
        batch = maml.TaskBatch(
            batch.support_x, batch.support_y.abs().long() % 3, batch.query_x, batch.query_y, per_step=True
        )

    def inner(out: Tensor, y: Tensor, *, fast: dict[str, Tensor], initial: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(out, y) + LAM / 2 * sum((fast[k] - initial[k]).pow(2).sum() for k in fast)

    names = [k for k, _ in model.named_parameters()]
    initial = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for t in range(batch.num_tasks):
        with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
            for k in range(STEPS):
                x, y = support(batch, t, k)
                diffopt.step(inner(fmodel(x), y, fast=dict(zip(names, fmodel.parameters())), initial=initial))
            (F.cross_entropy(fmodel(batch.query_x[t]), batch.query_y[t]) / batch.num_tasks).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for options in ({"batching": "vmap"}, {"mode": maml.Checkpointed(hvp="forward_over_reverse")}):
        learner = maml.MetaLearner(model, F.cross_entropy, LR, STEPS, inner_loss_fn=inner, **options)
        model.zero_grad()
        learner.meta_loss(batch).backward()
        assert_same([p.grad for p in model.parameters()], expected)


@pytest.mark.parametrize("optimizer", sorted(maml.INNER_OPTIMIZERS))
def test_every_inner_optimizer_with_an_inner_loss_and_per_step_data_against_finite_differences(optimizer):
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch)
    learner = maml.MetaLearner(model, F.mse_loss, 0.05, STEPS, inner_loss_fn=proximal, inner_optimizer=optimizer)
    assert directional_error(lambda: learner.meta_loss(batch), list(learner.parameters()), order=4) < 1e-7


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"learn_inner_lr": "per_layer_per_step"}, id="lslr"),
        pytest.param({"learn_inner_lr": "per_parameter", "mode": "checkpointed"}, id="metasgd-checkpointed"),
        pytest.param(
            {"inner_optimizer": "adam", "inner_optimizer_options": {"learn": ["betas"]}}, id="adam-learned-betas"
        ),
        pytest.param(
            {
                "inner_optimizer": "rmsprop",
                "inner_optimizer_options": {"learn": ["alpha"]},
                "mode": maml.Checkpointed(hvp="forward_over_reverse"),
            },
            id="rmsprop-learned-alpha-fwd",
        ),
    ],
)
def test_learned_rates_and_options_get_the_exact_meta_gradient_through_the_inner_loss(options):
    model, batch, _ = make("mlp")
    smooth, _, _ = make("mlp")
    smooth[1] = nn.Tanh()  # Adam's and RMSprop's unlabelled steps leave no room for a ReLU kink within a step
    batch = per_step_batch(batch)
    learner = maml.MetaLearner(smooth, F.mse_loss, 0.05, STEPS, inner_loss_fn=unlabelled, **options)
    learner2 = maml.MetaLearner(model, F.mse_loss, 0.05, STEPS, inner_loss_fn=proximal, **options)
    for one in (learner, learner2):
        # The fourth-order stencil: Adam's update is curved at the scale of a step where a gradient is small.
        assert directional_error(lambda one=one: one.meta_loss(batch), list(one.parameters()), order=4) < 1e-7


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_chunked_backward_and_a_memory_budget_give_the_same_meta_gradient(batching):
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch)
    expected = learner_grads(model, batch, proximal, batching=batching)
    for kwargs, budget in (({"chunk": 1}, None), ({"chunk": 2}, None), ({}, "4MiB")):
        learner = maml.MetaLearner(
            model, F.mse_loss, LR, STEPS, inner_loss_fn=proximal, batching=batching, memory_budget=budget
        )
        model.zero_grad()
        learner.backward(batch, **kwargs)
        assert_same([p.grad for p in model.parameters()], expected)


def test_training_evaluation_and_adapt_adapt_alike():
    """The fast weights of run (grad on), run under no_grad and adapt, each task's own, are the same."""
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch, sets=2)
    for mode in ("second_order", "first_order", "checkpointed", "reptile"):
        learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, inner_loss_fn=proximal, mode=mode)
        trained = learner.run(batch).fast
        with torch.no_grad():
            evaluated = learner.run(batch).fast
        for t in range(batch.num_tasks):
            one = learner.adapt(batch.support_x[t], batch.support_y[t], per_step=True)
            for k, v in trained.items():
                torch.testing.assert_close(v[t].detach(), evaluated[k][t], rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(one[k].detach(), v[t].detach(), rtol=1e-12, atol=1e-14)


def test_steps_beyond_the_sets_go_round_them_again():
    model, batch, _ = make("mlp")
    two = per_step_batch(batch, sets=2)
    # Four steps over two sets equal four steps over the same two sets written out four times.
    four = maml.TaskBatch(
        two.support_x.repeat(1, 2, 1, 1), two.support_y.repeat(1, 2, 1, 1), two.query_x, two.query_y, per_step=True
    )
    learner = maml.MetaLearner(model, F.mse_loss, LR, 4)
    assert_same(
        list(torch.autograd.grad(learner.meta_loss(two), list(model.parameters()))),
        list(torch.autograd.grad(learner.meta_loss(four), list(model.parameters()))),
        rtol=0,
    )


def test_compiled_takes_the_inner_loss_and_per_step_data():
    model, batch, _ = make("mlp")
    batch = per_step_batch(batch)
    expected = higher_grads(model, batch, unlabelled)
    assert_same(learner_grads(model, batch, unlabelled, compile=True), expected)


# ---------------------------------------------------------------------------------------------- iMAML


def ridge(seed: int = 0, sets: int = 1):
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 4, generator=g, dtype=DTYPE))
    x = 0.5 * torch.randn(3, sets, 8, 4, generator=g, dtype=DTYPE)
    y = torch.randn(3, sets, 8, 1, generator=g, dtype=DTYPE)
    q, qy = 0.5 * torch.randn(3, 6, 4, generator=g, dtype=DTYPE), torch.randn(3, 6, 1, generator=g, dtype=DTYPE)
    if sets == 1:
        return model, maml.TaskBatch(x[:, 0], y[:, 0], q, qy)
    return model, maml.TaskBatch(x, y, q, qy, per_step=True)


def scaled(out: Tensor, y: Tensor) -> Tensor:
    return 3.0 * F.mse_loss(out, y)


def test_implicit_with_an_inner_loss_equals_the_exactly_solved_problem():
    model, batch = ridge()
    learner = maml.MetaLearner(
        model, F.mse_loss, 0.1, 300, inner_loss_fn=scaled, mode=maml.Implicit(lam=LAM, cg_iterations=4, cg_tolerance=0)
    )
    learner.meta_loss(batch).backward()

    def exact(theta: Tensor) -> Tensor:  # the proximal solution of 3 * mse, in closed form
        total = 0.0
        for t in range(3):
            x, y = batch.support_x[t], batch.support_y[t]
            a, b = 3 * 2 / 8 * x.T @ x, 3 * 2 / 8 * x.T @ y
            w = torch.linalg.solve(a + LAM * torch.eye(4, dtype=DTYPE), b + LAM * theta.T)
            total = total + F.mse_loss(batch.query_x[t] @ w, batch.query_y[t])
        return total / 3

    theta = model.weight.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(exact(theta), theta)
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-9, atol=1e-12)


def test_implicit_with_per_step_data_takes_the_mean_hessian_of_the_sets():
    """The proximal loop over two support sets by hand, then (I + H/lam)^-1 g with H the mean of the sets'
    Hessians (of a quadratic: exact), solved by torch.linalg.solve."""
    model, batch = ridge(sets=2)
    steps = 7
    learner = maml.MetaLearner(
        model, F.mse_loss, 0.1, steps, mode=maml.Implicit(lam=LAM, cg_iterations=4, cg_tolerance=0)
    )
    learner.meta_loss(batch).backward()
    theta = model.weight.detach()
    expected = torch.zeros_like(theta)
    for t in range(3):
        w = theta.clone()
        for k in range(steps):
            x, y = batch.support_x[t, k % 2], batch.support_y[t, k % 2]
            grad = 2 / 8 * (x @ w.T - y).T @ x
            w = w - 0.1 * (grad + LAM * (w - theta))
        q, qy = batch.query_x[t], batch.query_y[t]
        g = 2 / 6 * (q @ w.T - qy).T @ q  # (1, 4)
        h = sum(2 / 8 * batch.support_x[t, s].T @ batch.support_x[t, s] for s in range(2)) / 2
        expected += torch.linalg.solve(torch.eye(4, dtype=DTYPE) + h / LAM, g.T).T / 3
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------- refusals


def test_implicit_refuses_an_inner_loss_that_reads_the_initial_weights():
    model, _, _ = make("mlp")
    with pytest.raises(ValueError, match=r"mode='implicit' cannot take an inner_loss_fn that reads initial="):
        maml.MetaLearner(model, F.mse_loss, LR, mode="implicit", inner_loss_fn=proximal)
    learner = maml.MetaLearner(model, F.mse_loss, LR, inner_loss_fn=proximal)
    with pytest.raises(ValueError, match=r"cannot take an inner_loss_fn that reads initial="):
        learner.mode = "implicit"


def test_bad_inner_losses_and_per_step_batches_say_what_to_do():
    model, batch, _ = make("mlp")
    with pytest.raises(TypeError, match=r"inner_loss_fn must be callable as inner_loss_fn\(output, y\) -> scalar"):
        maml.MetaLearner(model, F.mse_loss, LR, inner_loss_fn="mse")
    learner = maml.MetaLearner(model, F.mse_loss, LR, inner_loss_fn=lambda out, y: (out - y).pow(2))
    with pytest.raises(ValueError, match=r"^inner_loss_fn returned a tensor of shape \(5, 1\) for one task"):
        learner.meta_loss(batch)
    with pytest.raises(ValueError, match=r"per_step=True needs \(T tasks, S >= 1 inner steps' sets, n examples"):
        maml.TaskBatch(batch.support_x[:, 0], batch.support_y[:, 0], batch.query_x, batch.query_y, per_step=True)
    with pytest.raises(ValueError, match=r"support_x has 2 inner steps' sets \(dimension 1\) but support_y has 1"):
        two = per_step_batch(batch)
        maml.TaskBatch(two.support_x, two.support_y[:, :1], two.query_x, two.query_y, per_step=True)
    with pytest.raises(ValueError, match=r"support sets of their own per inner step: pass per_step=True"):
        two = per_step_batch(batch)
        maml.TaskBatch(two.support_x, two.support_y, two.query_x, two.query_y)
    with pytest.raises(TypeError, match=r"TaskBatch: per_step must be True or False, got 1"):
        maml.TaskBatch(*batch.tensors, per_step=1)


def test_an_inner_loss_set_on_a_live_learner_acts_as_one_built_with_it():
    model, batch, _ = make("mlp")
    live = maml.MetaLearner(model, F.mse_loss, LR, STEPS)
    live.meta_loss(batch)
    live.inner_loss_fn = quartic
    built = maml.MetaLearner(model, F.mse_loss, LR, STEPS, inner_loss_fn=quartic)
    assert_same(
        list(torch.autograd.grad(live.meta_loss(batch), list(model.parameters()))),
        list(torch.autograd.grad(built.meta_loss(batch), list(model.parameters()))),
        rtol=0,
    )
    assert "quartic" in repr(live)


@pytest.mark.parametrize(
    "options",
    [{"mode": "checkpointed"}, {"compile": True}, {"mode": "reptile"}],
    ids=["checkpointed", "compiled", "reptile"],
)
def test_a_tensor_the_inner_loss_closes_over_is_refused_where_it_would_get_no_gradient(options):
    model, batch, _ = make("mlp")
    weight = torch.ones(batch.support_x.shape[1], dtype=DTYPE, requires_grad=True)

    def inner(out: Tensor, y: Tensor) -> Tensor:
        return (weight * (out - y).pow(2).squeeze(-1)).mean()

    learner = maml.MetaLearner(model, F.mse_loss, LR, STEPS, inner_loss_fn=inner, **options)
    with pytest.raises(ValueError, match=r"^inner_loss_fn reads a tensor that requires grad and is none of its argu"):
        learner.meta_loss(batch)
    plain = maml.MetaLearner(model, F.mse_loss, LR, STEPS, inner_loss_fn=inner)  # second order: autograd reaches it
    plain.meta_loss(batch).backward()
    assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)


def test_adapt_given_a_batch_on_a_fresh_learner_says_so():
    model, batch, loss_fn = make("conv_groupnorm")
    learner = maml.MetaLearner(model, loss_fn, LR)
    with pytest.raises(ValueError, match=r"adapt takes one task, \(n, \*x_shape\); if this is a batch of 3 tasks of 6"):
        learner.adapt(batch.support_x, batch.support_y)
