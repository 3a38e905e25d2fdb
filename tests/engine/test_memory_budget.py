"""``memory_budget``: the plan it picks fits the step's tensor peak into it, and no plan changes the meta-gradient."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPE, make
from torch import nn

import maml
from maml._src import planner

MiB = 2**20


def conv_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    ).to(dtype)


def image_batch(tasks: int = 6, dtype: torch.dtype = torch.float32) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(5).repeat_interleave(3).expand(tasks, -1).contiguous()
    x = lambda: torch.randn(tasks, 15, 1, 16, 16, generator=g, dtype=dtype)  # noqa: E731
    return maml.TaskBatch(x(), y, x(), y)


@pytest.mark.parametrize(
    "value, expected",
    [(2048, 2048), ("6GiB", 6 * 2**30), ("500MB", 500 * 10**6), ("1.5 KiB", 1536), (" 3mib ", 3 * MiB), ("4096", 4096)],
)
def test_a_budget_is_bytes_a_size_or_a_fraction(value, expected):
    assert planner.budget_bytes(value, torch.device("cpu")) == expected
    half, whole = (planner.budget_bytes(f, torch.device("cpu")) for f in (0.5, 1.0))
    assert 0 < half < whole and planner.budget_bytes("0.5", torch.device("cpu")) == pytest.approx(half, rel=0.05)


@pytest.mark.parametrize(
    "value, message",
    [
        ("6 gigs", "memory_budget='6 gigs' is not a size; it must be bytes (an int), a string such as '6GiB'"),
        (0, "memory_budget=0 must be at least one byte"),
        (1.5, "memory_budget=1.5: a float is a fraction of the free memory, in (0, 1]."),
        (True, "memory_budget must be bytes (an int), a string such as '6GiB' or '500MB'"),
    ],
)
def test_a_bad_budget_is_one_line_at_construction(value, message):
    model, _, loss_fn = make("mlp")
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        maml.MetaLearner(model, loss_fn, 0.1, memory_budget=value)


def test_a_budget_on_a_mode_that_plans_nothing_is_refused():
    model, _, loss_fn = make("mlp")
    with pytest.raises(ValueError, match=r"^memory_budget='1GiB' does not apply to mode='reptile'"):
        maml.MetaLearner(model, loss_fn, 0.1, mode="reptile", memory_budget="1GiB")


def grads(learner: maml.MetaLearner, batch: maml.TaskBatch, chunked: bool) -> torch.Tensor:
    learner.model.zero_grad(set_to_none=True)
    if chunked:
        learner.backward(batch)
    else:
        learner.meta_loss(batch).backward()
    return torch.cat([p.grad.flatten() for p in learner.model.parameters()])


def smallest_budget(learner: maml.MetaLearner, batch: maml.TaskBatch) -> int:
    """The smallest budget that runs, as the refusal of a too-small one names it."""
    learner.memory_budget = 1
    with pytest.raises(ValueError, match="pass at least memory_budget=") as refused:
        learner.backward(batch)
    return int(re.search(r"pass at least memory_budget=([0-9]+)", str(refused.value)).group(1))


@pytest.mark.parametrize("case", ["mlp", "conv"])
@pytest.mark.parametrize("mode, hvp", [("second_order", None), ("checkpointed", None), ("checkpointed", "fwd")])
def test_no_plan_changes_the_meta_gradient_or_the_fast_weights(case, mode, hvp):
    """Float64: every budget's plan gives second order's meta-gradient, and evaluation and adapt() agree with training."""
    if case == "mlp":
        model, batch, loss_fn = make("mlp")
        build = lambda: make("mlp")[0]  # noqa: E731
    else:
        build, batch, loss_fn = (lambda: conv_net(DTYPE)), image_batch(dtype=DTYPE), F.cross_entropy
    reference = maml.MetaLearner(build(), loss_fn, inner_lr=0.1, steps=3, batching="loop")
    expected = grads(reference, batch, chunked=False)
    fast = reference.run(batch).fast
    spec = maml.Checkpointed(hvp="forward_over_reverse") if hvp else mode
    learner = maml.MetaLearner(build(), loss_fn, inner_lr=0.1, steps=3, mode=spec, batching="vmap")
    least = smallest_budget(learner, batch)
    plans = set()
    for limit in (least, int(2.5 * least), "1GiB", None if mode == "checkpointed" else "1GiB"):
        learner.memory_budget = limit
        got = grads(learner, batch, chunked=True)
        plans.add(learner.plan)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12 * expected.abs().max())
        if learner.plan.tasks == batch.num_tasks:  # one call holds the batch: run() and meta_loss() may take it
            out = learner.run(batch)
            for k in fast:
                torch.testing.assert_close(out.fast[k], fast[k], rtol=0, atol=1e-12)
        with torch.no_grad():
            evaluated = learner.run(batch).fast
        adapted = learner.adapt(batch.support_x[1], batch.support_y[1])
        for k in fast:
            torch.testing.assert_close(evaluated[k], fast[k].detach(), rtol=0, atol=1e-12)
            torch.testing.assert_close(adapted[k], fast[k][1].detach(), rtol=0, atol=1e-12)
    assert len({p.tasks for p in plans}) > 1, plans  # the budgets planned differently


def test_the_fastest_plan_within_the_budget_most_tasks_then_the_shortest_segments():
    """A segment of e steps replays e - 1 for values: the shortest that fit are the fastest (maml._src.planner)."""
    kb = 1024  # 8 tasks, 20 steps; replaying one task's step holds 100 KiB, a second batched task 80, an iterate 1
    fp = planner.Footprint(
        depth=1, one=100 * kb, task=None, batched=80 * kb, step=0, batched_step=0, iterate=kb, fast=kb, grads=0
    )

    def plan(limit: int, batching: str = "loop", every: int | None = None) -> tuple[int, int | None]:
        p = planner._best(fp, "segments", 8, 20, every, batching, limit * kb, False, False)
        assert p is not None and p.estimate <= limit * kb
        assert p.estimate == fp.checkpointed(p.tasks, p.replayed, 20, p.checkpoint_every, batching)
        return p.tasks, p.checkpoint_every

    assert plan(10_000) == (1, 1)  # room for every step's iterate: no values replay
    assert plan(110) == (1, 3)  # a call a task: 6 kept + 2 * 2 entering + 100, the shortest that fits
    assert plan(10_000, "vmap") == (8, 1)
    assert plan(500, "vmap") == (4, 1)  # 5 tasks fit in as many calls (two) as 4, which hold less
    assert plan(10_000, "vmap", every=4) == (8, 4)  # the mode's every stands
    assert planner._best(fp, "segments", 8, 20, None, "loop", 100 * kb, False, False) is None


def test_a_budget_below_one_task_names_the_smallest_that_runs():
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=4, memory_budget="1KiB")
    with pytest.raises(
        ValueError,
        match=r"^memory_budget=1.0 KiB is below what one task of mode='second_order' "
        r"holds at steps=4 \(about [0-9.]+ [KM]iB\): pass at least memory_budget=[0-9]+, or mode=",
    ):
        learner.backward(image_batch(2))
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, 0.1, steps=4, mode="checkpointed", memory_budget="1KiB")
    with pytest.raises(
        ValueError,
        match=r"^memory_budget=1.0 KiB is below what mode='checkpointed' holds replaying "
        r"one task at a time \(about [0-9.]+ [KM]iB\): pass at least memory_budget=[0-9]+\.$",
    ):
        learner.meta_loss(image_batch(2))


def test_meta_loss_over_the_budget_names_backward():
    # vmap: a loop plan's calls take one task each, so only a batched plan runs the 6 tasks in one call.
    learner = maml.MetaLearner(
        conv_net(), F.cross_entropy, inner_lr=0.1, steps=2, batching="vmap", memory_budget="1GiB"
    )
    learner.backward(image_batch(6))
    learner.memory_budget = int(2.5 * learner.plan.estimate / 6)
    with pytest.raises(
        ValueError,
        match=r"^6 tasks of mode='second_order' hold about .* in one call, over memory_budget=.*: "
        r"learner.backward\(batch\) runs them [1-5] at a time within it, to the same .grad.$",
    ):
        learner.meta_loss(image_batch(6))
    assert learner.backward(image_batch(6)).ndim == 0 and 1 < learner.plan.tasks < 6
    assert f"plan='{learner.plan.tasks} tasks at once in" in repr(learner)


@pytest.mark.parametrize(
    "call, advice",
    [
        (lambda lr, b: lr.backward(b, chunk=6), r"backward\(chunk=6\) asks for more: pass chunk=[1-5], or no chunk"),
        (lambda lr, b: lr.run(b, steps=3), r"runs them [1-5] at a time .*: set learner.steps = 3 first"),
        ("chunk_size", r"set learner.chunk_size = [1-5] \(or None: backward\(batch\) then plans its calls"),
    ],
    ids=["backward-chunk", "run-steps", "chunk_size"],
)
def test_a_call_over_the_budget_names_the_call_and_argument_that_fit(call, advice):
    # vmap: a loop plan's calls take one task each, so only a batched plan runs the 6 tasks in one call.
    learner = maml.MetaLearner(
        conv_net(), F.cross_entropy, inner_lr=0.1, steps=2, batching="vmap", memory_budget="1GiB"
    )
    learner.backward(image_batch(6))
    learner.memory_budget = int(2.5 * learner.plan.estimate / 6)
    if call == "chunk_size":
        learner.chunk_size = 6
        call = lambda lr, b: lr.backward(b)  # noqa: E731
    with pytest.raises(ValueError, match=advice):
        call(learner, image_batch(6))


def test_a_negative_measurement_in_a_checkpoint_is_refused_naming_it():
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=2, mode="checkpointed")
    learner.meta_loss(image_batch(2)).backward()
    state = learner.state_dict()
    key = next(iter(state["plans"]))
    state["plans"][key]["one"] = -100
    with pytest.raises(ValueError, match=r"^state\['plans'\]\[.*\]\['one'\] is -100; what the planner measured"):
        learner.load_state_dict(state)


def test_a_segment_longer_than_the_loop_is_the_loop():
    """Checkpointed(every=100) at 3 steps plans as every=3 does: the same run."""
    plans = []
    for every in (3, 100, 10**30):
        learner = maml.MetaLearner(conv_net(), F.cross_entropy, 0.1, 3, mode=maml.Checkpointed(every=every))
        learner.memory_budget = "1GiB"
        learner.backward(image_batch(4))
        plans.append((learner.plan.estimate, learner.plan.checkpoint_every))
        assert "e+" not in str(learner.plan)
    assert plans[0] == plans[1] == plans[2] and plans[0][1] == 3


@pytest.mark.parametrize("resumed_as", ["checkpointed", maml.Checkpointed()], ids=["name", "object"])
def test_a_checkpoint_keeps_what_the_planner_measured(monkeypatch, resumed_as):
    """A state saved by a learner built with a mode's name loads into one built with its object, and back."""
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=3, mode="checkpointed")
    learner.meta_loss(image_batch(4)).backward()
    plan, state = learner.plan, learner.state_dict()
    assert plan is not None and plan.default and state["plans"]
    resumed = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=3, mode=resumed_as)
    resumed.load_state_dict(state)
    monkeypatch.setattr(planner, "measure", lambda *a: pytest.fail("a resumed learner measured again"))
    resumed.meta_loss(image_batch(4)).backward()
    assert resumed.plan == plan


def test_the_checkpointed_default_plans_within_one_tasks_second_order_step():
    batch = image_batch(8)
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=6, mode="checkpointed")
    learner.meta_loss(batch).backward()
    assert learner.plan.default and learner.plan.budget >= planner.DEFAULT_FLOOR
    assert learner.plan.estimate <= learner.plan.budget


def test_a_one_task_batch_leaves_auto_to_a_larger_one():
    """One task runs unbatched whatever is chosen: a planned call of one task records no batching."""
    planner._CHOICES.clear()
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=2, memory_budget="1GiB")
    learner.backward(image_batch(1))
    assert learner.state_dict()["batching"] == {}
    learner.backward(image_batch(4))
    assert set(learner.state_dict()["batching"]) == {"cpu"}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.parametrize("mode, steps", [("first_order", 1), ("second_order", 2)])
def test_a_refusal_of_chunk_size_over_the_budget_never_names_a_figure_within_it(mode, steps):
    # Small budgets hold one task but too little to probe two together: the refusal said "4 tasks hold about <one
    # task's figure>, over" a budget larger than that figure.
    g = torch.Generator().manual_seed(0)
    draw = lambda: torch.randn(8, 5, 1, generator=g, dtype=DTYPE)  # noqa: E731
    batch = maml.TaskBatch(draw(), draw(), draw(), draw())
    refused = 0
    for budget in range(1000, 8000, 350):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)).to(DTYPE)
        learner = maml.MetaLearner(
            net, F.mse_loss, inner_lr=0.1, steps=steps, mode=mode, batching="vmap", chunk_size=4, memory_budget=budget
        )
        try:
            learner.backward(batch)
        except ValueError as e:
            refused += 1
            figures = re.search(r"hold about ([0-9.]+ \w+) in one call, over memory_budget=([0-9.]+ \w+)", str(e))
            if figures:
                assert _bytes(figures.group(1)) > _bytes(figures.group(2)), str(e)
            else:
                assert "too little to measure two together" in str(e) or "below what one task" in str(e), str(e)
    assert refused > 0


def test_the_smallest_budget_a_learner_names_is_accepted_by_a_new_one():
    names = []
    for _ in range(3):  # new learners measure again, in one process
        learner = maml.MetaLearner(conv_net(DTYPE), F.cross_entropy, inner_lr=0.1, steps=2, memory_budget=1)
        with pytest.raises(ValueError, match="pass at least memory_budget=") as refusal:
            learner.backward(image_batch(2, DTYPE))
        least = int(re.search(r"memory_budget=([0-9]+)", str(refusal.value).split("pass at least")[1]).group(1))
        assert least % 1024 == 0
        names.append(least)
        fresh = maml.MetaLearner(conv_net(DTYPE), F.cross_entropy, inner_lr=0.1, steps=2, memory_budget=least)
        fresh.backward(image_batch(2, DTYPE))
        assert fresh.plan is not None and fresh.plan.estimate <= least
    assert len(set(names)) == 1
