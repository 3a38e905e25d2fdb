"""The learner's planner: measures one task's step on a configuration once, then plans every batch from it.

What is measured (bytes, by :func:`budget.peak_bytes`, on the call's own first tasks) depends on
the mode's ``plans`` entry in ``modes.TABLE``:

- ``"chunks"`` (second and first order, with a ``memory_budget``): the mode's step of one task at
  one and at two inner steps, extrapolated linearly to the call's steps; then, where the plan
  batches several tasks by ``vmap`` and the budget leaves room, two tasks batched at one step,
  whose excess over twice one task scales the estimate;
- ``"segments"`` (checkpointed, always): one task replaying one step, and, as above, two tasks
  batched; a task's iterate (fast weights and rule state) is counted from its shapes.

Each probe holds at most what the step it plans would hold with one task (or two, batched, where
the plan batches more), so a probe never sets the peak of a mode chosen for memory. A
configuration is the device, the mode, the inner steps and one task's shapes; its measurements
are kept, and a checkpoint (``state_dict``) keeps them, so a resumed run plans alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from . import budget, modes
from .budget import Plan
from .forward import TaskForward
from .loop import Problem, per_task

__all__ = ["Planner"]

_ROOM = 1.5  # a batched probe of two tasks runs where the budget holds this many times two lone tasks


class Planner:
    """Plans a learner's training steps against its memory budget (:mod:`budget`), from measurements it keeps."""

    def __init__(self) -> None:
        self.measured: dict[str, dict[str, int]] = {}  # configuration -> what its probes measured

    def plan(
        self,
        p: Problem,
        *,
        mode: str,
        memory_budget: Any,
        batching: str,
        every: int | None,
    ) -> Plan | None:
        """The plan of a training call on ``p.batch``; ``None`` where the mode plans nothing.

        Args:
            p: the call's problem (the learner's loop and parameters, the tasks, the steps).
            mode: the learner's mode.
            memory_budget: the learner's option, as given (``budget.budget_bytes`` reads it).
            batching: how the learner batches tasks on this device: ``"vmap"`` or ``"loop"``.
            every: the mode's ``Checkpointed.every`` (``None``: the segment length is planned).
        """
        kind = modes.TABLE[mode].plans
        device = p.batch.support_x.device
        limit = budget.budget_bytes(memory_budget, device)
        if kind is None or (kind == "chunks" and limit is None):
            return None
        tasks, steps = p.batch.num_tasks, p.steps
        key = repr((str(device), mode, steps, _shapes(p)))
        m = self.measured.get(key)
        if m is None:
            m = self.measured[key] = self._measure(p, mode, kind)
        if kind == "chunks":
            plan = budget.plan_chunks(limit, tasks, m["one"], batching, mode, steps)
            if plan.tasks > 1 and batching == "vmap":
                m = self._batched(key, p, mode, limit)
                plan = budget.plan_chunks(limit, tasks, m["batched"], batching, mode, steps)
            return plan
        default = limit is None
        if default:  # one task's second-order step (at most replaying each of its steps), at least the floor
            one_task = max(steps, 1) * m["one"]
            limit = max(budget.DEFAULT_FLOOR, one_task)

        def segments(replay: int) -> Plan:
            return budget.plan_checkpointed(
                limit, default, tasks, steps, replay, m["iterate"], every, batching
            )  # fmt: skip

        plan = segments(m["one"])
        if plan.tasks > 1 and batching == "vmap":
            plan = segments(self._batched(key, p, mode, limit)["batched"])
        return plan

    def _measure(self, p: Problem, mode: str, kind: str) -> dict[str, int]:
        """One task's peaks: the step at the call's steps (chunks) or one replayed step (segments)."""
        one = _peak(p, mode, 1, 1, "loop")
        if kind == "segments":
            return {"one": one, "iterate": _iterate_bytes(p)}
        per_step = max(_peak(p, mode, 1, 2, "loop") - one, 0) if p.steps >= 2 else 0
        return {"one": one + (max(p.steps, 1) - 1) * per_step, "at_one": one}

    def _batched(self, key: str, p: Problem, mode: str, limit: int) -> dict[str, int]:
        """The per-task need of batched tasks: two tasks by ``vmap`` at one step, scaled, where the budget has room."""
        m = self.measured[key]
        if "batched" not in m:
            at_one = m.get("at_one", m["one"])
            if p.batch.num_tasks < 2 or 2 * at_one * _ROOM > limit:
                return {**m, "batched": math.ceil(m["one"] * _ROOM)}  # no room to probe: the bound it would allow
            two = _peak(p, mode, 2, 1, "vmap")
            m["batched"] = math.ceil(m["one"] * max(1.0, two / (2 * at_one)))
        return m


def _shapes(p: Problem) -> tuple[Any, ...]:
    """One task's shapes and dtypes: what a configuration's measurements depend on beside device, mode and steps."""
    tensors = [*p.params.values(), *(t[0] for t in (p.batch.support_x, p.batch.support_y, p.batch.query_x))]
    tensors.append(p.batch.query_y[0])
    return tuple((tuple(t.shape), str(t.dtype)) for t in tensors)


def _iterate_bytes(p: Problem) -> int:
    """One task's fast weights and rule state, bytes: what the checkpointed mode keeps per task and kept step."""
    fast = per_task({k: v.detach() for k, v in p.params.items()}, 1)
    state = p.loop.rule.init(fast)
    tensors = [*fast.values(), *(t for d in state for t in d.values())]
    return sum(t.numel() * t.element_size() for t in tensors)


def _peak(p: Problem, mode: str, tasks: int, steps: int, batching: str) -> int:
    """The tensor peak of ``mode``'s training step (meta-loss and its gradient) on ``tasks`` tasks of ``p`` at ``steps``.

    The gradient is taken by ``torch.autograd.grad``, so no ``.grad`` changes; random draws
    (dropout) leave the stream as they found it.
    """
    f = p.loop.forward
    loop = dataclasses.replace(p.loop, forward=TaskForward(f.model, f.loss_fn, batching, None))
    problem = p._replace(loop=loop, batch=p.batch[:tasks], steps=steps)
    # Reverse-over-reverse whatever the learner's hvp, so one measurement serves both: forward-over-reverse holds
    # less (no second-order graph), so its plan errs towards less memory; torch.func refuses saved_bytes' hooks.
    spec = modes.Checkpointed(every=1) if modes.TABLE[mode].plans == "segments" else modes.Mode.of(mode)
    call = modes.Call(problem, None, tasks, spec)
    leaves = [v for v in p.params.values() if v.requires_grad]
    device = p.batch.support_x.device

    def step() -> None:
        out = modes.TABLE[mode].train(call)
        torch.autograd.grad(out.loss, leaves, allow_unused=True)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), modes.attention(mode):
        return budget.peak_bytes(step, device)
