"""A memory budget is a promise kept from the first call: every plan, probes included, within the budget.

Over model families (``benchmarks.budgets``: wide and narrow MLPs, batch norm, few shots with many
tasks, many steps, learned rates, MAML++'s per-step batch norm, an ANIL adapt set), every mode
that plans and budgets from the smallest the learner accepts up, a new learner's first
``backward`` (its probes included) and a later one hold at most the budget plus ``SLACK`` of live
tensors, counted by a dispatch mode the engine does not use; and each plan's meta-gradient is
unbounded second order's (or first order's), float64.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import budgets
from maml._src import planner


def unbounded(family: str, mode: str) -> torch.Tensor:
    run = budgets.learner(budgets.FAMILIES[family], "first_order" if mode == "first_order" else "second_order", None)
    run.meta_loss(budgets.FAMILIES[family].batch()).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in run.parameters()])


@pytest.mark.parametrize("mode", list(budgets.MODES))
@pytest.mark.parametrize("family", list(budgets.FAMILIES))
def test_the_first_call_and_later_calls_stay_within_the_budget(family, mode):
    planner._CHOICES.clear()  # each learner times "auto" itself: its probes are counted
    least = budgets.smallest_budget(budgets.FAMILIES[family], budgets.MODES[mode])
    expected = unbounded(family, mode)
    tried = [least, 3 * least] + ([None] if mode.startswith("checkpointed") else [])
    for budget in tried:
        t = budgets.trial(family, mode, budget)
        assert max(t.first, t.later) <= t.held + budgets.SLACK, (t, planner.fmt(t.first), planner.fmt(t.later))
        if budget is None:  # the default budget is met where the mode can meet it
            assert t.estimate <= max(t.held, planner.DEFAULT_FLOOR) or "over" in t.plan, t
        torch.testing.assert_close(t.grad, expected, rtol=0, atol=1e-12 * expected.abs().max())
