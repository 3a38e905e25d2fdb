"""The planner's CPU measurement (``planner.measure``) and what planning costs.

A free the allocator reports for a block allocated under an earlier profile is not the call's: a
call that allocates 16 MiB reads 16 MiB whatever garbage it collects on the way. Planning starts
the profiler through ``torch.autograd``'s calls, which import no compiler (``torch.profiler.profile``
imports ``torch._inductor``: about a second and 160 MiB of resident memory), and its cost is bounded
as the docs state it (``benchmarks/planning_cost.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from maml._src.planner import measure

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
CPU = torch.device("cpu")


def test_garbage_made_under_an_earlier_profile_and_freed_in_a_call_is_not_the_calls_saving():
    kept: list[torch.Tensor] = []
    measure(lambda: kept.append(torch.empty(8 * MiB, dtype=torch.uint8)), CPU)  # allocated under a profile

    def call() -> None:
        kept.clear()  # 8 MiB of earlier garbage freed during the call
        big = torch.empty(16 * MiB, dtype=torch.uint8)
        del big

    assert measure(call, CPU).peak == 16 * MiB


def test_garbage_made_under_the_users_profiler_and_freed_in_a_call_is_not_the_calls_saving():
    kept: list[torch.Tensor] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        kept.append(torch.empty(8 * MiB, dtype=torch.uint8))

    def call() -> None:
        kept.clear()
        big = torch.empty(16 * MiB, dtype=torch.uint8)
        del big

    assert measure(call, CPU).peak == 16 * MiB


def test_a_measurement_inside_the_users_profiler_leaves_it_running():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        measure(lambda: torch.empty(MiB, dtype=torch.uint8), CPU)
        torch.ones(3).sum()
    assert any(e.name == "aten::sum" for e in prof.events())


def test_a_measurement_counts_blocks_freed_and_allocated_again_in_the_call_once():
    def call() -> None:
        for _ in range(3):
            t = torch.empty(4 * MiB, dtype=torch.uint8)
            del t

    assert measure(call, CPU).peak == 4 * MiB


PLANNING = """
import json, sys
import torch
import torch.nn.functional as F
import maml
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).double()
g = torch.Generator().manual_seed(0)
draw = lambda n, d: torch.randn(4, n, d, generator=g, dtype=torch.float64)
batch = maml.TaskBatch(draw(5, 8), draw(5, 4), draw(5, 8), draw(5, 4))
learner = maml.MetaLearner(net, F.mse_loss, inner_lr=0.1, steps=2, memory_budget="8MiB")
learner.backward(batch)
json.dump({"planned": learner.plan is not None, "dynamo": "torch._dynamo" in sys.modules}, sys.stdout)
"""


def test_planning_imports_no_compiler():
    child = subprocess.run([sys.executable, "-c", PLANNING], cwd=REPO, check=True, capture_output=True, text=True)
    assert json.loads(child.stdout) == {"planned": True, "dynamo": False}


def test_planning_costs_at_most_the_documented_resident_memory_and_time(tmp_path):
    out = tmp_path / "cost.json"
    command = [sys.executable, "-m", "benchmarks.planning_cost", "--json", str(out), "--model", "wide_layer"]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    rows = {r["budgeted"]: r for r in json.loads(out.read_text())["rows"]}
    planned, plain = rows[True], rows[False]
    assert planned["first_rss_rise"] - plain["first_rss_rise"] <= 16 * MiB, rows  # the docs' bound
    assert planned["first_seconds"] - plain["first_seconds"] <= 6 * planned["later_seconds"] + 0.5, rows
