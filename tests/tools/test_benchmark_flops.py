"""The benchmarks' FLOP count (benchmarks/flops.py) counts a meta-step's work once, whatever the batching.

PyTorch's ``FlopCounterMode`` counts the weight gradient of a convolution with ``groups=G`` G times
over, and ``vmap`` turns the tasks' convolutions into one grouped convolution (``groups`` = tasks),
so a plain count of a vmapped step is about 11x that of the same step as a loop.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not installed, it lives in the checkout
    sys.path.insert(0, str(REPO))

import maml  # noqa: E402
from benchmarks.flops import count_flops  # noqa: E402

TASKS = 4


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def image_batch() -> maml.TaskBatch:
    g = torch.Generator().manual_seed(0)

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(TASKS, 3 * per_class, 1, 8, 8, generator=g)
        return x, torch.arange(3).repeat_interleave(per_class).expand(TASKS, -1).contiguous()

    return maml.TaskBatch(*split(2), *split(3))


def test_grouped_convolution_counts_as_its_groups() -> None:
    groups, channels = 4, 3
    x = torch.randn(2, groups * channels, 5, 5, requires_grad=True)
    w = torch.randn(groups * channels, channels, 3, 3, requires_grad=True)

    def grouped() -> None:
        F.conv2d(x, w, padding=1, groups=groups).sum().backward()

    def one_by_one() -> None:
        for xs, ws in zip(x.split(channels, 1), w.split(channels, 0)):
            F.conv2d(xs, ws, padding=1).sum().backward()

    assert count_flops(grouped) == count_flops(one_by_one) > 0
    # Ungrouped convolutions are counted as PyTorch counts them.
    with FlopCounterMode(display=False) as raw:
        one_by_one()
    assert count_flops(one_by_one) == raw.get_total_flops()


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "second_order"},
        {"mode": "first_order"},
        {"mode": "checkpointed"},
        {"mode": maml.Checkpointed(hvp="forward_over_reverse")},
    ],
    ids=["second_order", "first_order", "checkpointed", "checkpointed-forward_over_reverse"],
)
def test_vmap_and_loop_meta_steps_count_the_same_flops(options: dict[str, object]) -> None:
    batch, net = image_batch(), conv_net()
    counts = {}
    for batching in ("loop", "vmap"):
        learner = maml.MetaLearner(copy.deepcopy(net), F.cross_entropy, 0.4, steps=1, batching=batching, **options)
        learner.meta_loss(batch).backward()  # the first call's checks (one task's forward pass) are not counted
        counts[batching] = count_flops(lambda: learner.meta_loss(batch).backward())  # noqa: B023 (called at once)
    assert counts["loop"] > 0
    assert abs(counts["vmap"] - counts["loop"]) <= 0.01 * counts["loop"], counts
