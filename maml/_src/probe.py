"""A learner's first look at a model configuration: :func:`check_model`, then ``"auto"``'s batching where no plan chooses it.

Both run before the inner loop, on the call's own parameters and tasks, detached: the check once
per device and train/eval configuration of the model (a module switched to eval mode may write
its buffers differently), the choice of batching (``planner.choose_batching``) on the first batch
of more than one task on each device, where no memory plan makes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .batch import TaskBatch
from .forward import Params, TaskForward, unfused_layers
from .model_check import check_model, unused_parameters
from .planner import TIMED_TASKS, choose_batching, data_dependent

__all__ = ["Probe"]


class Probe:
    """Remembers which configurations of ``model`` were checked, and settles ``forward``'s batching.

    Args:
        model: the learner's network.
        forward: the learner's per-task forward pass, whose batching ``"auto"`` settles.
    """

    def __init__(self, model: nn.Module, forward: TaskForward) -> None:
        self.model = model
        self.forward = forward
        self._checked: set[Any] = set()  # (device, each module's training flag)
        # By that key: each inner step's unused parameters (TaskForward.unused), found as a call first needs them.
        self._unused: dict[Any, dict[int, frozenset[str]]] = {}
        self.closes_over = False  # the inner loss reads a tensor on a graph that none of its arguments is
        # The first operator whose output's size follows the data (planner.data_dependent): its calls are measured.
        self.data_dependent: str | None = None

    @unfused_layers()  # its passes are differentiated: no fused attention layers (forward.unfused_layers)
    def __call__(
        self,
        params: Params,
        consts: Params,
        batch: TaskBatch,
        *,
        batching: str,
        lean: bool,
        choose: bool = True,
        twice: bool = False,
        steps: int | None = None,
    ) -> None:
        """Checks the model on ``batch``'s first task if its configuration is new, then lets ``"auto"`` choose.

        Args:
            params: the adapted parameters, without a task dimension.
            consts: the other parameters and the buffers.
            batch: ``T`` tasks; ``T > 1`` lets ``"auto"`` time vmap against the loop on them.
            batching: the learner's ``batching`` (read at every call).
            lean: the learner's mode replays segments for memory (``modes.Paths.plans == "segments"``; read
                at every call: the mode may be set between steps).
            choose: let ``"auto"`` time its batching on this batch; a call whose step a memory
                budget plans times it on the planned tasks instead (``planner.Planner``).
            twice: the call differentiates its inner steps (a second-order step): time those.
            steps: the inner steps the call runs: which parameters each step's support loss leaves unused is
                found for those not yet probed (``TaskForward.unused``); ``None``: the call runs no inner loop.
        """
        device = batch.support_x.device
        key = (device, tuple(m.training for m in self.model.modules()))
        checked = key in self._checked
        self.forward.unused_by_step = self._unused.setdefault(key, {})  # a module switched to eval mode may differ
        probe = steps is not None and bool(self._unprobed(steps))
        if not probe and checked and (batching != "auto" or self.forward.settled(device) or not choose):
            return
        with torch.no_grad():
            one = {k: v.detach() for k, v in params.items()}
            shared = {k: v.detach() for k, v in consts.items()}
        if not checked:
            x, y = batch[:1].support_at(0)
            self.closes_over |= check_model(self.forward, one, shared, x, y, may_fall_back=batching == "auto")
            devices = sorted({t.device.index for t in (*one.values(), x) if t.is_cuda})
            with torch.no_grad(), torch.random.fork_rng(devices=devices):  # dropout's stream stays as it was
                task = {k: v.unsqueeze(0) for k, v in one.items()}
                found = data_dependent(lambda: self.forward(task, shared, x, y, batching="loop", inner=True))
            self.data_dependent = self.data_dependent or found
            self._checked.add(key)
        if probe:
            first = batch[:1]
            for step in self._unprobed(steps or 0):
                x, y = first.support_at(step)
                self.forward.unused_by_step[step] = unused_parameters(self.forward, one, shared, x, y, step)
        if not choose:
            return
        # The checkpointed mode with its tasks given plans nothing (MetaLearner._plans) and is chosen for memory (lean):
        # "auto" takes the loop there, untimed. Timing vmap holds several tasks' graphs at once, more than the mode's
        # segments do (a conv net of tests/engine/test_memory_plan.py, 2 tasks a chunk: 7.0 MB of tensors against 9.8).
        if lean and torch.is_grad_enabled() and batching == "auto":
            self.forward.settle(device, "loop")
        tasks = min(batch.num_tasks, TIMED_TASKS)
        if tasks < 2 or self.forward.settled(device):
            return  # one task runs unbatched whatever is chosen: a larger batch decides
        part = batch[:tasks]
        data = [part.support_at(0), (part.query_x, part.query_y)]
        fast = {k: v.expand(tasks, *v.shape) for k, v in one.items()}
        choose_batching(self.forward, fast, shared, data, second_order=twice)

    def _unprobed(self, steps: int) -> list[int]:
        """The inner steps of ``0 .. steps - 1`` whose unused parameters are not known yet (one for all steps where
        the support pass does not see the step)."""
        known = self.forward.unused_by_step
        return [s for s in range(steps if self.forward.by_step else min(steps, 1)) if s not in known]
