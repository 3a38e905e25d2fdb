"""Tasks from elsewhere (a learn2learn ``TaskDataset``, any iterable of ``(x, y)``) as ``TaskBatch``es."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from maml import TaskBatch

from . import checks


def split_task(x: Tensor, y: Tensor, shots: int, query: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Splits one task's examples into a support set and a query set.

    Integer targets are class labels: every class gives its first ``shots`` examples to the
    support set and its next ``query`` examples (default: all the rest) to the query set,
    and the labels become ``0..ways-1`` in the sorted order of their values. Floating-point
    targets are regression targets: the first ``shots`` examples are the support set and the
    next ``query`` (default: all the rest) the query set. The split keeps the examples'
    order, so it is random when the source draws them at random (learn2learn's ``KShots``).

    Args:
        x: ``(n, *x_shape)`` one task's inputs.
        y: ``(n, *y_shape)`` their targets; ``(n,)`` integer labels for classification.
        shots: support examples per class (per task for regression).
        query: query examples per class (per task for regression); default: all the rest.

    Returns:
        ``(support_x, support_y, query_x, query_y)``, classification sets grouped by label.
    """
    if not isinstance(x, Tensor) or not isinstance(y, Tensor) or x.ndim < 1 or y.ndim < 1:
        raise TypeError(
            f"a task must be a pair (x, y) of tensors with the examples on dimension 0, got "
            f"({type(x).__name__}, {type(y).__name__}); with learn2learn, add LoadData(dataset) to the task transforms."
        )
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} examples but y has {y.shape[0]}; every input needs exactly one target.")
    checks.positive_int("shots", shots)
    if query is not None:
        checks.positive_int("query", query)

    if y.is_floating_point() or y.is_complex():
        n = x.shape[0]
        end = n if query is None else shots + query
        if end > n or end == shots:
            raise ValueError(
                f"the task has {n} examples but shots={shots} and query={query} need "
                f"{'more than ' + str(shots) if query is None else end}; sample larger tasks or lower shots/query."
            )
        return x[:shots], y[:shots], x[shots:end], y[shots:end]

    if y.ndim != 1:
        raise ValueError(f"integer labels must have shape (n,), got {tuple(y.shape)}.")
    values, inverse, counts = torch.unique(y, sorted=True, return_inverse=True, return_counts=True)
    fewest = int(counts.min())
    if query is None:
        if not bool((counts == counts[0]).all()):
            raise ValueError(
                f"the classes of the task have {counts.tolist()} examples; with query=None every class must "
                f"have the same number (the rest after shots goes to the query set). Pass query explicitly."
            )
        query = fewest - shots
    if fewest < shots + query or query < 1:
        label = int(values[counts.argmin()])
        raise ValueError(
            f"class {label} of the task has {fewest} examples but shots + query = {shots} + {query} = "
            f"{shots + query} are needed (and at least one query example); sample tasks with "
            f"KShots(dataset, k=shots + query) or lower shots/query."
        )
    order = torch.argsort(inverse, stable=True)
    sorted_class = inverse[order]
    position = torch.arange(order.numel(), device=y.device) - (torch.cumsum(counts, 0) - counts)[sorted_class]
    support = order[position < shots]
    query_index = order[(position >= shots) & (position < shots + query)]
    return x[support], inverse[support], x[query_index], inverse[query_index]


def collate(tasks: Iterable[Any], shots: int, query: int | None = None) -> TaskBatch:
    """Splits each ``(x, y)`` task with :func:`split_task` and stacks them into one ``TaskBatch``.

    Args:
        tasks: ``(x, y)`` pairs (lists, as learn2learn returns them, work too).
        shots: support examples per class (per task for regression).
        query: query examples per class (per task for regression); default: all the rest.

    Returns:
        A ``maml.TaskBatch`` of ``T = len(tasks)`` tasks.
    """
    splits = []
    for i, task in enumerate(tasks):
        if not isinstance(task, (tuple, list)) or len(task) != 2:
            raise TypeError(
                f"task {i} is a {type(task).__name__}, not an (x, y) pair; learn2learn TaskDatasets need "
                f"LoadData(dataset) among their task transforms."
            )
        splits.append(split_task(task[0], task[1], shots, query))
    if not splits:
        raise ValueError("collate got no task; pass at least one (x, y) pair.")
    fields = []
    for f, name in enumerate(("support_x", "support_y", "query_x", "query_y")):
        shapes = [tuple(s[f].shape) for s in splits]
        if len(set(shapes)) > 1:
            odd = next(i for i, s in enumerate(shapes) if s != shapes[0])
            raise ValueError(
                f"the tasks do not stack: {name} of task 0 has shape {shapes[0]} but task {odd} has "
                f"{shapes[odd]}; every task needs the same number of classes and examples per class."
            )
        fields.append(torch.stack([s[f] for s in splits]))
    return TaskBatch(*fields)


def batches(
    tasks: Iterable[Any],
    tasks_per_batch: int,
    shots: int,
    query: int | None = None,
    *,
    drop_last: bool = False,
) -> Iterator[TaskBatch]:
    """Groups an iterable of ``(x, y)`` tasks into ``TaskBatch``es of ``tasks_per_batch`` tasks.

    Args:
        tasks: ``(x, y)`` pairs, possibly endless.
        tasks_per_batch: tasks per meta-batch ``T``.
        shots: support examples per class (per task for regression).
        query: query examples per class (per task for regression); default: all the rest.
        drop_last: drop a last meta-batch of fewer than ``tasks_per_batch`` tasks.

    Returns:
        An iterator of ``maml.TaskBatch``es, see :func:`collate`.
    """
    # Checked here, not in the generator, so that bad arguments fail at the call.
    checks.positive_int("tasks_per_batch", tasks_per_batch)
    checks.positive_int("shots", shots)
    if query is not None:
        checks.positive_int("query", query)
    return _batches(iter(tasks), tasks_per_batch, shots, query, drop_last)


def _batches(
    iterator: Iterator[Any], tasks_per_batch: int, shots: int, query: int | None, drop_last: bool
) -> Iterator[TaskBatch]:
    while True:
        chunk = list(itertools.islice(iterator, tasks_per_batch))
        if not chunk or (drop_last and len(chunk) < tasks_per_batch):
            return
        yield collate(chunk, shots, query)


def from_learn2learn(
    taskset: Any,
    tasks_per_batch: int,
    shots: int,
    query: int | None = None,
    *,
    num_batches: int | None = None,
) -> Iterator[TaskBatch]:
    """``TaskBatch``es from a learn2learn ``Taskset``/``TaskDataset`` (anything with ``.sample() -> (x, y)``).

    Build the task set with ``NWays(dataset, n=ways)``, ``KShots(dataset, k=shots + query)`` and
    ``LoadData`` (and ``RemapLabels`` if you like; labels are remapped to ``0..ways-1`` either way).
    Each task is split with :func:`split_task`: every class gives its first ``shots`` examples to
    the support set and the next ``query`` to the query set, grouped by label, as
    :class:`FewShotSampler` groups them.

    Args:
        taskset: a ``learn2learn.data.TaskDataset``.
        tasks_per_batch: tasks per meta-batch ``T``.
        shots: support examples per class.
        query: query examples per class; default: all the rest of each class.
        num_batches: stop after this many meta-batches (default: never).

    Returns:
        An iterator of ``maml.TaskBatch``es, see :func:`collate`.

    Example:
        5-way 1-shot tasks with 15 query images a class, from a learn2learn task set over any labelled
        images (here 10 classes of 20 random ones):

        ```python
        import learn2learn as l2l
        import torch
        from torch.utils.data import TensorDataset

        import tasks

        images, labels = torch.rand(200, 1, 28, 28), torch.arange(10).repeat_interleave(20)
        dataset = l2l.data.MetaDataset(TensorDataset(images, labels))
        taskset = l2l.data.Taskset(
            dataset,
            task_transforms=[
                l2l.data.transforms.NWays(dataset, n=5),
                l2l.data.transforms.KShots(dataset, k=1 + 15),  # shots + query images of each class
                l2l.data.transforms.LoadData(dataset),
            ],
        )
        batches = tasks.from_learn2learn(taskset, tasks_per_batch=4, shots=1, query=15, num_batches=100)
        batch = next(batches)  # support_x (4, 5, 1, 28, 28), query_x (4, 75, 1, 28, 28)
        support_y, query_y = batch.support_y, batch.query_y  # (4, 5), (4, 75): labels 0..4, grouped by label
        ```
    """
    if not callable(getattr(taskset, "sample", None)):
        raise TypeError(
            f"taskset must be a learn2learn TaskDataset (or have a .sample() method returning (x, y)), "
            f"got {type(taskset).__name__}; for a plain iterable of tasks use tasks.batches(...)."
        )
    if num_batches is not None:
        checks.positive_int("num_batches", num_batches)
    draws = (taskset.sample() for _ in itertools.count())
    return itertools.islice(batches(draws, tasks_per_batch, shots, query), num_batches)
