"""Whether a memory budget holds: the first call's and a later call's tensor peak against the budget, over model families.

For each family (wide and narrow MLPs, a conv net with batch norm, few shots with many tasks,
many steps, learned rates, MAML++'s per-step batch norm, an ANIL adapt set), each mode that
plans (second and first order, the checkpointed mode with either Hessian-vector strategy) and
each budget from the smallest the learner accepts up, a new learner runs ``backward(batch)``
twice; both calls' peaks of the CPU allocator's blocks are counted exactly by
:func:`blocks.peak_block_bytes` (a wrapper of the allocator's ``posix_memalign`` and ``free``, which the
engine does not use: it plans with the profiler's memory events), the first call's with every probe the
planner runs, and the meta-gradient is compared with unbounded second order's (or first order's).
``tests/engine/test_memory_budget_property.py`` holds each to its budget plus 1 % and 64 KiB
(``maml._src.planner.allowance``), or to the warning a data-dependent model's call gives past it; this
script writes the table of them (``docs/memory-and-speed.md``). It runs itself with the wrapper preloaded.

    python -m benchmarks.budgets --json results/benchmarks/budgets.json
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import maml
from benchmarks.blocks import counting, peak_block_bytes, preloaded_env
from benchmarks.report import write_report
from maml._src.planner import allowance
from maml.nn import StepBatchNorm2d, StepSequential

__all__ = ["DATA_DEPENDENT", "FAMILIES", "MODES", "Family", "Trial", "rows", "smallest_budget", "trial", "unbounded"]

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


class _Recurrent(nn.Module):
    """A GRU or LSTM over 7 time steps of 8 features, 48 hidden units, a linear head on the last output."""

    def __init__(self, cell: type[nn.GRU] | type[nn.LSTM]) -> None:
        super().__init__()
        self.rnn = cell(8, 48, batch_first=True)
        self.head = nn.Linear(48, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _recurrent(cell: type[nn.GRU] | type[nn.LSTM]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _Recurrent(cell).to(DTYPE)

    return build


def _sequences(tasks: int, shots: int) -> maml.TaskBatch:
    g = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(tasks, shots, *shape, generator=g, dtype=DTYPE)  # noqa: E731
    return maml.TaskBatch(draw(7, 8), draw(1), draw(7, 8), draw(1))


class _Routed(nn.Module):
    """A narrow path for every row, and a wide branch (8-2048-4) for the rows whose first feature is positive: what
    a call holds follows the data (routing, masked selection)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(8, 4)
        self.wide = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 4))

    def forward(self, x: Tensor) -> Tensor:
        routed = x[:, 0] > 0
        out = self.narrow(x)
        return out.index_put((routed,), out[routed] + self.wide(x[routed]))


def _routed() -> nn.Module:
    torch.manual_seed(0)
    return _Routed().to(DTYPE)


def _light_first(tasks: int, shots: int) -> maml.TaskBatch:
    """The first task routes one row of ``shots`` through the wide branch, the others every row."""
    batch = _regression(tasks, shots, 8, 4)
    sign = torch.ones(tasks, shots, dtype=DTYPE)
    sign[0, 1:] = -1
    for x in (batch.support_x, batch.query_x):
        x[..., 0] = sign * (x[..., 0].abs() + 0.1)
    return batch


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
    "gru": Family(_recurrent(nn.GRU), lambda: _sequences(16, 10), F.mse_loss, 2),
    "lstm": Family(_recurrent(nn.LSTM), lambda: _sequences(16, 10), F.mse_loss, 2),
    "routed_light_first": Family(_routed, lambda: _light_first(6, 64), F.mse_loss, 2),
}
# Whose activations follow the data: a call past the budget is said (maml.MemoryBudgetWarning) and planned again.
DATA_DEPENDENT = ("routed_light_first",)
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
    plan_budget: int
    first: int
    later: int
    first_said: bool  # the call warned that it held more than its budget (maml.MemoryBudgetWarning)
    later_said: bool
    grad: Tensor = dataclasses.field(repr=False, compare=False)

    @property
    def held(self) -> int:
        """What the plan promised: its budget (the default one's plan may be over it: then its estimate)."""
        return self.budget if self.budget is not None else max(self.plan_budget, self.estimate)

    def row(self) -> dict[str, Any]:
        """The JSON row: the fields, what the plan promised (``held``) and the allowance over it, in bytes."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "grad"}
        return {**fields, "held": self.held, "allowance": allowance(self.held)}


def trial(family_name: str, mode_name: str, budget: int | None) -> Trial:
    """A new learner's first and second ``backward(batch)``, each counted by :func:`blocks.peak_block_bytes`; the
    meta-gradient."""
    family = FAMILIES[family_name]
    run = learner(family, MODES[mode_name], budget)
    batch = family.batch()
    first, first_said = _counted(lambda: run.backward(batch))
    params = list(run.parameters())
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    run.model.zero_grad(set_to_none=True)
    later, later_said = _counted(lambda: run.backward(batch))
    assert run.plan is not None
    plan = run.plan
    return Trial(family_name, mode_name, budget, str(plan), plan.estimate, plan.budget, first, later, first_said,
                 later_said, grad)  # fmt: skip


def _counted(call: Callable[[], object]) -> tuple[int, bool]:
    """The call's peak of the allocator's blocks, and whether it warned that it held more than its budget."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", maml.MemoryBudgetWarning)
        peak = peak_block_bytes(call)
    for w in said:
        if not issubclass(w.category, maml.MemoryBudgetWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return peak, any(issubclass(w.category, maml.MemoryBudgetWarning) for w in said)


def unbounded(family_name: str, mode_name: str) -> Tensor:
    """The meta-gradient of unbounded second order (first order's for the first-order mode): what every plan gives."""
    family = FAMILIES[family_name]
    run = learner(family, "first_order" if mode_name == "first_order" else "second_order", None)
    run.meta_loss(family.batch()).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in run.parameters()])


def rows(families: list[str], modes: list[str]) -> list[dict[str, Any]]:
    """Every family's and mode's trials at the smallest budget, three times it and (checkpointed) the default; each
    row with its meta-gradient's largest difference from :func:`unbounded`'s, relative to that one's largest entry."""
    out = []
    for family in families:
        for mode in modes:
            expected = unbounded(family, mode)
            least = smallest_budget(FAMILIES[family], MODES[mode])
            budgets: list[int | None] = [least, 3 * least] + ([None] if mode.startswith("checkpointed") else [])
            for budget in budgets:
                t = trial(family, mode, budget)
                error = float((t.grad - expected).abs().max() / expected.abs().max())
                out.append({**t.row(), "grad_error": error})
                print(family, mode, t.plan, t.first, t.later, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--family", action="append", choices=list(FAMILIES), help="only these families (repeatable)")
    parser.add_argument("--mode", action="append", choices=list(MODES), help="only these modes (repeatable)")
    args = parser.parse_args()
    if not counting():  # the count needs the wrapper loaded before the C library: run again with it
        sys.exit(
            subprocess.run([sys.executable, "-m", "benchmarks.budgets", *sys.argv[1:]], env=preloaded_env()).returncode
        )
    torch.set_num_threads(args.threads)
    found = rows(args.family or list(FAMILIES), args.mode or list(MODES))
    write_report(args.json, "budgets", sys.argv[1:], "cpu", args.threads, allowance="1% + 64 KiB", rows=found)


if __name__ == "__main__":
    main()
