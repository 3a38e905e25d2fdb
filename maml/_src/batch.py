"""The meta-batch container: T tasks, each with a support set and a query set."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

_FIELDS = ("support_x", "support_y", "query_x", "query_y")


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """A meta-batch of ``T`` tasks, stacked on a leading task dimension.

    Every task of a batch has the same number of support and of query examples, so the
    whole batch is four tensors and the engine can batch the tasks with ``vmap``.

    Attributes:
        support_x: ``(T, n_support, *x_shape)`` inputs the inner loop adapts on.
        support_y: ``(T, n_support, *y_shape)`` their targets.
        query_x: ``(T, n_query, *x_shape)`` inputs the adapted model is scored on.
        query_y: ``(T, n_query, *y_shape)`` their targets.

    Raises:
        TypeError: a field is not a tensor.
        ValueError: the fields disagree on the number of tasks or the device, x and y disagree on
            the number of examples, or support and query examples differ in shape.
    """

    support_x: Tensor
    support_y: Tensor
    query_x: Tensor
    query_y: Tensor

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"TaskBatch: {name} must be a torch.Tensor with a leading task dimension, "
                    f"got {type(value).__name__}. Stack the tasks first, e.g. torch.stack(list_of_{name})."
                )
            if value.ndim < 2:
                raise ValueError(
                    f"TaskBatch: {name} has shape {tuple(value.shape)}; it needs at least two "
                    f"dimensions, (T tasks, n examples, ...). For a single task use {name}.unsqueeze(0)."
                )
        tasks = self.support_x.shape[0]
        if tasks == 0:
            raise ValueError("TaskBatch: support_x holds 0 tasks; a meta-batch needs at least one task.")
        for name in _FIELDS[1:]:
            n = getattr(self, name).shape[0]
            if n != tasks:
                raise ValueError(
                    f"TaskBatch: {name} has {n} tasks (size of dimension 0) but support_x has {tasks}; "
                    f"support and query sets must come from the same tasks, stacked in the same order."
                )
        devices = {name: getattr(self, name).device for name in _FIELDS}
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{name} on {device}" for name, device in devices.items())
            raise ValueError(
                f"TaskBatch: its tensors are on different devices ({where}); move them with batch.to(device)."
            )
        for kind in ("x", "y"):
            support, query = getattr(self, f"support_{kind}"), getattr(self, f"query_{kind}")
            if support.shape[2:] != query.shape[2:]:
                raise ValueError(
                    f"TaskBatch: support_{kind} examples have shape {tuple(support.shape[2:])} but query_{kind} "
                    f"examples {tuple(query.shape[2:])}; the support and query sets of a task must be alike."
                )
        for split in ("support", "query"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.shape[1] != y.shape[1]:
                raise ValueError(
                    f"TaskBatch: {split}_x has {x.shape[1]} examples per task (dimension 1) but "
                    f"{split}_y has {y.shape[1]}; every input needs exactly one target."
                )

    @property
    def num_tasks(self) -> int:
        """The number of tasks ``T``."""
        return self.support_x.shape[0]

    def to(self, *args: Any, **kwargs: Any) -> TaskBatch:
        """Returns the batch with every tensor moved like ``Tensor.to(*args, **kwargs)``.

        Only floating-point tensors change dtype, so integer class labels stay integers.
        """
        dtype = kwargs.pop("dtype", None)
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
        args = tuple(a for a in args if not isinstance(a, torch.dtype))

        def move(t: Tensor) -> Tensor:
            t = t.to(*args, **kwargs)
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        return TaskBatch(*(move(getattr(self, name)) for name in _FIELDS))

    def __getitem__(self, index: int | slice | Tensor) -> TaskBatch:
        """Selects tasks along the task dimension (an int keeps that dimension, with size 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return TaskBatch(*(getattr(self, name)[index] for name in _FIELDS))
