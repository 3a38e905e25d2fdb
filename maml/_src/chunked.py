"""``MetaLearner.backward``: the meta-gradient of a batch accumulated a few tasks at a time.

The meta-loss is the mean over tasks, so each chunk's meta-loss, weighted by its share of the
tasks, backpropagated alone, leaves the same sum in ``.grad``; only one chunk's graph is alive.
Inputs on a graph of their own (features of a trainable encoder) are shared by every chunk, so
the chunks backpropagate into detached copies, and the copies' summed gradient goes through the
inputs' graph once, at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import checks
from .batch import TENSORS, TaskBatch
from .loop import MetaOutput

__all__ = ["backward_in_chunks"]


def backward_in_chunks(
    run: Callable[[TaskBatch], MetaOutput],
    batch: Any,
    chunk: Any,
    default: Callable[[int], int],
    *,
    return_output: bool,
) -> Tensor | MetaOutput:
    """Runs and backpropagates ``batch`` ``chunk`` tasks at a time.

    Args:
        run: one chunk's :class:`MetaOutput` (``MetaLearner.run`` with the call's step weights).
        batch: ``T`` tasks, checked to be a :class:`TaskBatch`.
        chunk: tasks per chunk (the last may have fewer), checked; ``None``: ``default(T)``.
        default: the learner's tasks per chunk for ``T`` tasks.
        return_output: join the chunks' outputs along the task dimension (detached) and return them.

    Returns:
        The meta-loss over all ``T`` tasks, detached, or the joined :class:`MetaOutput` carrying it.
    """
    if not isinstance(batch, TaskBatch):
        raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
    tasks = batch.num_tasks
    checks.integer("chunk", chunk, 1, optional=True)
    size = default(tasks) if chunk is None else chunk
    on_graph = [k for k in TENSORS if getattr(batch, k).requires_grad] if torch.is_grad_enabled() else []
    cut = {k: getattr(batch, k).detach().requires_grad_() for k in on_graph}
    whole = dataclasses.replace(batch, **cut) if cut else batch
    total, outputs = None, []
    fast: dict[str, Tensor] = {}  # the batch's fast weights, written chunk by chunk (return_output)
    for lo in range(0, tasks, size):
        part = whole[lo : lo + size]
        out = run(part)
        loss = out.loss * (part.num_tasks / tasks)
        if not torch.is_grad_enabled():
            loss = checks.evaluation_loss(loss)  # whose backward() says why there is no graph
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        if return_output:
            for k, v in out.fast.items():
                fast.setdefault(k, v.new_empty((tasks, *v.shape[1:])))[lo : lo + part.num_tasks] = v.detach()
            outputs.append(dataclasses.replace(out, loss=total, fast={}))
        # A chunk's output (its fast weights above all) goes before the next chunk runs: a memory plan counts one.
        del out, loss
    assert total is not None
    reached = [k for k in on_graph if cut[k].grad is not None]
    if reached:  # the inputs' own graph, once, with every chunk's gradient summed
        torch.autograd.backward([getattr(batch, k) for k in reached], [cut[k].grad for k in reached])
    return MetaOutput.joined(outputs, total, fast) if return_output else total
