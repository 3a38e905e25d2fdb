"""``learner.backward(batch)``, the training loop the README shows: without a budget, second and first order plan
within the device's free memory, so a batch that does not fit whole still runs (in chunks), to the same
meta-gradient as ``meta_loss(batch).backward()``; the free memory is read once and kept by ``state_dict``."""

from __future__ import annotations

import pytest
import torch
from helpers import make

import maml
from maml._src import planner


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def whole_estimate(model, batch, loss_fn, mode: str) -> int:
    """What the planner estimates the whole batch holds in one call (a budget that holds anything)."""
    probe = maml.MetaLearner(model, loss_fn, 0.1, 2, mode=mode, batching="vmap", memory_budget="64GiB")
    plan = probe.plan_for(batch)
    assert plan is not None and plan.calls == 1 and plan.tasks == batch.num_tasks
    return plan.estimate


@pytest.mark.parametrize("mode", ["second_order", "first_order"])
def test_a_batch_that_does_not_fit_the_free_memory_runs_in_chunks_to_the_same_gradient(monkeypatch, mode):
    model, batch, loss_fn = make("conv_groupnorm")
    batch = maml.TaskBatch(*(torch.cat([t, t.flip(0)]) for t in batch.tensors))  # 6 tasks
    need = whole_estimate(model, batch, loss_fn, mode)
    # The device's free memory as half of what the whole batch holds: it cannot run whole.
    monkeypatch.setattr(planner, "free_bytes", lambda device: int(need / 2 / planner.FREE_SHARE))
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2, mode=mode, batching="vmap")
    model.zero_grad()
    loss = learner.backward(batch)
    chunked = grads(model)
    assert learner.plan is not None and learner.plan.calls > 1, learner.plan
    assert learner.plan.estimate <= need / 2
    model.zero_grad()
    expected = learner.meta_loss(batch)
    expected.backward()
    for a, b in zip(chunked, grads(model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)


def test_the_free_memory_is_read_once_and_kept_by_the_state(monkeypatch):
    model, batch, loss_fn = make("mlp")
    reads: list[int] = []

    def free(device: torch.device) -> int:
        reads.append(1)
        return 2**34 if len(reads) == 1 else 2**20  # a busier machine at every later reading

    monkeypatch.setattr(planner, "free_bytes", free)
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2, batching="vmap")  # vmap: the batch in one call
    learner.backward(batch)
    learner.backward(batch)
    learner.steps = 3  # a reconfiguration keeps what was read
    learner.backward(batch)
    assert len(reads) == 1
    assert learner.plan is not None and learner.plan.calls == 1 and learner.plan.budget == int(0.9 * 2**34)
    state = learner.state_dict()
    assert state["plans"]["free memory on cpu"] == {"bytes": int(0.9 * 2**34)}
    resumed = maml.MetaLearner(model, loss_fn, 0.1, 3, batching="vmap")
    resumed.load_state_dict(state)
    resumed.backward(batch)
    assert len(reads) == 1 and resumed.plan is not None and resumed.plan.budget == int(0.9 * 2**34)


def test_meta_loss_and_an_explicit_chunk_do_not_plan(monkeypatch):
    model, batch, loss_fn = make("mlp")
    monkeypatch.setattr(planner, "free_bytes", lambda device: pytest.fail("read the free memory"))
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2)
    learner.meta_loss(batch).backward()
    learner.backward(batch, chunk=1)
    assert learner.plan is None


def test_where_not_one_task_fits_the_free_memory_it_runs_one_task_at_a_time(monkeypatch):
    """A per-task loop is all there is: backward takes it rather than refuse (the estimate is an upper bound)."""
    model, batch, loss_fn = make("mlp")
    monkeypatch.setattr(planner, "free_bytes", lambda device: 1)
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2)
    learner.backward(batch)
    assert learner.plan is not None and learner.plan.tasks == 1 and learner.plan.calls == batch.num_tasks
    explicit = maml.MetaLearner(model, loss_fn, 0.1, 2, memory_budget=1)  # a budget the user gave is refused
    with pytest.raises(ValueError, match=r"^memory_budget=1 B is below what one task of mode='second_order' holds"):
        explicit.backward(batch)


def test_a_loop_plan_runs_one_task_a_call():
    """A loop runs the tasks one after another anyway: backward's calls take one each (a call of several would hold
    every one's fast weights at once), to the same gradient."""
    model, batch, loss_fn = make("mlp")
    learner = maml.MetaLearner(model, loss_fn, 0.1, 2, batching="loop")
    model.zero_grad()
    learner.backward(batch)
    assert learner.plan is not None and (learner.plan.tasks, learner.plan.calls) == (1, batch.num_tasks)
    planned = grads(model)
    model.zero_grad()
    learner.meta_loss(batch).backward()
    for a, b in zip(planned, grads(model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
