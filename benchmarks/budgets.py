"""Whether a memory budget holds: the first call's and a later call's tensor peak against the budget, over model families.

For each family (wide and narrow MLPs, a conv net with batch norm, few shots with many tasks,
many steps, learned rates, MAML++'s per-step batch norm, an ANIL adapt set), each mode that
plans (second and first order, the checkpointed mode with either Hessian-vector strategy) and
each budget from the smallest the learner accepts up, a new learner runs ``backward(batch)``
twice; both calls' peaks of live tensor bytes are counted by :func:`tensor_peak.dispatch_peak_bytes`,
a dispatch mode the engine does not use (it plans with the profiler's memory events), the first
call's with every probe the planner runs. ``tests/engine/test_memory_budget.py`` holds each to
its budget plus :data:`SLACK`; this script writes the table of them (``docs/memory-and-speed.md``).

    python -m benchmarks.budgets --json results/benchmarks/budgets.json
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import maml
from benchmarks.report import write_report
from benchmarks.tensor_peak import dispatch_peak_bytes
from maml.nn import StepBatchNorm2d, StepSequential

__all__ = ["FAMILIES", "MODES", "SLACK", "Family", "Trial", "smallest_budget", "trial"]

SLACK = 2 * 2**20  # what a step holds beyond the plan: the batch's slices, the allocator's rounding
DTYPE = torch.float64  # the meta-gradients are compared with unbounded second order's to 1e-12


@dataclasses.dataclass(frozen=True)
class Family:
    """A model, its meta-batch and the learner's options: one configuration a budget must hold."""

    build: Callable[[], nn.Module]
    batch: Callable[[], maml.TaskBatch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    steps: int
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _regression(tasks: int, shots: int, features: int, outputs: int) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(0)
    draw = lambda n, d: torch.randn(tasks, n, d, generator=g, dtype=DTYPE)  # noqa: E731
    return maml.TaskBatch(draw(shots, features), draw(shots, outputs), draw(shots, features), draw(shots, outputs))


def _images(tasks: int, ways: int, shots: int, query: int, side: int = 16) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(0)

    def split(per_class: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(tasks, ways * per_class, 1, side, side, generator=g, dtype=DTYPE)
        return x, torch.arange(ways).repeat_interleave(per_class).expand(tasks, -1).contiguous()

    return maml.TaskBatch(*split(shots), *split(query))


def _mlp(*widths: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1]).to(DTYPE)

    return build


def _conv(step_norm: int = 0) -> Callable[[], nn.Module]:
    """Two conv blocks (batch norm, or MAML++'s per-step batch norm over ``step_norm`` steps) and a head, 16x16."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        norm = (lambda c: StepBatchNorm2d(c, step_norm)) if step_norm else (
            lambda c: nn.BatchNorm2d(c, track_running_stats=False)
        )  # fmt: skip
        blocks = [m for c in (1, 16) for m in (nn.Conv2d(c, 16, 3, padding=1), norm(16), nn.ReLU(), nn.MaxPool2d(2))]
        return StepSequential(*blocks, nn.Flatten(), nn.Linear(16 * 4 * 4, 5)).to(DTYPE)

    return build


FAMILIES: dict[str, Family] = {
    "wide_mlp": Family(_mlp(8, 512, 512, 4), lambda: _regression(12, 5, 8, 4), F.mse_loss, 4),
    "narrow_mlp": Family(_mlp(1, 40, 40, 1), lambda: _regression(25, 10, 1, 1), F.mse_loss, 5),
    "conv_batchnorm": Family(_conv(), lambda: _images(6, 5, 3, 5), F.cross_entropy, 3),
    "few_shots_many_tasks": Family(_mlp(8, 256, 256, 5), lambda: _regression(32, 1, 8, 5), F.mse_loss, 2),
    "many_steps": Family(_conv(), lambda: _images(4, 5, 1, 3), F.cross_entropy, 12),
    "learned_rates": Family(
        _mlp(8, 256, 256, 4), lambda: _regression(8, 5, 8, 4), F.mse_loss, 3, {"learn_inner_lr": "per_parameter"}
    ),
    "maml++_step_norm": Family(_conv(3), lambda: _images(6, 5, 2, 3), F.cross_entropy, 3),
    "anil_head": Family(_conv(), lambda: _images(6, 5, 3, 5), F.cross_entropy, 3, {"adapt": ["9.weight", "9.bias"]}),
}
MODES: dict[str, str | maml.Mode] = {
    "second_order": "second_order",
    "first_order": "first_order",
    "checkpointed": "checkpointed",
    "checkpointed_fwd": maml.Checkpointed(hvp="forward_over_reverse"),
}


def learner(family: Family, mode: str | maml.Mode, budget: int | None, batching: str = "auto") -> maml.MetaLearner:
    return maml.MetaLearner(
        family.build(),
        family.loss_fn,
        inner_lr=0.05,
        steps=family.steps,
        mode=mode,
        batching=batching,
        memory_budget=budget,
        **family.options,
    )


def smallest_budget(family: Family, mode: str | maml.Mode) -> int:
    """The smallest budget the learner accepts, as its refusal of a one-byte budget names it."""
    try:
        learner(family, mode, 1).plan_for(family.batch())
    except ValueError as e:
        found = re.search(r"pass at least memory_budget=([0-9]+)", str(e))
        if found:
            return int(found.group(1))
        raise
    raise AssertionError("a one-byte budget was accepted")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One configuration's peaks, bytes, its plan and the plan's estimate of a call."""

    family: str
    mode: str
    budget: int | None
    plan: str
    estimate: int
    first: int
    later: int
    grad: Tensor = dataclasses.field(repr=False, compare=False)

    @property
    def held(self) -> int:
        """What the plan promised: its budget (a default one's plan may be over it: then its estimate)."""
        return self.budget if self.budget is not None else self.estimate

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "grad"}


def trial(family_name: str, mode_name: str, budget: int | None) -> Trial:
    """A new learner's first and second ``backward(batch)``, each counted by the dispatch mode; the meta-gradient."""
    family = FAMILIES[family_name]
    run = learner(family, MODES[mode_name], budget)
    batch = family.batch()
    first = dispatch_peak_bytes(lambda: run.backward(batch))
    params = list(run.parameters())
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    run.model.zero_grad(set_to_none=True)
    later = dispatch_peak_bytes(lambda: run.backward(batch))
    assert run.plan is not None
    return Trial(family_name, mode_name, budget, str(run.plan), run.plan.estimate, first, later, grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for family in FAMILIES:
        for mode in MODES:
            least = smallest_budget(FAMILIES[family], MODES[mode])
            budgets: list[int | None] = [least, 3 * least] + ([None] if mode.startswith("checkpointed") else [])
            for budget in budgets:
                t = trial(family, mode, budget)
                rows.append(t.row())
                print(family, mode, t.plan, t.first, t.later, flush=True)
    write_report(args.json, "budgets", sys.argv[1:], "cpu", args.threads, slack=SLACK, rows=rows)


if __name__ == "__main__":
    main()
