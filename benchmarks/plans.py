"""Does the plan a memory budget picks run as fast as the fastest plan that fits the budget?

    .venv/bin/python -m benchmarks.plans                                  # the committed table's run
    .venv/bin/python -m benchmarks.plans --budgets 150MiB 400MiB --steps 5 --json results/benchmarks/plans.json

For each mode that plans (second order, checkpointed) and each budget, on the MAML Omniglot
max-pool net (benchmarks.sampling.omniglot_net, 28x28, 8 tasks 5-way 5-shot, 15 query images a
class): the learner with ``memory_budget`` plans its step (``learner.plan``), then every other plan
the engine can run is tried by hand, second order as ``backward(batch, chunk=c)``
and the checkpointed mode as ``maml.Checkpointed(tasks=c)`` with segments of one step (``every=1``)
and of the length that holds least (the default with ``tasks``), for ``c`` in 1, 2, 4, 8, each
batched by ``vmap`` and in a loop. Each one's tensor peak (``benchmarks.tensor_peak``) decides
whether it fits a budget; each that fits the largest is timed once (the median CPU time of
``--repeats`` steps of one thread, after a warm-up step), and the planned step's time is set
against the fastest that fits its budget. The planned step's own peak is reported beside its budget.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import maml  # noqa: E402
from benchmarks.memory import INNER_LR, QUERY, SHOTS, TASKS, WAYS, synthetic_batch  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.sampling import omniglot_net  # noqa: E402
from benchmarks.tensor_peak import peak_tensor_bytes  # noqa: E402

MODES = ("second_order", "checkpointed")
CHUNKS = (1, 2, 4, 8)  # tasks at once: a backward chunk (second order) or a replayed chunk (checkpointed)


def learner(mode: str | maml.Mode, steps: int, batching: str = "auto", **options: Any) -> maml.MetaLearner:
    """A learner of ``mode`` on the Omniglot net, from seed 0 (every candidate starts from the same weights)."""
    torch.manual_seed(0)
    return maml.MetaLearner(
        omniglot_net(WAYS), F.cross_entropy, INNER_LR, steps, mode=mode, batching=batching, **options
    )


def seconds(step: Callable[[], object], repeats: int) -> float:
    """The median CPU time of ``repeats`` calls of ``step`` after one untimed call."""
    step()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def candidates(mode: str, steps: int, batch: maml.TaskBatch) -> list[tuple[str, Callable[[], object]]]:
    """The plans of ``mode`` tried by hand: a name and its training step."""
    out = []
    for batching in ("vmap", "loop"):
        if mode == "second_order":
            lrn = learner(mode, steps, batching)
            for chunk in CHUNKS:
                out.append(
                    (f"backward(chunk={chunk}), {batching}", lambda lrn=lrn, c=chunk: lrn.backward(batch, chunk=c))
                )
            continue
        for chunk in CHUNKS:
            for every in (1, None):
                lrn = learner(maml.Checkpointed(every=every, tasks=chunk), steps, batching)
                segments = "segments of 1 step" if every else "fewest fast weights"
                step = lambda lrn=lrn: lrn.meta_loss(batch).backward()  # noqa: E731
                out.append((f"tasks={chunk}, {segments}, {batching}", step))
    return out


def tried(mode: str, steps: int, batch: maml.TaskBatch, largest: int, repeats: int) -> list[dict[str, Any]]:
    """Every candidate's tensor peak, and the time of each whose peak is at most ``largest`` bytes."""
    out = []
    for name, candidate in candidates(mode, steps, batch):
        candidate()  # warm: kernels, and "auto" has nothing to choose here
        peak = peak_tensor_bytes(candidate)
        out.append(
            {"plan": name, "peak_bytes": peak, **({"seconds": seconds(candidate, repeats)} if peak <= largest else {})}
        )
        timed = f", {out[-1]['seconds']:.2f} s" if "seconds" in out[-1] else ", over every budget"
        print(f"  {mode}: {name}: {peak / 2**20:,.0f} MiB{timed}", file=sys.stderr)
    return out


def measure(mode: str, steps: int, budget: str, batch: maml.TaskBatch, repeats: int) -> dict[str, Any]:
    """The planned step: its plan, tensor peak and time."""
    planned = learner(mode, steps, memory_budget=budget)
    step = lambda: planned.backward(batch)  # noqa: E731
    step()  # plans (and times "auto") at its first call
    row: dict[str, Any] = {"mode": mode, "budget": budget, "plan": str(planned.plan)}
    row["budget_bytes"] = planned.plan.budget
    row["peak_mib"] = peak_tensor_bytes(step) / 2**20
    row["seconds"] = seconds(step, repeats)
    return row


def against(row: dict[str, Any], candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """``row`` with every candidate, whether it fits the row's budget, and the fastest that does."""
    fits = lambda t: t["peak_bytes"] <= row["budget_bytes"]  # noqa: E731
    row["tried"] = [
        {"plan": t["plan"], "peak_mib": t["peak_bytes"] / 2**20, "fits": fits(t), **({"seconds": t["seconds"]} if fits(t) else {})}
        for t in candidates
    ]  # fmt: skip
    fitting = [t for t in row["tried"] if t["fits"]]
    if fitting:
        best = min(fitting, key=lambda t: t["seconds"])
        row.update(fastest=best["plan"], fastest_seconds=best["seconds"], ratio=row["seconds"] / best["seconds"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["150MiB", "400MiB"], help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="inner steps (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per plan (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the results, with device, versions and commit, here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch = synthetic_batch(TASKS, torch.Generator().manual_seed(0), torch.device("cpu"))
    rows = []
    for mode in args.modes:
        planned = [measure(mode, args.steps, budget, batch, args.repeats) for budget in args.budgets]
        found = tried(mode, args.steps, batch, max(r["budget_bytes"] for r in planned), args.repeats)
        for r in planned:
            rows.append(against(r, found))
            print(
                f"{mode} {r['budget']}: planned {r['plan']}: {r['seconds']:.2f} s, {r['peak_mib']:,.0f} MiB; fastest that "
                f"fits: {r.get('fastest')} {r.get('fastest_seconds', float('nan')):.2f} s",
                file=sys.stderr,
            )
            if args.json is not None:
                write_report(args.json, "plans", sys.argv[1:] if argv is None else argv, "cpu", args.threads,
                             setting={"tasks": TASKS, "ways": WAYS, "shots": SHOTS, "query": QUERY, "steps": args.steps,
                                      "repeats": args.repeats}, rows=rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
