"""The meta-batch container: T tasks, each with a support set (one, or one per inner step) and a query set."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

TENSORS = ("support_x", "support_y", "query_x", "query_y")  # the fields that are tensors


def support_at(support_x: Tensor, support_y: Tensor, per_step: bool, step: int) -> tuple[Tensor, Tensor]:
    """The support set inner step ``step`` adapts on: ``(T, n, ...)``, the step's own where there is one per step.

    With ``per_step``, ``support_x`` is ``(T, S, n, *x_shape)`` and step ``k`` reads slice ``k % S``
    (more steps than sets go round them again, as epochs over minibatches do).
    """
    if not per_step:
        return support_x, support_y
    k = step % support_x.shape[1]
    return support_x[:, k], support_y[:, k]


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """A meta-batch of ``T`` tasks, stacked on a leading task dimension.

    Every task of a batch has the same number of support and of query examples, so the
    whole batch is four tensors and the engine can batch the tasks with ``vmap``.

    With ``per_step=True`` each inner step adapts on data of its own (higher's new support
    batch at every step, a minibatched inner loop over a large support set, unrolled training):
    the support tensors get a step dimension after the task dimension, and step ``k`` reads
    ``support_x[:, k % S]`` (more steps than ``S`` go round the sets again).

    Attributes:
        support_x: ``(T, n_support, *x_shape)`` inputs the inner loop adapts on; with
            ``per_step``, ``(T, S, n_support, *x_shape)``: one set per inner step.
        support_y: ``(T, n_support, *y_shape)`` their targets; with ``per_step``,
            ``(T, S, n_support, *y_shape)``. An inner loss that needs no labels
            (``MetaLearner(inner_loss_fn=...)``) ignores them: any tensor of that shape does.
        query_x: ``(T, n_query, *x_shape)`` inputs the adapted model is scored on.
        query_y: ``(T, n_query, *y_shape)`` their targets.
        per_step: the support sets are one per inner step (above).

    Raises:
        TypeError: a field is not a tensor.
        ValueError: the fields disagree on the number of tasks or the device, x and y disagree on
            the number of examples, or support and query examples differ in shape.
    """

    support_x: Tensor
    support_y: Tensor
    query_x: Tensor
    query_y: Tensor
    per_step: bool = False

    def __post_init__(self) -> None:
        for name in TENSORS:
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
        if not isinstance(self.per_step, bool):
            raise TypeError(f"TaskBatch: per_step must be True or False, got {self.per_step!r}.")
        if self.per_step:
            for name in TENSORS[:2]:
                value = getattr(self, name)
                if value.ndim < 3 or value.shape[1] == 0:
                    raise ValueError(
                        f"TaskBatch: {name} has shape {tuple(value.shape)}, but per_step=True needs "
                        f"(T tasks, S >= 1 inner steps' sets, n examples, ...). Stack each step's set on "
                        f"dimension 1 (torch.stack(sets, 1)), or pass per_step=False for one set a task."
                    )
            if self.support_x.shape[1] != self.support_y.shape[1]:
                raise ValueError(
                    f"TaskBatch: support_x has {self.support_x.shape[1]} inner steps' sets (dimension 1) but "
                    f"support_y has {self.support_y.shape[1]}; per_step=True needs one target set per input set."
                )
        tasks = self.support_x.shape[0]
        if tasks == 0:
            raise ValueError("TaskBatch: support_x holds 0 tasks; a meta-batch needs at least one task.")
        for name in TENSORS[1:]:
            n = getattr(self, name).shape[0]
            if n != tasks:
                raise ValueError(
                    f"TaskBatch: {name} has {n} tasks (size of dimension 0) but support_x has {tasks}; "
                    f"support and query sets must come from the same tasks, stacked in the same order."
                )
        devices = {name: getattr(self, name).device for name in TENSORS}
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{name} on {device}" for name, device in devices.items())
            raise ValueError(
                f"TaskBatch: its tensors are on different devices ({where}); move them with batch.to(device)."
            )
        skip = 3 if self.per_step else 2  # the support examples' shape starts after (T, S, n) or (T, n)
        for kind in ("x", "y"):
            support, query = getattr(self, f"support_{kind}"), getattr(self, f"query_{kind}")
            if support.shape[skip:] != query.shape[2:]:
                raise ValueError(
                    f"TaskBatch: support_{kind} examples have shape {tuple(support.shape[skip:])} but query_{kind} "
                    f"examples {tuple(query.shape[2:])}; the support and query sets of a task must be alike"
                    + (
                        "."
                        if self.per_step or support.ndim != query.ndim + 1
                        else " (support sets of their own per inner step: pass per_step=True)."
                    )
                )
        for split in ("support", "query"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if split == "support" and self.per_step:
                x, y = x[:, 0], y[:, 0]
            if x.shape[1] != y.shape[1]:
                raise ValueError(
                    f"TaskBatch: {split}_x has {x.shape[1]} examples per task (dimension 1) but "
                    f"{split}_y has {y.shape[1]}; every input needs exactly one target."
                )

    @property
    def num_tasks(self) -> int:
        """The number of tasks ``T``."""
        return self.support_x.shape[0]

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(support_x, support_y, query_x, query_y)``."""
        return self.support_x, self.support_y, self.query_x, self.query_y

    def support_at(self, step: int) -> tuple[Tensor, Tensor]:
        """``(x, y)``, ``(T, n_support, ...)``: the support set inner step ``step`` (0-based) adapts on."""
        return support_at(self.support_x, self.support_y, self.per_step, step)

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

        return TaskBatch(*(move(getattr(self, name)) for name in TENSORS), per_step=self.per_step)

    def __getitem__(self, index: int | slice | Tensor) -> TaskBatch:
        """Selects tasks along the task dimension (an int keeps that dimension, with size 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        tensors = [getattr(self, name)[index] for name in TENSORS]
        if not isinstance(index, slice) or tensors[0].shape[0] == 0:  # what a slice of a valid batch cannot break
            return TaskBatch(*tensors, per_step=self.per_step)
        # Tasks of a checked batch are a checked batch: backward's chunks skip __post_init__ (tens of microseconds).
        part = object.__new__(TaskBatch)
        for name, value in zip((*TENSORS, "per_step"), (*tensors, self.per_step)):
            object.__setattr__(part, name, value)
        return part
