"""What each inner optimizer costs: one meta-training step per rule of ``maml.INNER_OPTIMIZERS``, against SGD and higher.

    .venv/bin/python -m benchmarks.optimizers --json results/benchmarks/optimizers.json   # ~9 min on a busy 2-core CPU
    .venv/bin/python -m benchmarks.optimizers --workloads sine --optimizers sgd adam rprop --repeats 10

One meta-training step is ``learner.meta_loss(batch).backward()`` of a second-order
``maml.MetaLearner(..., inner_optimizer=NAME)`` (the gradients set to None before it, untimed), for
every rule of ``maml.INNER_OPTIMIZERS`` with ``torch.optim``'s default options (momentum: 0.9) and
the learning rate of :data:`LRS`. Beside each, where higher 0.2.1 has a differentiable version of
the same ``torch.optim`` optimizer (SGD, with and without momentum, Adam, RMSprop, Adagrad, Adadelta,
Adamax, Rprop, ASGD; not AdamW, NAdam or RAdam), the same step as ``benchmarks/speed.py``'s and
``benchmarks/memory.py``'s higher rows write it: ``higher.innerloop_ctx(model, torch.optim.X(...),
copy_initial_weights=False)`` per task, ``diffopt.step(support loss)`` for each inner step, then
``(query loss / tasks).backward()``. higher's Adam puts ``eps`` where torch.optim did before 1.x:
as in ``benchmarks/speed.py`` it is overridden at each step by ``eps * sqrt(1 - beta2^t)``, which
makes its update ``torch.optim.Adam``'s (and the engine's). higher backs up after each task, so it
holds one task's graph at a time; ``meta_loss(batch)`` holds every task's until its backward.

Workloads (``--workloads``):
    sine      the MAML sine MLP (1-40-40-1, ReLU), 25 tasks of ``tasks.Sine``, 10 support and
              10 query points, 5 inner steps (``benchmarks.speed``'s sine5)
    omniglot  the MAML Omniglot conv net (``benchmarks.sampling.omniglot_net``: 4 x (3x3 conv 64,
              batch norm, ReLU, 2x2 max-pool), linear), 4 tasks 5-way 1-shot with 15 query images
              a class, 5 inner steps; synthetic 28x28 images (``benchmarks.memory.synthetic_batch``:
              time and memory do not depend on the pixels)

The engine's batching (``--batching``, default ``auto``) is what ``batching="auto"`` picks for SGD on
the workload's first batch (as ``benchmarks/speed.py`` reports it: ``vmap`` for the sine MLP, a
``loop`` for the conv net on the CPU), fixed for every rule, so that a ratio to SGD is the rule's
cost and not another batching's.

Every method starts from the same weights and runs in this one process on ``--threads`` (1) thread.
Each computes its meta-gradient once from those weights on the first batch (the ``grad_diff``
column: the largest difference of the engine's from higher's, relative to higher's largest entry,
float32), then, after ``--warmup`` untimed steps, every repetition times every method once in a
fresh random order (``benchmarks/speed.py``'s interleaving: a change of the machine's load hits all
alike). Times are the median over ``--repeats`` steps of this process's CPU time (on a shared
machine the CPU time of one thread varies by a few percent where wall time swings several-fold;
``benchmarks/memory.py``'s argument) and of wall time, both kept. Then, in steps of their own,
untimed: the peak of live tensor bytes of one step, from the profiler's memory events
(``benchmarks.tensor_peak.peak_tensor_bytes``, the engine's own measure, as ``benchmarks/memory.py``
and ``benchmarks/plans.py`` report it), and the ATen operator calls of one step counted by a
dispatch mode (under ``vmap`` a batched operator counts once): on the sine MLP, whose step is bound
by per-operator overhead, the work a rule adds is mostly its operators.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make the repository's packages importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import maml  # noqa: E402
import tasks  # noqa: E402
from benchmarks.memory import relative_difference, synthetic_batch  # noqa: E402
from benchmarks.peers import higher_backward  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.sampling import omniglot_net, sine_net  # noqa: E402
from benchmarks.tensor_peak import peak_tensor_bytes  # noqa: E402

__all__ = ["HIGHER", "LRS", "OPTIONS", "WORKLOADS", "Workload", "main", "run_workload"]

LossFn = Callable[[Tensor, Tensor], Tensor]
# backward(batch) leaves the meta-gradient in .grad of the meta-parameters it was built with.
Backward = Callable[[maml.TaskBatch], None]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    net: Callable[[], nn.Module]
    sample: Callable[[int, torch.Generator], maml.TaskBatch]  # (tasks, generator) -> a meta-batch
    loss_fn: LossFn
    tasks: int
    steps: int
    repeats: int
    sgd_lr: float  # plain MAML's inner rate: SGD's and ASGD's


def _sine(tasks_: int, g: torch.Generator) -> maml.TaskBatch:
    return tasks.Sine().sample(tasks_, shots=10, query=10, generator=g)


WORKLOADS: dict[str, Workload] = {
    "sine": Workload("sine MLP, 10-shot, 10 query points", sine_net, _sine, F.mse_loss, 25, 5, 30, 0.01),
    "omniglot": Workload(
        "Omniglot conv net, 5-way 1-shot, 15 query images a class, synthetic images",
        lambda: omniglot_net(5),
        lambda t, g: synthetic_batch(t, g, torch.device("cpu"), shots=1),
        F.cross_entropy,
        4,
        5,
        5,
        0.4,
    ),
}

# Each rule's inner learning rate: plain MAML's for SGD and ASGD, torch.optim's scale for the adaptive
# rules (Adadelta's default, 1.0, multiplies a step that is already a rate), Rprop's initial step size.
LRS: dict[str, float | None] = {
    "sgd": None,  # None: the workload's sgd_lr
    "asgd": None,
    "momentum": 0.01,
    "adam": 0.01,
    "adamw": 0.01,
    "rmsprop": 0.01,
    "adagrad": 0.01,
    "adadelta": 1.0,
    "adamax": 0.01,
    "nadam": 0.01,
    "radam": 0.01,
    "rprop": 0.01,
}
OPTIONS: dict[str, dict[str, Any]] = {"momentum": {"momentum": 0.9}}  # the rest: torch.optim's defaults
# higher 0.2.1's differentiable optimizers, by the torch.optim class it maps (by exact type: not AdamW).
HIGHER: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "momentum": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax,
    "rprop": torch.optim.Rprop,
    "asgd": torch.optim.ASGD,
}


def lr_of(name: str, wl: Workload) -> float:
    lr = LRS[name]
    return wl.sgd_lr if lr is None else lr


# ---------------------------------------------------------------------------- the methods


def ours(name: str, wl: Workload, model: nn.Module, batching: str = "auto") -> tuple[list[Tensor], Backward]:
    """The engine, second order, with the rule ``name``: its meta-parameters and its step."""
    learner = maml.MetaLearner(
        model,
        wl.loss_fn,
        lr_of(name, wl),
        wl.steps,
        mode="second_order",
        batching=batching,
        inner_optimizer=name,
        inner_optimizer_options=OPTIONS.get(name),
    )
    return list(learner.parameters()), lambda batch: learner.meta_loss(batch).backward()


def higher_innerloop(name: str, wl: Workload, model: nn.Module) -> tuple[list[Tensor], Backward]:
    """higher's ``innerloop_ctx`` with ``torch.optim``'s optimizer of the rule ``name``, as ``benchmarks/speed.py``'s
    ``higher_innerloop`` writes it (Adam's ``eps`` overridden at each step so that its update is torch.optim's)."""
    inner_opt = HIGHER[name](model.parameters(), lr=lr_of(name, wl), **OPTIONS.get(name, {}))
    higher_step = higher_backward(model, inner_opt, wl.loss_fn, wl.steps, adam=name == "adam")

    def backward(batch: maml.TaskBatch) -> None:
        with warnings.catch_warnings():  # higher warns about its RMSprop's and Rprop's second derivatives when built
            warnings.simplefilter("ignore")
            higher_step(batch)

    return list(model.parameters()), backward


# ---------------------------------------------------------------------------- measuring


class _Ops(TorchDispatchMode):
    """Counts the ATen operators called below autograd (a ``vmap``'d operator once, as its batched kernel runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def operator_calls(fn: Callable[[], object]) -> int:
    with _Ops() as ops:
        fn()
    return ops.count


def resolved_batching(wl: Workload, batch: maml.TaskBatch) -> str:
    """What ``batching="auto"`` picks for SGD on ``batch`` (it times both on its first call)."""
    torch.manual_seed(0)
    probe = maml.MetaLearner(wl.net(), wl.loss_fn, wl.sgd_lr, wl.steps)
    probe.meta_loss(batch)
    return str(probe.resolved_batching)


def run_workload(
    wl: Workload, names: list[str], batching: str, repeats: int, warmup: int
) -> tuple[str, list[dict[str, Any]]]:
    """Every rule's step and its higher peer's, interleaved; the batching run and a row per rule."""
    batches = [wl.sample(wl.tasks, torch.Generator().manual_seed(i)) for i in range(warmup + repeats)]
    if batching == "auto":
        batching = resolved_batching(wl, batches[0])
    torch.manual_seed(0)
    base = wl.net()
    first = batches[0]
    fields = (first.support_x, first.support_y, first.query_x, first.query_y)
    exact = maml.TaskBatch(*(t.double() if t.is_floating_point() else t for t in fields))
    steps: dict[tuple[str, str], tuple[list[Tensor], Backward]] = {}
    grads: dict[tuple[str, str], list[Tensor]] = {}
    for name in names:
        for method in ("ours", "higher") if name in HIGHER else ("ours",):
            build = functools.partial(ours, batching=batching) if method == "ours" else higher_innerloop
            # The agreement column: the meta-gradient from the shared weights, in float64 (in float32 a rule that
            # divides by |g| + eps, Adam's kind, amplifies the rounding of small gradients by up to 1 / eps).
            params, backward = build(name, wl, copy.deepcopy(base).double())
            backward(exact)
            grads[name, method] = [p.grad.detach().clone() for p in params]
            steps[name, method] = build(name, wl, copy.deepcopy(base))

    def run(key: tuple[str, str], batch: maml.TaskBatch) -> Callable[[], None]:
        params, backward = steps[key]
        for p in params:
            p.grad = None
        return lambda: backward(batch)

    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    wall: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    order = random.Random(0)
    for i, batch in enumerate(batches):
        for key in order.sample(list(steps), len(steps)):
            step = run(key, batch)
            c, w = time.process_time(), time.perf_counter()
            step()
            c, w = time.process_time() - c, time.perf_counter() - w
            if i >= warmup:
                cpu[key].append(c)
                wall[key].append(w)
        print(f"  {wl.name}: repetition {i + 1} of {len(batches)}", file=sys.stderr, flush=True)

    stats: dict[tuple[str, str], dict[str, Any]] = {}
    for key in steps:
        peak = peak_tensor_bytes(run(key, batches[0]))
        ops = operator_calls(run(key, batches[0]))
        stats[key] = {
            "cpu": statistics.median(cpu[key]),
            "cpu_min": min(cpu[key]),
            "cpu_max": max(cpu[key]),
            "wall": statistics.median(wall[key]),
            "peak_bytes": peak,
            "ops": ops,
        }
    rows = []
    for name in names:
        mine, peer = stats[name, "ours"], stats.get((name, "higher"))
        sgd, sgd_peer = stats.get(("sgd", "ours")), stats.get(("sgd", "higher"))
        rows.append(
            {
                "optimizer": name,
                "lr": lr_of(name, wl),
                "options": OPTIONS.get(name, {}),
                "ours": mine,
                "higher": peer,
                "vs_sgd": mine["cpu"] / sgd["cpu"] if sgd else None,
                "ops_vs_sgd": mine["ops"] / sgd["ops"] if sgd else None,
                "vs_higher": mine["cpu"] / peer["cpu"] if peer else None,
                "higher_vs_sgd": peer["cpu"] / sgd_peer["cpu"] if peer and sgd_peer else None,
                "grad_diff": relative_difference(grads[name, "ours"], grads[name, "higher"]) if peer else None,
            }
        )
    return batching, rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(
        f"| {'optimizer':<9} | {'CPU ms':>9} | {'x SGD':>6} | {'peak MiB':>8} | {'ops':>7} "
        f"| {'higher ms':>9} | {'/ higher':>8} | {'higher MiB':>10} | {'grad diff':>9} |"
    )
    for r in rows:
        o, h = r["ours"], r["higher"]
        print(
            f"| {r['optimizer']:<9} | {1e3 * o['cpu']:>9.2f} | {r['vs_sgd'] or math.nan:>5.2f}x "
            f"| {o['peak_bytes'] / 2**20:>8.1f} | {o['ops']:>7} "
            f"| {1e3 * h['cpu'] if h else math.nan:>9.2f} | {r['vs_higher'] or math.nan:>7.2f}x "
            f"| {h['peak_bytes'] / 2**20 if h else math.nan:>10.1f} | {r['grad_diff'] or math.nan:>9.1e} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=maml.INNER_OPTIMIZERS,
        default=list(maml.INNER_OPTIMIZERS),
        help="the rules to time (default: all); sgd, the baseline of the ratios, is always among them",
    )
    parser.add_argument("--batching", choices=("auto", "vmap", "loop"), default="auto", help="(default: auto)")
    parser.add_argument("--steps", type=int, help="inner steps of every workload (default: its own, 5)")
    parser.add_argument("--tasks", type=int, help="tasks of every meta-batch (default: 25 sine, 4 Omniglot)")
    parser.add_argument("--repeats", type=int, help="timed steps per method (default: 30 sine, 5 Omniglot)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per method first (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the tables, with device, versions and commit, here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["sgd", *(n for n in maml.INNER_OPTIMIZERS if n in args.optimizers and n != "sgd")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU; second order, meta_loss().backward()")
    tables: list[dict[str, Any]] = []

    def save(complete: bool) -> None:
        """Writes --json after every workload (a stopped run keeps what it measured), then whole."""
        if args.json is not None:
            command = sys.argv[1:] if argv is None else argv
            write_report(args.json, "optimizers", command, "cpu", args.threads, complete=complete, tables=tables)

    for key in args.workloads:
        wl = WORKLOADS[key]
        wl = dataclasses.replace(
            wl,
            steps=args.steps or wl.steps,
            tasks=args.tasks or wl.tasks,
            repeats=args.repeats or wl.repeats,
        )
        batching, rows = run_workload(wl, names, args.batching, wl.repeats, args.warmup)
        tables.append(
            {
                "workload": key,
                "name": wl.name,
                "tasks": wl.tasks,
                "steps": wl.steps,
                "batching": batching,
                "batching_asked": args.batching,
                "repeats": wl.repeats,
                "warmup": args.warmup,
                "rows": rows,
            }
        )
        print_table(
            f"{key}: {wl.name}, {wl.tasks} tasks, {wl.steps} inner steps; batching {batching!r}; "
            f"median CPU time of {wl.repeats} steps",
            rows,
        )
        save(complete=False)
    save(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
