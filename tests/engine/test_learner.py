"""MetaLearner's behaviour beyond the gradient values: state, modes of use, dtypes, randomness."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import flat_grad, make
from torch import nn
from torch.func import functional_call

import maml


def test_reads_the_current_parameters_on_every_call_and_never_writes_them():
    model, batch, loss_fn = make("conv_batchnorm_maxpool")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = learner.meta_loss(batch)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    second = learner.meta_loss(batch)
    assert not torch.equal(first, second)

    fresh = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=2)
    assert torch.equal(second, fresh.meta_loss(batch))


def test_backward_fills_grad_of_model_parameters_and_learnable_rates():
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, learn_inner_lr="scalar")
    learner.meta_loss(batch).backward()
    params = list(learner.parameters())
    assert len(params) == len(list(model.parameters())) + 1
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_adapt_returns_one_tasks_fast_weights():
    model, batch, loss_fn = make("conv_batchnorm_maxpool")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=3)
    out = learner.run(batch)
    fast = learner.adapt(batch.support_x[1], batch.support_y[1])
    assert set(fast) == set(dict(model.named_parameters()))
    for k, v in fast.items():
        assert torch.allclose(v, out.fast[k][1], rtol=1e-12, atol=1e-14)
    # The fast weights lower the task's support loss and are differentiable w.r.t. the initial ones.
    loss = loss_fn(functional_call(model, fast, (batch.support_x[1],)), batch.support_y[1])
    assert float(loss.detach()) < float(out.support_losses[0, 1])
    assert loss.requires_grad


def test_adapt_under_no_grad_gives_the_same_values_without_a_graph():
    model, batch, loss_fn = make("mlp_layernorm")
    for mode in maml.MODES:
        learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=3, mode=mode)
        with_graph = learner.adapt(batch.support_x[0], batch.support_y[0])
        with torch.no_grad():
            without = learner.adapt(batch.support_x[0], batch.support_y[0])
            out = learner.run(batch)
        for k in with_graph:
            assert torch.equal(with_graph[k], without[k]) or torch.allclose(with_graph[k], without[k], rtol=1e-14)
            assert not without[k].requires_grad
        assert not out.loss.requires_grad


def test_run_reports_losses_and_outputs_with_shapes():
    model, batch, loss_fn = make("conv_groupnorm")
    out = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=4).run(batch)
    assert out.loss.shape == ()
    assert out.query_losses.shape == (3,)
    assert out.query_out.shape == (3, 9, 3)
    assert out.support_losses.shape == (4, 3)
    assert torch.allclose(out.loss, out.query_losses.mean())
    assert all(v.shape == (3, *p.shape) for (k, p), v in zip(model.named_parameters(), out.fast.values()))
    assert (out.support_losses[-1] < out.support_losses[0]).all()


def test_frozen_parameters_are_not_adapted_and_get_no_gradient():
    model, batch, loss_fn = make("mlp")
    model[0].requires_grad_(False)
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2)
    out = learner.run(batch)
    assert "0.weight" not in out.fast and "2.weight" in out.fast
    out.loss.backward()
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    fast = learner.adapt(batch.support_x[0], batch.support_y[0])
    assert fast["0.weight"] is model[0].weight


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_dropout_is_replayed_exactly_by_the_checkpointed_mode(batching):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1)).double()
    _, batch, _ = make("mlp")
    grads = {}
    for mode in ("second_order", "checkpointed"):
        learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=4, mode=mode, batching=batching)
        torch.manual_seed(7)
        grads[mode] = flat_grad(learner, batch)
    assert torch.allclose(grads["checkpointed"], grads["second_order"], rtol=0, atol=1e-12)
    torch.manual_seed(8)  # other masks, other gradient: dropout is really active
    assert not torch.allclose(flat_grad(learner, batch), grads["second_order"])


def test_float32_agrees_with_float64():
    model, batch, loss_fn = make("conv_batchnorm_maxpool")
    grads = {}
    for dtype in (torch.float64, torch.float32):
        learner = maml.MetaLearner(model.to(dtype), loss_fn, inner_lr=0.3, steps=2, learn_inner_lr="scalar").to(dtype)
        grads[dtype] = flat_grad(learner, batch.to(dtype))
        assert grads[dtype].dtype == dtype
    assert torch.allclose(grads[torch.float32].double(), grads[torch.float64], rtol=1e-4, atol=1e-5)


def test_batchnorm_in_eval_mode_uses_its_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).double()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    _, batch, _ = make("mlp")
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=2)
    before = model[1].running_mean.clone()
    out = learner.run(batch)
    assert torch.equal(model[1].running_mean, before)
    fast = {k: v[0] for k, v in out.fast.items()}
    expected = F.mse_loss(functional_call(model, fast, (batch.query_x[0],)), batch.query_y[0])
    assert torch.allclose(out.query_losses[0], expected, rtol=1e-12)


def test_state_dict_round_trip_restores_the_learned_rates():
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, learn_inner_lr="per_parameter")
    with torch.no_grad():
        for rate in learner.rate_parameters.values():
            rate.add_(0.05)
    state = learner.state_dict()
    other_model, _, _ = make("mlp", seed=5)
    other = maml.MetaLearner(other_model, loss_fn, inner_lr=0.1, learn_inner_lr="per_parameter")
    other.load_state_dict(state)
    assert torch.equal(other.meta_loss(batch), learner.meta_loss(batch))


def test_task_batch_to_and_indexing():
    _, batch, _ = make("conv_batchnorm_maxpool")
    small = batch.to(torch.float32)
    assert small.support_x.dtype == torch.float32 and small.support_y.dtype == torch.int64
    assert batch[1].num_tasks == 1 and torch.equal(batch[1].query_x[0], batch.query_x[1])
    assert batch[-1].num_tasks == 1 and torch.equal(batch[-1].query_x[0], batch.query_x[-1])
    assert batch[0:2].num_tasks == 2


@pytest.mark.parametrize("mode", maml.MODES)
def test_steps_per_call_overrides_the_learners_steps(mode):
    model, batch, loss_fn = make("conv_batchnorm_maxpool")
    one = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=1, mode=mode)
    four = maml.MetaLearner(model, loss_fn, inner_lr=0.3, steps=4, mode=mode)
    assert torch.equal(flat_grad_at(one, batch, steps=4), flat_grad(four, batch))
    fast = one.adapt(batch.support_x[0], batch.support_y[0], steps=4)
    assert all(torch.equal(v, four.adapt(batch.support_x[0], batch.support_y[0])[k]) for k, v in fast.items())
    assert one.run(batch, steps=4).support_losses.shape == (4, 3)


def flat_grad_at(learner: maml.MetaLearner, batch: maml.TaskBatch, steps: int) -> torch.Tensor:
    grads = torch.autograd.grad(learner.run(batch, steps=steps).loss, list(learner.parameters()))
    return torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize(
    ("seconds", "faster"),
    [((1.0, 2.0), "vmap"), ((2.0, 1.0), "loop"), ((1.4, 1.0), "vmap")],
    ids=["vmap", "loop", "loop-not-clearly"],
)
def test_auto_batching_takes_the_faster_as_timed_on_the_first_batch_and_keeps_it_in_the_state(
    seconds, faster, monkeypatch
):
    conv, batch, loss_fn = make("conv_groupnorm")
    timed = []

    def timings(forward, fast, consts, data, *how):
        timed.append([next(iter(fast.values())).shape[0], *(x.shape[0] for x, _ in data)])
        return dict(zip(("vmap", "loop"), seconds))  # the loop only where it is 1.5x faster

    monkeypatch.setattr(maml._src.planner, "time_batchings", timings)
    monkeypatch.setattr(maml._src.planner, "_CHOICES", {})
    auto = maml.MetaLearner(conv, loss_fn, inner_lr=0.1, steps=2)
    assert auto.resolved_batching == "vmap"  # nothing timed before the first call
    grad = flat_grad(auto, batch)
    assert auto.resolved_batching == faster and timed == [[batch.num_tasks] * 3]  # the support and query sets
    flat_grad(auto, batch)
    assert len(timed) == 1  # once per device
    # A checkpoint keeps the choice: a learner that loads it batches alike without timing again.
    again = maml.MetaLearner(conv, loss_fn, inner_lr=0.1, steps=2)
    again.load_state_dict(auto.state_dict())
    assert again.resolved_batching == faster and len(timed) == 1
    # Another learner of this configuration in this process takes the same choice without timing: they agree to the bit.
    other = maml.MetaLearner(conv, loss_fn, inner_lr=0.1, steps=2)
    assert torch.equal(flat_grad(other, batch), grad) and other.resolved_batching == faster and len(timed) == 1
    # "auto" is one of the two exact code paths, so it gives their meta-gradient.
    explicit = maml.MetaLearner(conv, loss_fn, inner_lr=0.1, steps=2, batching=faster)
    assert torch.allclose(grad, flat_grad(explicit, batch), rtol=1e-10, atol=1e-13)
    for batching in ("vmap", "loop"):
        assert maml.MetaLearner(conv, loss_fn, inner_lr=0.1, batching=batching).resolved_batching == batching
    assert maml.MetaLearner(conv, loss_fn, inner_lr=0.1, chunk_size=2).resolved_batching == "vmap"


@pytest.mark.parametrize(
    "how",
    [{}, {"second_order": True, "task_by_task": True}],
    ids=["first-order-passes", "second-order-step-task-by-task"],
)
def test_timing_the_batchings_measures_both_and_leaves_the_random_stream_alone(how):
    """As ``"auto"`` times them: forward and backward passes, or (``how``) a second-order step with a loop plan's
    tasks one by one."""
    conv, batch, loss_fn = make("conv_groupnorm")
    forward = maml._src.forward.TaskForward(conv, loss_fn, "auto", None)
    fast = {k: v.detach().expand(batch.num_tasks, *v.shape) for k, v in conv.named_parameters()}
    state = torch.get_rng_state()
    data = [(batch.support_x, batch.support_y), (batch.query_x, batch.query_y)]
    seconds = maml._src.planner.time_batchings(forward, fast, {}, data, **how)
    assert set(seconds) == {"vmap", "loop"} and all(s > 0 for s in seconds.values())
    assert torch.equal(torch.get_rng_state(), state)


class _Threads(torch.nn.Module):
    """A linear layer that notes torch's intra-op thread count at each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 1)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return self.body(x)


def test_timing_the_batchings_runs_on_one_thread_and_restores_the_count():
    """The calling thread's CPU time is all the work only on one thread: with more, it misses the workers' share
    and counts its waits for workers a busy machine deschedules (benchmarks.auto_choice: ``"auto"`` flipped)."""
    net = _Threads().double()
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(2, 5, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 5, 1, generator=g, dtype=torch.float64),
    )
    forward = maml._src.forward.TaskForward(net, F.mse_loss, "auto", None)
    fast = {k: v.detach().expand(2, *v.shape) for k, v in net.named_parameters()}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        maml._src.planner.time_batchings(forward, fast, {}, [(x, y), (x, y)])
        assert set(net.seen) == {1} and torch.get_num_threads() == 2, net.seen
    finally:
        torch.set_num_threads(threads)


class _Unused(torch.nn.Module):
    """A trainable parameter the forward pass never reads (a head kept for later, a branch switched off)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 1)
        self.spare = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_auto_runs_a_model_with_a_parameter_its_forward_pass_does_not_use(monkeypatch):
    """ "auto" times both batchings on the first batch; a parameter without a gradient is timed as such."""
    monkeypatch.setattr(maml._src.planner, "_CHOICES", {})
    batch = make("mlp")[1]
    grads = {}
    for batching in ("auto", "vmap", "loop"):
        torch.manual_seed(0)
        model = _Unused().double()
        learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=2, batching=batching)
        learner.meta_loss(batch).backward()
        grads[batching] = model.body.weight.grad
        assert model.spare.grad is None
    torch.testing.assert_close(grads["auto"], grads["loop"], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["vmap"], grads["loop"], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- a state saved by a learner built otherwise


def _mlp(hidden: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


@pytest.mark.parametrize(
    "saved, loading, message",
    [
        (
            lambda: maml.MetaLearner(_mlp(), F.mse_loss, 0.1, 5, learn_inner_lr="per_layer_per_step"),
            lambda: maml.MetaLearner(_mlp(), F.mse_loss, 0.1, 3, learn_inner_lr="per_layer_per_step"),
            "state['inner_lrs']['0.weight'] is (5,) but this learner's is (3,); build the learner with the same "
            "learn_inner_lr and steps as the saved one.",
        ),
        (
            lambda: maml.MetaLearner(_mlp(8), F.mse_loss, 0.1),
            lambda: maml.MetaLearner(_mlp(4), F.mse_loss, 0.1),
            "state['model']['0.weight'] is (8, 3) but this learner's is (4, 3); build the learner with the same "
            "model as the saved one.",
        ),
        (
            lambda: (m := _mlp()) and maml.MetaLearner(m, F.mse_loss, 0.1, inner_optimizer=maml.MetaCurvature(m)),
            lambda: maml.MetaLearner(_mlp(), F.mse_loss, 0.1),
            "state holds a rule's own tensors (state['rule']: ",
        ),
        (
            lambda: (m := _mlp(8)) and maml.MetaLearner(m, F.mse_loss, 0.1, inner_optimizer=maml.MetaCurvature(m)),
            lambda: (m := _mlp(4)) and maml.MetaLearner(m, F.mse_loss, 0.1, inner_optimizer=maml.MetaCurvature(m)),
            "state['model']['0.weight'] is (8, 3) but this learner's is (4, 3)",
        ),
    ],
    ids=[
        "per-step-rates-of-other-steps",
        "model-of-other-shapes",
        "curvature-into-a-plain-learner",
        "curvature-of-other-shapes",
    ],
)
def test_a_state_saved_by_a_learner_built_otherwise_is_refused_whole(saved, loading, message):
    state = saved().state_dict()
    learner = loading()
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    with pytest.raises(ValueError) as raised:
        learner.load_state_dict(state)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
    assert all(torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())  # nothing loaded


def test_a_meta_curvature_left_behind_by_model_to_is_named():
    model = _mlp()
    learner = maml.MetaLearner(model, F.mse_loss, 0.1, inner_optimizer=maml.MetaCurvature(model))
    model.to(torch.float64)
    g = torch.Generator().manual_seed(0)
    batch = maml.TaskBatch(*(torch.randn(2, 5, n, generator=g, dtype=torch.float64) for n in (3, 1, 3, 1)))
    with pytest.raises(
        ValueError,
        match=r"^the rule's tensor 'rule\..*' is torch.float32 on cpu but the model's "
        r"parameters are torch.float64 on cpu; move both with learner.to\(...\)",
    ):
        learner.meta_loss(batch)
    learner.to(torch.float64)
    learner.meta_loss(batch).backward()


@pytest.mark.parametrize("mode", ["second_order", "first_order", "checkpointed", "reptile", "implicit"])
def test_run_from_detached_parameters_adapts_as_from_the_model(mode):
    """Given constants, the inner loop differentiates from them all the same; no gradient reaches the model."""
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=2, mode=mode)
    expected = learner.run(batch)
    got = learner.run(batch, params={k: v.detach() for k, v in model.named_parameters()})
    torch.testing.assert_close(got.loss.detach(), expected.loss.detach(), rtol=0, atol=0)
    for k in expected.fast:
        torch.testing.assert_close(got.fast[k].detach(), expected.fast[k].detach(), rtol=0, atol=0)


_CHOOSE = """
import os, sys, threading, torch, torch.nn as nn, torch.nn.functional as F
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, which the busy thread competes for
torch.set_num_threads(1)
from maml._src import planner
from maml._src.forward import TaskForward
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
x, y = torch.randn(16, 10, 1), torch.randn(16, 10, 1)
stop = []
if sys.argv[1] == "busy":
    threading.Thread(target=lambda: [None for _ in iter(lambda: bool(stop), True)], daemon=True).start()
forward = TaskForward(net, F.mse_loss, "auto", None)
fast = {k: v.detach().expand(16, *v.shape) for k, v in net.named_parameters()}
seconds = planner.time_batchings(forward, fast, {}, [(x, y), (x, y)])
print(planner.choose_batching(forward, fast, {}, [(x, y), (x, y)]), seconds["loop"] / seconds["vmap"])
stop.append(1)
"""


def test_auto_chooses_alike_on_an_idle_core_and_beside_a_busy_thread():
    """ "auto" times in the calling thread's CPU time: a thread competing for the core does not flip the choice."""
    import subprocess
    import sys

    runs = [
        subprocess.run([sys.executable, "-c", _CHOOSE, load], capture_output=True, text=True, check=True).stdout.split()
        for load in ("idle", "busy", "idle", "busy")
    ]
    assert {choice for choice, _ in runs} == {"vmap"}, runs
    assert all(float(ratio) >= 1.5 for _, ratio in runs[::2]), runs  # sizes where the batchings differ by 1.5x
