"""``--memory-budget``: the scripts plan each step within it, log and record the plan, and refuse in one line."""

from __future__ import annotations

import json
import re

import pytest
from helpers import checkpoint, one_error, run_sine

SHORT = ["--iterations", "2", "--log-every", "1", "--val-every", "2", "--eval-tasks", "4"]


def test_a_run_records_the_plan_its_budget_made(capsys, tmp_path):
    out = tmp_path / "run"
    err = run_sine(capsys, [*SHORT, "--memory-budget", "1MiB", "--out", str(out)])
    plan = json.loads((out / "results.json").read_text())["memory_plan"]
    assert plan.endswith("of a 1.0 MiB budget") and f"memory plan: {plan}" in err, err[-2000:]
    assert checkpoint(out)["learner"]["plans"], "a resumed run would measure again"
    assert "USDT" not in err and "gpuGetDeviceCount" not in err  # the profiler's own lines are the engine's to drop


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--memory-budget", "1KiB"],
            r"error: --memory-budget 1KiB: memory_budget=1.0 KiB is below what one task of mode='second_order' "
            r"holds at steps=1 \(about [0-9.]+ KiB\): pass at least memory_budget=[0-9]+, or mode='checkpointed'",
        ),
        (["--memory-budget", "6gigs"], r"error: memory_budget='6gigs' is not a size; it must be bytes \(an int\)"),
        (
            ["--memory-budget", "1GiB", "--mode", "reptile"],
            r"error: memory_budget='1GiB' does not apply to mode='reptile'",
        ),
    ],
)
def test_a_budget_the_engine_refuses_is_one_line_and_nothing_written(capsys, tmp_path, flags, message):
    out = tmp_path / "run"
    err = run_sine(capsys, [*SHORT, *flags, "--out", str(out)], code=2)
    assert re.match(message, one_error(err)), one_error(err)
    assert not out.exists()
