"""What planning a memory budget costs on the CPU: the first budgeted call's peak RSS and time against later calls'.

The planner measures a step with the profiler (``maml._src.planner.measure``): the cost of the
profiler itself, of its probes (at most two inner steps of one and two tasks, each within the
budget) and of ``"auto"``'s timing is paid by a learner's first ``backward`` on a configuration,
and by no later one. For each model, second order at three times the smallest budget the learner
accepts (``"auto"`` batching), and the same calls unplanned (``backward(batch, chunk=1)``, the
loop: one task a call, as every plan here runs), each in a fresh process: the rise of the
process's peak RSS (``VmHWM``) over the first call and over the later calls, and the calls' CPU
time, 1 thread. Planning's cost is the budgeted run's less the unplanned one's.

    python -m benchmarks.planning_cost --json results/benchmarks/planning_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "measure_one"]

MODELS = ("wide_layer", "wide_mlp", "conv_batchnorm", "gru", "many_steps")
LATER = 5  # later calls timed


def _hwm() -> int:
    """The process's peak resident memory, bytes (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_one(model: str, budgeted: bool) -> dict[str, Any]:
    """In this process: a new learner's first and later ``backward`` on ``model``'s batch, second order, within a
    budget (``budgeted``) or one task a call unplanned."""
    import torch
    import torch.nn.functional as F

    from benchmarks import budgets

    torch.set_num_threads(1)
    if model == "wide_layer":  # one hidden layer of 16,384 units, 6 tasks of 10 shots
        family = budgets.Family(budgets._mlp(8, 16384, 4), lambda: budgets._regression(6, 10, 8, 4), F.mse_loss, 2)
    else:
        family = budgets.FAMILIES[model]
    budget = 3 * budgets.smallest_budget(family, "second_order") if budgeted else None
    run = budgets.learner(family, "second_order", budget, batching="auto" if budgeted else "loop")
    batch = family.batch()
    call = (lambda: run.backward(batch)) if budgeted else (lambda: run.backward(batch, chunk=1))
    before = _hwm()
    start = time.thread_time()
    call()
    first = time.thread_time() - start
    after_first = _hwm()
    later = []
    for _ in range(LATER):
        run.model.zero_grad(set_to_none=True)
        start = time.thread_time()
        call()
        later.append(time.thread_time() - start)
    return {
        "model": model,
        "budgeted": budgeted,
        "budget": budget,
        "plan": str(run.plan) if run.plan is not None else None,
        "first_rss_rise": after_first - before,
        "later_rss_rise": _hwm() - after_first,
        "first_seconds": first,
        "later_seconds": statistics.median(later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--model", action="append", choices=MODELS, help="only these models (repeatable)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "BUDGETED"), help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    if args.one:
        json.dump(measure_one(args.one[0], args.one[1] == "1"), sys.stdout)
        return
    from benchmarks.report import write_report

    rows = []
    for model in args.model or MODELS:
        for budgeted in (True, False):  # each in a fresh process: the first call of the process is the one counted
            child = [
                sys.executable,
                "-m",
                "benchmarks.planning_cost",
                "--json",
                "-",
                "--one",
                model,
                str(int(budgeted)),
            ]
            row = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            rows.append(row)
            print(row, flush=True)
    write_report(args.json, "planning_cost", sys.argv[1:], "cpu", 1, later_calls=LATER, rows=rows)


if __name__ == "__main__":
    main()
