"""The engine's helpers for meta-training across processes: ``maml.shard`` (this process's share of the
tasks), ``maml.all_reduce_grads`` and ``maml.all_reduce_mean``; without a process group, and inside a real
gloo group of 2 processes started with torchrun (``distributed_program.py``, where every rank asserts).

The experiment scripts' use of them (the trajectory of one process, the stops) is tests/scripts/test_distributed.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import finished, script

import maml

PROCESSES = 2


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    # torchrun sets this itself only for several processes per machine; 2 two-threaded
    # processes on 2 cores spin against each other and run 10 times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_shard_splits_the_tasks_into_equal_contiguous_shares():
    x = torch.arange(12.0).view(12, 1, 1)
    batch = maml.TaskBatch(x, x, x, x)
    shares = [maml.shard(batch, rank=r, world_size=3) for r in range(3)]
    assert [s.num_tasks for s in shares] == [4, 4, 4]
    for field in ("support_x", "support_y", "query_x", "query_y"):
        assert torch.equal(torch.cat([getattr(s, field) for s in shares]), getattr(batch, field))
    # Without a process group: the whole batch, and nothing to average.
    assert maml.shard(batch) is batch
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    extras = torch.tensor([1.0])
    assert maml.all_reduce_grads([p], extras) is extras and p.grad.tolist() == [3.0, 3.0]
    assert maml.all_reduce_mean(extras) is extras


def test_shard_errors_say_how_to_fix_them():
    x = torch.zeros(10, 1, 1)
    batch = maml.TaskBatch(x, x, x, x)
    message = (
        "a meta-batch of 10 tasks cannot be split evenly across 4 processes (world size): every process must "
        "adapt the same number of tasks"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        maml.shard(batch, rank=0, world_size=4)
    assert "multiple of 4 (e.g. 8 or 12)" in str(error.value) and "divides 10 (1, 2, 5, 10)" in str(error.value)
    with pytest.raises(ValueError, match=re.escape("rank=2 is out of range for world_size=2")):
        maml.shard(batch, rank=2, world_size=2)
    with pytest.raises(TypeError, match="batch must be a maml.TaskBatch"):
        maml.shard(x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("extras must be a 1-D tensor")):
        maml.all_reduce_grads([], torch.zeros(2, 2))


def test_collectives_in_a_real_process_group(tmp_path):
    printed = finished(
        script(
            "torch.distributed.run",
            ["--standalone", "--nproc-per-node", str(PROCESSES), "tests/engine/distributed_program.py"],
            tmp_path,
        )
    )
    assert printed.count(": ok") == PROCESSES
