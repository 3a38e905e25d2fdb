"""higher's meta-gradient step, as the benchmarks time it against the engine's.

Written once here for ``benchmarks/speed.py`` and ``benchmarks/optimizers.py``; higher is imported
when a step is built, so importing this module imports no peer library.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

import maml

__all__ = ["Backward", "higher_backward"]

# backward(batch) leaves the meta-gradient in .grad of the meta-parameters it was built with.
Backward = Callable[[maml.TaskBatch], None]
LossFn = Callable[[Tensor, Tensor], Tensor]


def higher_backward(
    model: nn.Module, inner_opt: torch.optim.Optimizer, loss_fn: LossFn, steps: int, adam: bool
) -> Backward:
    """One meta-gradient by higher's ``innerloop_ctx`` with ``inner_opt``, a task at a time, each task's
    ``(query loss / tasks).backward()`` as soon as it is adapted. ``adam``: higher's ``eps`` overridden at each step
    by ``eps * sqrt(1 - beta2^t)`` (``torch.optim.Adam``'s defaults), so that its update is torch.optim's."""
    import higher

    eps = [[1e-8 * math.sqrt(1 - 0.999 ** (k + 1))] for k in range(steps)]

    def backward(batch: maml.TaskBatch) -> None:
        for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
            with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, diffopt):
                for k in range(steps):
                    diffopt.step(loss_fn(fmodel(sx), sy), override={"eps": eps[k]} if adam else None)
                (loss_fn(fmodel(qx), qy) / batch.num_tasks).backward()

    return backward
