"""What the lean modes hold, counted in live tensor bytes (``benchmarks.tensor_peak``): a test of memory, not of time."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import maml
from benchmarks.tensor_peak import peak_tensor_bytes
from maml._src import planner


def conv_net(norm: bool = False) -> nn.Module:
    """Two conv blocks (conv, [batch norm,] ReLU, max-pool) and a linear head, for 16x16 inputs."""
    torch.manual_seed(0)
    blocks = [
        [nn.Conv2d(c, 16, 3, padding=1), *([nn.BatchNorm2d(16, track_running_stats=False)] if norm else [])]
        for c in (1, 16)
    ]
    return nn.Sequential(
        *(m for b in blocks for m in (*b, nn.ReLU(), nn.MaxPool2d(2))), nn.Flatten(), nn.Linear(256, 5)
    )


def batch(tasks: int = 8) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(1)
    x = lambda n: torch.randn(tasks, n, 1, 16, 16, generator=g)  # noqa: E731
    y = lambda n: torch.arange(5).repeat_interleave(n // 5).expand(tasks, -1).contiguous()  # noqa: E731
    return maml.TaskBatch(x(5), y(5), x(75), y(75))


def first_step_peak(steps: int = 3, later: bool = False, **options: object) -> int:
    """The tensor peak of a new learner's first meta-training step (where ``"auto"`` settles its batching and the
    planner measures), or with ``later`` of its second."""
    planner._CHOICES.clear()  # no timing of an earlier test may stand in for this learner's own
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=steps, **options)
    b = batch()
    if later:
        learner.meta_loss(b).backward()
    return peak_tensor_bytes(lambda: learner.meta_loss(b).backward())


def test_the_checkpointed_default_holds_its_default_budget_and_less_than_second_order():
    """On defaults the checkpointed mode plans within one task's second-order step or 16 MiB (maml._src.planner)."""
    planner._CHOICES.clear()
    learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=3, mode="checkpointed")
    b = batch()
    auto = peak_tensor_bytes(lambda: learner.meta_loss(b).backward())  # the first step: its probes included
    loop = first_step_peak(later=True, mode="checkpointed", batching="loop")
    full = first_step_peak(later=True, mode="second_order", batching="loop")
    assert learner.plan.default and auto <= 1.05 * learner.plan.budget, (auto, learner.plan)
    assert auto < 0.8 * full, (auto, full)
    assert 3 * loop < full  # the measure tells the lean mode from second order


@pytest.mark.parametrize("chunk", [1, 2])
def test_the_checkpointed_mode_in_chunks_takes_the_leaner_loop(chunk):
    mode = maml.Checkpointed(tasks=chunk)
    vmap = first_step_peak(mode=mode, batching="vmap")
    auto = first_step_peak(mode=mode, batching="auto")
    loop = first_step_peak(mode=mode, batching="loop")
    assert auto <= 1.1 * loop and loop <= 1.1 * vmap, (auto, vmap, loop)


def test_a_chunked_backward_holds_one_chunk_whatever_the_batching():
    peaks = {}
    for batching in ("auto", "vmap", "loop"):
        planner._CHOICES.clear()
        learner = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=3, batching=batching)
        b = batch()
        peaks[batching] = peak_tensor_bytes(lambda learner=learner, b=b: learner.backward(b, chunk=1))
    planner._CHOICES.clear()
    whole = maml.MetaLearner(conv_net(), F.cross_entropy, inner_lr=0.1, steps=3, batching="loop")
    b = batch()
    full = peak_tensor_bytes(lambda: whole.meta_loss(b).backward())
    assert max(peaks.values()) <= 1.1 * min(peaks.values()), peaks
    assert 3 * max(peaks.values()) < full, (peaks, full)


@pytest.mark.parametrize("mode", ["second_order", "checkpointed", "first_order"])
def test_one_task_runs_unbatched_under_auto(mode):
    """A meta-batch of one task (and each chunk of a backward by one) holds what the plain per-task call holds."""
    peaks = {}
    for batching in ("auto", "loop"):
        planner._CHOICES.clear()
        learner = maml.MetaLearner(conv_net(True), F.cross_entropy, inner_lr=0.1, steps=3, mode=mode, batching=batching)
        one, eight = batch(1), batch(8)
        peaks[batching, 1] = peak_tensor_bytes(lambda learner=learner, b=one: learner.meta_loss(b).backward())
        peaks[batching, 8] = peak_tensor_bytes(lambda learner=learner, b=eight: learner.backward(b, chunk=1))
    # A vmapped probe holds several tasks' graphs at once; 5 % leaves room for what the garbage
    # collector happens to have freed when the peak is reached.
    assert peaks["auto", 1] <= 1.05 * peaks["loop", 1], peaks
    assert peaks["auto", 8] <= 1.05 * peaks["loop", 8], peaks


def test_the_checkpointed_peak_is_nearly_flat_in_the_inner_steps():
    """Segments of about sqrt(steps * tasks) steps, replayed one step at a time: 8x the steps, at most 1.3x the peak.

    That length keeps the fewest iterates (``checkpointed.segment_steps``); a plan takes it where a
    budget leaves no room for shorter, faster segments.
    """
    few, many = (
        first_step_peak(steps, True, mode=maml.Checkpointed(every=round(math.sqrt(steps * 8))), batching="loop")
        for steps in (5, 40)
    )
    every_step = first_step_peak(40, True, mode=maml.Checkpointed(every=1), batching="loop")
    assert many <= 1.3 * few, (few, many)
    assert many < 0.6 * every_step, (many, every_step)  # keeping every step's fast weights grows with the steps
