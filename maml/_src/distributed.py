"""Meta-training across processes with torch.distributed: each process adapts a share of the tasks.

    batch = maml.shard(full_batch)               # this rank's contiguous share of the tasks
    learner.meta_loss(batch).backward()
    maml.all_reduce_grads(learner.parameters())  # every rank now holds the full meta-batch's gradient
    optimizer.step()                             # the same step on every rank

The meta-loss is the mean query loss over the tasks, so with equal shares the mean of the
ranks' meta-gradients is the meta-gradient of the whole meta-batch. When every rank samples
the same full meta-batch and takes its share, P processes follow the trajectory of one, to
floating-point rounding (unless the step draws random numbers, e.g. dropout masks, which
then differ from a single process's).

Every function is the identity when torch.distributed is not initialized, so the same code
runs in one process and under ``torchrun``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from .batch import TaskBatch


def _world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``, or ``(0, 1)`` when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def shard(batch: TaskBatch, rank: int | None = None, world_size: int | None = None) -> TaskBatch:
    """This process's contiguous share of the tasks of a meta-batch.

    Args:
        batch: ``T`` tasks, the same full meta-batch on every rank (sample it from the same
            generator state everywhere).
        rank: which share, in ``[0, world_size)``. Default: this process's rank in the
            default process group (0 when torch.distributed is not initialized).
        world_size: the number of shares. Default: the default process group's size (1 when
            torch.distributed is not initialized, and then ``batch`` itself is returned).

    Returns:
        Tasks ``rank * T / P`` to ``(rank + 1) * T / P - 1`` of ``batch`` (``P = world_size``):
        every field ``(T / P, n, ...)``, views of ``batch``'s tensors.

    Raises:
        ValueError: ``T`` is not a multiple of ``world_size`` (unequal shares would weight the
            tasks unequally in the averaged meta-gradient), or ``rank`` is out of range.
    """
    if not isinstance(batch, TaskBatch):
        raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
    default_rank, default_size = _world()
    rank = default_rank if rank is None else rank
    world_size = default_size if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is out of range; it must be >= 1.")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} is out of range for world_size={world_size}; it must be in [0, {world_size - 1}]."
        )
    size = shard_size(batch.num_tasks, world_size)
    if world_size == 1:
        return batch
    return batch[rank * size : (rank + 1) * size]


def shard_size(tasks: int, world_size: int) -> int:
    """The tasks each of ``world_size`` processes adapts: ``tasks / world_size``, which must be whole.

    Raises:
        ValueError: ``tasks`` is not a multiple of ``world_size``; the message names the nearest
            meta-batches and the numbers of processes that fit.
    """
    if tasks % world_size:
        lower, upper = tasks - tasks % world_size, tasks + world_size - tasks % world_size
        divisors = [d for d in range(1, tasks + 1) if tasks % d == 0]
        raise ValueError(
            f"a meta-batch of {tasks} tasks cannot be split evenly across {world_size} processes (world size): "
            f"every process must adapt the same number of tasks, so that the mean of their meta-gradients is "
            f"the meta-gradient of the whole meta-batch. Use a meta-batch that is a multiple of {world_size} "
            f"(e.g. {' or '.join(str(n) for n in (lower, upper) if n > 0)}), or a number of processes that "
            f"divides {tasks} ({', '.join(map(str, divisors))})."
        )
    return tasks // world_size


def all_reduce_grads(
    params: Iterable[Tensor], extras: Tensor | None = None, group: dist.ProcessGroup | None = None
) -> Tensor | None:
    """Averages the ``.grad`` of the meta-parameters over the processes, in place, in one all-reduce.

    The gradients are flattened into one buffer per dtype and device (one in the usual case),
    so the ranks exchange one message per step, not one per tensor. A parameter whose
    ``.grad`` is ``None`` on some ranks counts as a zero gradient there; one whose ``.grad``
    is ``None`` on every rank keeps ``None`` (the optimizer skips it, as in one process).

    Args:
        params: the meta-parameters, in the same order on every rank, e.g.
            ``learner.parameters()``. Parameters with ``requires_grad=False`` are skipped.
        extras: ``(k,)`` optional per-rank values to average in the same all-reduce, e.g. the
            detached meta-loss to log, which saves a second round trip. They travel in the
            gradients' dtype.
        group: the process group; default: the default group.

    Returns:
        ``(k,)`` ``extras`` averaged over the ranks, in its own dtype and device (``extras``
        itself in one process), or ``None`` without ``extras``.

    Raises:
        ValueError: ``extras`` is not one-dimensional.
    """
    if extras is not None and extras.ndim != 1:
        raise ValueError(
            f"extras must be a 1-D tensor of values to average, got shape {tuple(extras.shape)}; flatten it."
        )
    _, world_size = _world(group)
    if world_size == 1:
        return extras
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        if p.requires_grad:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    if not buckets and extras is not None:
        buckets[(extras.dtype, extras.device)] = []
    averaged_extras = None
    for i, ((dtype, device), group_params) in enumerate(buckets.items()):
        parts = [
            torch.zeros(p.numel(), dtype=dtype, device=device) if p.grad is None else p.grad.reshape(-1)
            for p in group_params
        ]
        # One presence flag per parameter: after the sum, > 0 where some rank had a gradient.
        parts.append(torch.tensor([p.grad is not None for p in group_params], dtype=dtype, device=device))
        with_extras = i == 0 and extras is not None
        if with_extras:
            parts.append(extras.detach().to(dtype=dtype, device=device))
        flat = torch.cat(parts)
        # gloo has no AVG reduction: sum, then divide.
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world_size)
        sizes = [p.numel() for p in group_params]
        n, k = sum(sizes), len(group_params)
        present = (flat[n : n + k] > 0).tolist()
        for p, value, anywhere in zip(group_params, flat[:n].split(sizes), present):
            if p.grad is not None:
                p.grad.copy_(value.view_as(p.grad))
            elif anywhere:
                p.grad = value.view_as(p).clone()
        if with_extras:
            assert extras is not None
            averaged_extras = flat[n + k :].to(dtype=extras.dtype, device=extras.device)
    return averaged_extras


def all_reduce_mean(values: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The mean of ``values`` over the processes, e.g. of per-shard metrics to log full-batch values.

    A per-shard mean over tasks averages to the full meta-batch's mean, since the shards are
    equal (see :func:`shard`).

    Args:
        values: any shape, on the device the backend communicates from (CPU for gloo, this
            rank's GPU for NCCL); not modified.
        group: the process group; default: the default group.

    Returns:
        The elementwise mean over the ranks, shaped like ``values`` (``values`` itself in one process).

    Raises:
        TypeError: ``values`` is not floating point (cast it, e.g. ``values.double()``).
    """
    if not values.is_floating_point():
        raise TypeError(
            f"values must be floating point to be averaged, got {values.dtype}; cast them, e.g. values.double()."
        )
    _, world_size = _world(group)
    if world_size == 1:
        return values
    total = values.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.div_(world_size)
