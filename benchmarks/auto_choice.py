"""Whether ``batching="auto"`` chooses alike in fresh processes, on an idle machine or beside a busy process.

Each run is a fresh Python process that builds a learner on higher's Omniglot net (``examples.higher_omniglot``:
3x3 convolutions with BatchNorm, ReLU and 2x2 max-pool, then a linear head; ``--filters`` channels), random
5-way 1-shot tasks of 28x28 images, and makes its first call, in which ``"auto"`` times vmap against the loop
(``maml._src.planner.time_batchings``) and keeps one. The run records what it chose and the two timings
``time_batchings`` returned. With ``--busy K``, one more process spins float32 matmuls on ``K`` threads beside
every run (two processes at a time in all), as another user's job would on a shared machine.

``--calls meta_loss`` makes the first call ``learner.meta_loss(batch).backward()``, which plans nothing: the loop
is taken only where it times ``LOOP_MARGIN`` times faster. ``--calls backward`` makes it ``learner.backward(batch)``,
whose memory plan prefers the loop: vmap only where it times that much faster.

    python -m benchmarks.auto_choice --runs 10 --busy 1 --json results/benchmarks/auto_choice.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The busy neighbour: float32 matmuls for ever, on its own thread count, until the parent ends it.
_BUSY = (
    "import sys, torch\ntorch.set_num_threads(int(sys.argv[1]))\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"
)


CALLS = ("meta_loss", "backward")


def network(filters: int, ways: int) -> nn.Sequential:
    """higher's Omniglot net (``examples.higher_omniglot.network``) with ``filters`` channels a convolution."""
    layers: list[nn.Module] = []
    for n_in in (1, filters, filters):
        norm = nn.BatchNorm2d(filters, momentum=1, affine=True, track_running_stats=False)
        layers += [nn.Conv2d(n_in, filters, 3), norm, nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(filters, ways))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process's first call: what ``"auto"`` chose and the timings it chose by."""
    import maml
    from maml._src import planner

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timed: list[dict[str, float]] = []
    time_batchings = planner.time_batchings

    def recorded(*a: Any, **k: Any) -> dict[str, float]:
        seconds = time_batchings(*a, **k)
        timed.append(seconds)
        return seconds

    planner.time_batchings = recorded  # type: ignore[assignment]  # choose_batching reads the module's name
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ways, shots, query = 5, 1, 1
    x = lambda n: torch.randn(args.tasks, ways * n, 1, 28, 28, generator=g)  # noqa: E731
    y = lambda n: torch.arange(ways).repeat_interleave(n).expand(args.tasks, -1).contiguous()  # noqa: E731
    batch = maml.TaskBatch(x(shots), y(shots), x(query), y(query))
    learner = maml.MetaLearner(network(args.filters, ways), F.cross_entropy, inner_lr=0.1, steps=args.steps)
    began = time.perf_counter()
    if args.call == "backward":
        learner.backward(batch)
    else:
        learner.meta_loss(batch).backward()
    return {
        "choice": learner.resolved_batching,
        "seconds": timed[0] if timed else None,
        "first_call_wall": time.perf_counter() - began,
        "threads": torch.get_num_threads(),
    }


def runs_of(call: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.runs`` fresh processes, one after another, whose first call is ``call``: their choices and timings."""
    forwarded = ["--call", call, "--tasks", str(args.tasks), "--filters", str(args.filters), "--steps", str(args.steps)]
    forwarded += [] if args.threads is None else ["--threads", str(args.threads)]
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        command = [sys.executable, "-m", "benchmarks.auto_choice", "--child", *forwarded]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        runs.append(run)
        s = run["seconds"] or {}
        ratio = s["loop"] / s["vmap"] if s else float("nan")
        print(
            f"{call} run {i}: {run['choice']:<4}  vmap {s.get('vmap', 0):.4f} s  loop {s.get('loop', 0):.4f} s  "
            f"loop/vmap {ratio:.2f}"
        )
    choices = dict(collections.Counter(run["choice"] for run in runs))
    ratios = [r["seconds"]["loop"] / r["seconds"]["vmap"] for r in runs if r["seconds"]]
    print(f"{call}: choices {choices}; loop/vmap from {min(ratios):.2f} to {max(ratios):.2f}" if ratios else choices)
    span = [min(ratios), max(ratios)] if ratios else None
    return {"call": call, "choices": choices, "loop_over_vmap": span, "runs": runs}


def report(args: argparse.Namespace, argv: list[str] | None, tables: list[dict[str, Any]], complete: bool) -> None:
    """Writes ``tables`` to ``args.json`` with the command, device, versions and commit."""
    from benchmarks.report import write_report
    from maml._src.planner import LOOP_MARGIN

    command = sys.argv[1:] if argv is None else argv
    threads = tables[0]["runs"][0]["threads"] if tables and tables[0]["runs"] else torch.get_num_threads()
    fields = {k: getattr(args, k) for k in ("runs", "busy", "tasks", "filters", "steps")}
    write_report(
        args.json,
        "auto_choice",
        command,
        "cpu",
        threads,
        complete=complete,
        **fields,
        loop_margin=LOOP_MARGIN,
        tables=tables,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="fresh processes (default: %(default)s)")
    parser.add_argument("--busy", type=int, default=1, help="threads of the busy process; 0: none (default: 1)")
    parser.add_argument("--threads", type=int, help="torch's threads in each run (default: torch's choice)")
    parser.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS), help="first calls, each --runs times")
    parser.add_argument("--call", choices=CALLS, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--filters", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1, help="inner steps (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the runs, with device, versions and commit, here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    busy = None
    if args.busy:
        busy = subprocess.Popen([sys.executable, "-c", _BUSY, str(args.busy)])
        time.sleep(1.0)  # let it load torch and start spinning before the first run
    tables: list[dict[str, Any]] = []
    try:
        for call in args.calls:
            tables.append(runs_of(call, args))
            if args.json is not None:
                report(args, argv, tables, complete=False)
    finally:
        if busy is not None:
            busy.terminate()
            busy.wait()
    if args.json is not None:
        report(args, argv, tables, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
