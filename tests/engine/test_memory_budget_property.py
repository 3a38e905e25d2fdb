"""A memory budget is a promise kept from the first call: every plan, probes included, within the budget.

Over model families (``benchmarks.budgets``: wide and narrow MLPs, batch norm, few shots with many
tasks, many steps, learned rates, MAML++'s per-step batch norm, an ANIL adapt set, a GRU and an
LSTM, a model that routes a data-dependent subset of rows through a wide branch), every mode that
plans and budgets from the smallest the learner accepts up, a new learner's first ``backward`` (its
probes included) and a later one hold at most the budget plus ``planner.allowance`` (1 % and 64
KiB) of the CPU allocator's blocks, counted exactly by ``benchmarks/blocks.c`` in a process of their
own (the engine plans with the profiler's events: the count is independent of it); a data-dependent
model's call past it says so (``maml.MemoryBudgetWarning``) and the next plans from its figure. Each
plan's meta-gradient is unbounded second order's (or first order's), float64.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import budgets
from benchmarks.blocks import preloaded_env
from maml._src.planner import DEFAULT_FLOOR, allowance, fmt

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", list(budgets.FAMILIES))
def test_the_first_call_and_later_calls_stay_within_the_budget(family, tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.budgets", "--json", str(out), "--family", family]
    subprocess.run(command, cwd=REPO, env=preloaded_env(), check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == set(budgets.MODES)
    for r in rows:
        held = r["held"]
        assert held == (r["budget"] if r["budget"] is not None else max(r["plan_budget"], r["estimate"])), r
        for call in ("first", "later"):
            over = r[call] > held + allowance(held)
            if family in budgets.DATA_DEPENDENT:
                assert not over or r[f"{call}_said"], (r, call, fmt(r[call]), fmt(held))
            else:
                assert not over, (r, call, fmt(r[call]), fmt(held))
                assert not r[f"{call}_said"], r
        if r["budget"] is None:  # the default budget is met where the mode can meet it
            assert r["estimate"] <= max(r["plan_budget"], DEFAULT_FLOOR) or "over" in r["plan"], r
        assert r["grad_error"] <= 1e-12, r
