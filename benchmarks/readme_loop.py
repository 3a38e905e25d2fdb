"""The README's training loop, ``learner.backward(batch)``, against the peers' own per-task loops, on the three ports.

For each of ``examples/``'s ports of the peers' Omniglot MAML examples (learn2learn's, higher's, TorchOpt's:
their networks, inner steps, rates and meta-batches), one meta-gradient step from the same weights, by:

- the peer's loop as its example writes it, on its own network (``benchmarks.ports``: learn2learn's
  ``clone()``/``adapt()`` and a ``backward()`` per task, higher's ``innerloop_ctx`` and a ``backward()`` per task,
  TorchOpt's ``MetaSGD`` over every task, then one ``backward()`` of the mean: its example holds every task's graph);
- ``learner.backward(batch)`` as the README writes it (its plan within the machine's free memory);
- the same where the free memory is only what the peer's loop held: the engine reads the free memory through
  ``maml._src.planner.free_bytes``, which is set to the peer's measured tensor peak;
- ``learner.meta_loss(batch).backward()``, which holds every task's graph at once.

Each: the tensor peak of a step (``benchmarks.tensor_peak.peak_tensor_bytes``: the profiler's memory events, as
the memory tables count them), and the median CPU time of the calling thread over ``--repeats`` steps after a
warm-up step (the engine's first call, which measures and plans, is the warm-up), the methods interleaved. The
images are random (time and memory do not depend on the pixels). That the meta-gradients are the peers' is the
tests' to show, in float64 (``tests/tools/test_ports.py``): in float32, five inner steps on random images amplify rounding.

    python -m benchmarks.readme_loop --json results/benchmarks/readme_loop.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import maml
from benchmarks import ports
from benchmarks.report import write_report
from benchmarks.tensor_peak import peak_tensor_bytes
from maml._src import planner

METHODS = ("peer", "readme", "readme_peer_memory", "meta_loss")
Step = Callable[[], None]


def batch_of(ex: Any, tasks: int, seed: int) -> maml.TaskBatch:
    """``tasks`` random ``WAYS``-way tasks of 28x28 images, shaped as the port samples them."""
    g = torch.Generator().manual_seed(seed)

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(tasks, ex.WAYS * per_class, 1, 28, 28, generator=g)
        return x, torch.arange(ex.WAYS).repeat_interleave(per_class).expand(tasks, -1).contiguous()

    return maml.TaskBatch(*split(ex.SHOTS), *split(ex.QUERY))


def peer_step(name: str, net: nn.Module, batch: maml.TaskBatch) -> Step:
    """The peer example's meta-gradient of ``batch`` on its own network (``benchmarks.ports.peer_step``)."""
    step = ports.peer_step(name, net)
    return lambda: step(batch)


def engine_step(method: str, learner: maml.MetaLearner, batch: maml.TaskBatch) -> Step:
    if method == "meta_loss":
        return lambda: learner.meta_loss(batch).backward()
    return lambda: learner.backward(batch)


def cpu_seconds(step: Step, params: list[torch.Tensor]) -> float:
    for p in params:
        p.grad = None
    began = time.thread_time()
    step()
    return time.thread_time() - began


def run_port(name: str, tasks: int | None, repeats: int, seed: int) -> dict[str, Any]:
    ex = ports.PORTS[name]
    tasks = tasks or ex.TASKS
    batch = batch_of(ex, tasks, seed)
    torch.manual_seed(seed)
    weights = ex.network().state_dict()
    nets: dict[str, nn.Module] = {}
    steps: dict[str, Step] = {}
    peaks: dict[str, int] = {}
    plans: dict[str, str | None] = {}
    learners: dict[str, maml.MetaLearner] = {}
    free = planner.free_bytes
    peer_peak = 0
    try:
        for method in METHODS:  # built, warmed up (the engine plans), measured, in this order
            net = ex.network()
            net.load_state_dict(weights)
            if method == "peer":
                net = ports.peer_network(name, net)
            nets[method] = net
            if method == "readme_peer_memory":  # all the memory there is: what the peer's loop held
                planner.free_bytes = lambda device, peak=peer_peak: peak  # type: ignore[assignment]
            if method == "peer":
                steps[method] = peer_step(name, net, batch)
            else:
                learners[method] = ex.meta_learner(net)
                steps[method] = engine_step(method, learners[method], batch)
            params = list(net.parameters())
            cpu_seconds(steps[method], params)  # warm-up: the engine's first call measures and plans
            for p in params:
                p.grad = None
            peaks[method] = peak_tensor_bytes(steps[method])
            plan = learners[method].plan if method in learners else None
            plans[method] = None if plan is None else str(plan)
            if method == "peer":
                peer_peak = peaks[method]
            planner.free_bytes = free
        seconds: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(repeats):  # interleaved: a slower stretch of the machine falls on every method alike
            for method in METHODS:
                if method == "readme_peer_memory":
                    planner.free_bytes = lambda device, peak=peer_peak: peak  # type: ignore[assignment]
                seconds[method].append(cpu_seconds(steps[method], list(nets[method].parameters())))
                planner.free_bytes = free
    finally:
        planner.free_bytes = free
    rows = []
    for method in METHODS:
        cpu = statistics.median(seconds[method])
        rows.append({"method": method, "peak_bytes": peaks[method], "cpu": cpu, "plan": plans[method]})
        print(f"{name:<11} {method:<19} peak {peaks[method] / 2**20:8.1f} MiB  cpu {cpu:7.3f} s  {plans[method] or ''}")
    return {
        "port": name,
        "tasks": tasks,
        "steps": ex.STEPS,
        "ways": ex.WAYS,
        "shots": ex.SHOTS,
        "query": ex.QUERY,
        "repeats": repeats,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", nargs="+", choices=list(ports.PORTS), default=list(ports.PORTS))
    parser.add_argument("--tasks", type=int, help="tasks a meta-batch (default: each port's own, 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the table, with device, versions and commit, here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tables: list[dict[str, Any]] = []
    for name in args.ports:
        tables.append(run_port(name, args.tasks, args.repeats, args.seed))
        if args.json is not None:
            command = sys.argv[1:] if argv is None else argv
            write_report(args.json, "readme_loop", command, "cpu", args.threads, complete=False, tables=tables)
    if args.json is not None:
        command = sys.argv[1:] if argv is None else argv
        write_report(args.json, "readme_loop", command, "cpu", args.threads, complete=True, tables=tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
