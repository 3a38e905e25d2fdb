"""Checks maml.shard, maml.all_reduce_grads and maml.all_reduce_mean inside a real gloo group.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/engine/distributed_program.py

Run by tests/engine/test_distributed_helpers.py; every rank asserts, so the launch exits 0 only if all hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import maml


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        x = torch.arange(2 * size, dtype=torch.float32).view(2 * size, 1, 1)
        batch = maml.TaskBatch(x, x, x, x)
        assert maml.shard(batch).support_x.flatten().tolist() == [2.0 * rank, 2.0 * rank + 1]

        # Each rank's gradient is rank + 1 (mean: (size + 1) / 2). `rare` has a gradient on rank 0
        # only (elsewhere it counts as zero), `unused` on none, `frozen` is not a meta-parameter,
        # and the float64 `wide` travels in a second bucket.
        dense, rare, unused = (nn.Parameter(torch.zeros(3, 2)) for _ in range(3))
        wide, frozen = nn.Parameter(torch.zeros(4, dtype=torch.float64)), torch.full((2,), 7.0)
        dense.grad = torch.full_like(dense, rank + 1.0)
        wide.grad = torch.full_like(wide, rank + 1.0)
        frozen.grad = torch.full_like(frozen, rank + 1.0)
        if rank == 0:
            rare.grad = torch.full_like(rare, float(size))
        extras = torch.tensor([rank, 10.0 * rank], dtype=torch.float64)
        mean = maml.all_reduce_grads([dense, rare, unused, wide, frozen], extras)

        expected = (size + 1) / 2
        assert torch.equal(dense.grad, torch.full_like(dense, expected)), dense.grad
        assert torch.equal(wide.grad, torch.full_like(wide, expected)), wide.grad
        assert torch.equal(rare.grad, torch.ones_like(rare)), rare.grad
        assert unused.grad is None
        assert torch.equal(frozen.grad, torch.full_like(frozen, rank + 1.0))  # untouched
        assert mean is not None and mean.dtype == torch.float64
        assert mean.tolist() == [(size - 1) / 2, 10 * (size - 1) / 2], mean
        assert torch.equal(extras, torch.tensor([rank, 10.0 * rank], dtype=torch.float64))  # not modified

        assert maml.all_reduce_mean(torch.tensor([2.0 * rank])).tolist() == [size - 1.0]
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} of {size}: ok")


if __name__ == "__main__":
    main()
