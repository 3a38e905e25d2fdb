"""How fast is one meta-training step, against learn2learn, higher and a plain loop? Prints tables.

    .venv/bin/python -m benchmarks.speed                       # every workload on the CPU (~10 min, 2 cores)
    .venv/bin/python -m benchmarks.speed --workloads sine1 sine5 --repeats 50
    .venv/bin/python -m benchmarks.speed --device cuda         # CUDA events instead of wall clocks
    .venv/bin/python -m benchmarks.speed --tables family       # only the MAML-family table
    .venv/bin/python -m benchmarks.speed --tables hvp --workloads omniglot5-1shot omniglot5-5shot --steps 1 5 10 20 40

One meta-training step is: zero the gradients, the meta-loss over the meta-batch, its backward
pass, and an Adam step (the fused kernel, the same for every method). Timed for this engine
(every mode and batching, ``batching="auto"`` (the engine's own choice), ``compile=True``, and on
the conv net a model in ``channels_last`` memory format), learn2learn's ``MAML`` (second and first
order; and with a channels_last model), higher's ``innerloop_ctx`` with SGD, and a plain per-task
loop over ``torch.func.functional_call`` with ``torch.autograd.grad(create_graph=True)``. All
start from the same weights, run in this one process and are interleaved: every repetition times
every method once (in a random order), after warm-up (which includes a compiled method's one-off
compilation), so a change in machine load hits all of them alike. Each table gives the median and
the spread (fastest..slowest repetition), the speed-up over learn2learn (second order; first-order
methods against learn2learn's first order), the floating-point operations of a step counted with
``torch.utils.flop_counter.FlopCounterMode`` (for a compiled method, those of the eager method
doing the same math) over the median time, against the machine's measured peak for a large
float32 matrix product, and the largest relative difference of the meta-gradient from
learn2learn's, computed from the same weights before timing. The FLOPs are counted once whatever
the batching (``benchmarks/flops.py``): ``FlopCounterMode`` counts the weight gradient of a grouped
convolution, which is what ``vmap`` makes of the tasks' convolutions, once per group, so a vmap
row used to count its convolutions' weight gradients once per task.

A second table per workload (``--tables main family``, default both; each timed in a run of its own)
has the MAML family, second order with ``batching="auto"``, each engine row above a peer that
computes the same meta-gradient, and its speed-up and gradient difference taken against that peer:
ANIL (``adapt`` = the last layer) against learn2learn's ``MAML`` on the head over body features
computed outside the inner loop, Meta-SGD (``learn_inner_lr="per_parameter"``) against learn2learn's
``MetaSGD``, MAML++'s LSLR (``learn_inner_lr="per_layer_per_step"``) against the plain loop with
per-step rates, and momentum (0.9) and Adam inner loops (``inner_optimizer``) against higher's
``innerloop_ctx`` with ``torch.optim.SGD(momentum=0.9)`` and ``torch.optim.Adam``. In float32
Adam's difference is larger than the others' (its step divides by ``|g|``, which amplifies
rounding in small gradients); in float64 it agrees with higher's like the rest.

A third table, only on request (``--tables hvp``), sets the checkpointed mode's two backward
passes (``checkpoint_hvp``) side by side: second order, checkpointed with reverse-over-reverse
Hessian-vector products (the default), checkpointed with forward-over-reverse ones, first order
(all ``batching="auto"``, which times vmap and the loop on the first batch),
learn2learn's ``MAML`` (second and first order) and higher; speed-ups and gradient differences as in
the main table. Meant for the 8-task Omniglot workloads at ``--steps 1 5 10 20 40`` (issue 14).

Workloads, on the real task distributions (Omniglot: --data, else $OMNIGLOT_DIR):
    sine1, sine5     the 1-40-40-1 ReLU MLP, meta-batch 25, 10 support and 10 query points, 1 / 5 inner steps
    omniglot5        the MAML conv net (4 x 64 3x3 filters, BatchNorm, ReLU, max-pool), 5-way 1-shot,
                     15 query per class, meta-batch 32, 1 inner step (lr 0.4)
    omniglot20       20-way 1-shot, 15 query per class, meta-batch 16, 5 inner steps (lr 0.1)
    omniglot5-reference  the reference's strided net (experiments.omniglot's default), 5-way 1-shot, 1 query
                     per class, meta-batch 32, 1 inner step (lr 0.4 on its summed loss)
    omniglot20-reference  the same net, 20-way 1-shot, 1 query per class, meta-batch 16, 5 inner steps
                     (lr 0.1 on its summed loss): the reference's 20-way settings
    omniglot5-1shot  the max-pool conv net, 5-way 1-shot, 15 query per class, meta-batch 8, 1 inner step (lr 0.4)
    omniglot5-5shot  5-way 5-shot, otherwise the same (the workload of benchmarks/memory.py)
--steps N [N ...] runs every chosen workload at each of these numbers of inner steps instead of its own.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import random
import re
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
from torch.func import functional_call  # noqa: E402

import maml  # noqa: E402
import tasks  # noqa: E402
from benchmarks.flops import count_flops  # noqa: E402
from benchmarks.memory import relative_difference  # noqa: E402
from benchmarks.peers import higher_backward  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.sampling import omniglot_net, sine_net  # noqa: E402
from experiments.nets import build_model as reference_net  # noqa: E402  # the default: strided
from experiments.nets import loss_function  # noqa: E402

with warnings.catch_warnings():  # gym, imported by learn2learn, warns about its own deprecation
    warnings.simplefilter("ignore")
    import learn2learn as l2l

LossFn = Callable[[Tensor, Tensor], Tensor]
# backward(batch) leaves the meta-gradient in .grad of the meta-parameters it was built with.
Backward = Callable[[maml.TaskBatch], None]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    net: Callable[[], nn.Module]
    sample: Callable[[torch.Generator], maml.TaskBatch]
    loss_fn: LossFn
    inner_lr: float
    steps: int


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    first_order: bool
    # build(model, workload) -> (meta-parameters, backward)
    build: Callable[[nn.Module, Workload], tuple[list[Tensor], Backward]]
    # The model in channels_last memory format (conv workloads only).
    channels_last: bool = False
    # Counted by (the FlopCounterMode cannot see inside a compiled graph): the eager method doing the same math.
    flops_of: Method | None = None
    # The method this row's speed-up and gradient difference are taken against (default: REFERENCE).
    reference: str | None = None


def workloads(data: Path, device: torch.device) -> dict[str, Workload]:
    sine = tasks.Sine()

    def sine_batch(g: torch.Generator) -> maml.TaskBatch:
        return sine.sample(25, shots=10, query=10, generator=g, device=device)

    omniglot_images = functools.cache(lambda: tasks.Omniglot(data))  # loaded once, for every Omniglot workload

    def omniglot(
        ways: int, meta_batch: int, shots: int = 1, query: int = 15
    ) -> Callable[[torch.Generator], maml.TaskBatch]:
        sampler = omniglot_images().sampler(ways=ways, shots=shots, query=query)
        return lambda g: sampler.sample(meta_batch, g, device=device)

    return {
        "sine1": Workload("sine MLP, 25 tasks, 10-shot, 1 step", sine_net, sine_batch, F.mse_loss, 0.01, 1),
        "sine5": Workload("sine MLP, 25 tasks, 10-shot, 5 steps", sine_net, sine_batch, F.mse_loss, 0.01, 5),
        "omniglot5": Workload(
            "Omniglot conv net, 32 tasks, 5-way 1-shot, 1 step",
            lambda: omniglot_net(5),
            omniglot(5, 32),
            F.cross_entropy,
            0.4,
            1,
        ),
        "omniglot20": Workload(
            "Omniglot conv net, 16 tasks, 20-way 1-shot, 5 steps",
            lambda: omniglot_net(20),
            omniglot(20, 16),
            F.cross_entropy,
            0.1,
            5,
        ),
        "omniglot5-reference": Workload(
            "Omniglot strided net (the reference's), 32 tasks, 5-way 1-shot, 1 query per class, 1 step",
            lambda: reference_net(5),
            omniglot(5, 32, query=1),
            loss_function("reference", 5),
            0.4,
            1,
        ),
        "omniglot20-reference": Workload(
            "Omniglot strided net (the reference's), 16 tasks, 20-way 1-shot, 1 query per class, 5 steps",
            lambda: reference_net(20),
            omniglot(20, 16, query=1),
            loss_function("reference", 20),
            0.1,
            5,
        ),
        "omniglot5-1shot": Workload(
            "Omniglot conv net, 8 tasks, 5-way 1-shot, 1 step",
            lambda: omniglot_net(5),
            omniglot(5, 8),
            F.cross_entropy,
            0.4,
            1,
        ),
        "omniglot5-5shot": Workload(
            "Omniglot conv net, 8 tasks, 5-way 5-shot, 1 step",
            lambda: omniglot_net(5),
            omniglot(5, 8, shots=5),
            F.cross_entropy,
            0.4,
            1,
        ),
    }


def with_steps(wl: Workload, steps: int) -> Workload:
    """The workload with ``steps`` inner steps (and its name saying so)."""
    name = re.sub(r"\d+ steps?$", f"{steps} step" + "s" * (steps != 1), wl.name)
    return dataclasses.replace(wl, name=name, steps=steps)


# ---------------------------------------------------------------------------- the methods


def engine(
    mode: str | maml.Mode,
    batching: str,
    *,
    compile: bool = False,
    channels_last: bool = False,
    name: str | None = None,
    anil: bool = False,
    **options: Any,
) -> Method:
    """This engine; ``anil``: adapt only the head; ``options``: more MetaLearner arguments (the family rows)."""
    spec = maml.Mode.of(mode)

    def build(model: nn.Module, wl: Workload) -> tuple[list[Tensor], Backward]:
        learner = maml.MetaLearner(
            model,
            wl.loss_fn,
            inner_lr=wl.inner_lr,
            steps=wl.steps,
            mode=mode,
            batching=batching,
            compile=compile,
            adapt=head(model) if anil else None,
            **options,
        )
        return list(learner.parameters()), lambda batch: learner.meta_loss(batch).backward()

    if name is None:
        name = f"maml {spec.name} {batching}" + " compiled" * compile + " channels_last" * channels_last
        if "hvp" in spec.options():
            name += f" {spec.options()['hvp']}"
    return Method(name, spec.name == "first_order", build, channels_last, engine(mode, batching) if compile else None)


def head(model: nn.Module) -> list[str]:
    """ANIL's head: the parameters of the network's last layer (both nets are an nn.Sequential ending in nn.Linear)."""
    last = str(len(model) - 1)
    return [name for name, _ in model.named_parameters() if name.split(".")[0] == last]


def learn2learn(first_order: bool, channels_last: bool = False, meta_sgd: bool = False) -> Method:
    """learn2learn's ``MAML``, or ``MetaSGD`` (a learnable rate per parameter entry, starting at the inner lr)."""

    def build(model: nn.Module, wl: Workload) -> tuple[list[Tensor], Backward]:
        algorithm = l2l.algorithms.MetaSGD if meta_sgd else l2l.algorithms.MAML
        meta = algorithm(model, lr=wl.inner_lr, first_order=first_order)

        def backward(batch: maml.TaskBatch) -> None:
            for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
                learner = meta.clone()
                for _ in range(wl.steps):
                    learner.adapt(wl.loss_fn(learner(sx), sy))
                (wl.loss_fn(learner(qx), qy) / batch.num_tasks).backward()

        return list(meta.parameters()), backward

    name = "learn2learn " + ("MetaSGD" if meta_sgd else "MAML") + (" first-order" if first_order else "")
    return Method(name + (" channels_last" if channels_last else ""), first_order, build, channels_last)


def learn2learn_anil() -> Method:
    """ANIL as learn2learn users write it: ``MAML`` on the head alone, on features the body computes
    outside the inner loop (once per task, with its graph: the body's meta-gradient is exact)."""

    def build(model: nn.Module, wl: Workload) -> tuple[list[Tensor], Backward]:
        body, meta = model[:-1], l2l.algorithms.MAML(model[-1], lr=wl.inner_lr)

        def backward(batch: maml.TaskBatch) -> None:
            for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
                support, query, learner = body(sx), body(qx), meta.clone()
                for _ in range(wl.steps):
                    learner.adapt(wl.loss_fn(learner(support), sy))
                (wl.loss_fn(learner(query), qy) / batch.num_tasks).backward()

        return list(model.parameters()), backward

    return Method("learn2learn ANIL", False, build)


def higher_innerloop(rule: str = "sgd") -> Method:
    """higher's ``innerloop_ctx`` with ``torch.optim.SGD``, ``SGD(momentum=0.9)`` or ``Adam``. higher's Adam
    divides by ``sqrt(v) + eps`` and scales the step by ``sqrt(1 - beta2^t)``, torch's (and the engine's) by
    ``sqrt(v) / sqrt(1 - beta2^t) + eps``: the same update once eps is overridden by ``eps * sqrt(1 - beta2^t)``."""

    def build(model: nn.Module, wl: Workload) -> tuple[list[Tensor], Backward]:
        if rule == "adam":
            inner_opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=wl.inner_lr)
        else:
            inner_opt = torch.optim.SGD(model.parameters(), lr=wl.inner_lr, momentum=0.9 if rule == "momentum" else 0)
        return list(model.parameters()), higher_backward(model, inner_opt, wl.loss_fn, wl.steps, adam=rule == "adam")

    names = {"sgd": "higher innerloop_ctx", "momentum": "higher SGD momentum 0.9", "adam": "higher Adam"}
    return Method(names[rule], False, build)


def plain_loop(lslr: bool = False) -> Method:
    """What one writes by hand: a per-task loop, functional_call and autograd.grad(create_graph=True);
    ``lslr``: MAML++'s learnable rates, one per parameter tensor and inner step, starting at the inner lr."""

    def build(model: nn.Module, wl: Workload) -> tuple[list[Tensor], Backward]:
        rates = {k: v.new_full((wl.steps,), wl.inner_lr).requires_grad_() for k, v in model.named_parameters() if lslr}

        def backward(batch: maml.TaskBatch) -> None:
            params = dict(model.named_parameters())
            for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
                fast = params
                for s in range(wl.steps):
                    loss = wl.loss_fn(functional_call(model, fast, (sx,)), sy)
                    grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                    fast = {k: v - (rates[k][s] if lslr else wl.inner_lr) * g for (k, v), g in zip(fast.items(), grads)}
                (wl.loss_fn(functional_call(model, fast, (qx,)), qy) / batch.num_tasks).backward()

        return [*model.parameters(), *rates.values()], backward

    return Method("plain loop LSLR" if lslr else "plain loop, autograd.grad", False, build)


METHODS: list[Method] = [
    *(engine(mode, batching) for mode in maml.MODES for batching in ("auto", "vmap", "loop")),
    engine("second_order", "auto", compile=True),
    engine("first_order", "auto", compile=True),
    engine("second_order", "auto", channels_last=True),
    engine("first_order", "auto", channels_last=True),
    learn2learn(first_order=False),
    learn2learn(first_order=True),
    learn2learn(first_order=False, channels_last=True),
    higher_innerloop(),
    plain_loop(),
]
REFERENCE = {False: "learn2learn MAML", True: "learn2learn MAML first-order"}


def pair(method: Method, peer: Method) -> list[Method]:
    """A family row and its peer, both measured against the peer."""
    return [dataclasses.replace(m, reference=peer.name) for m in (method, peer)]


def family(name: str, **options: Any) -> Method:
    return engine("second_order", "auto", name=name, **options)


# The MAML family (second order, batching "auto"), each beside a peer computing the same meta-gradient.
FAMILY: list[Method] = [
    *pair(family("maml ANIL", anil=True), learn2learn_anil()),
    *pair(family("maml Meta-SGD", learn_inner_lr="per_parameter"), learn2learn(first_order=False, meta_sgd=True)),
    *pair(family("maml LSLR", learn_inner_lr="per_layer_per_step"), plain_loop(lslr=True)),
    *pair(
        family("maml momentum 0.9", inner_optimizer="momentum", inner_optimizer_options={"momentum": 0.9}),
        higher_innerloop("momentum"),
    ),
    *pair(family("maml Adam", inner_optimizer="adam"), higher_innerloop("adam")),
]

# The checkpointed mode's two backward passes (Checkpointed.hvp) beside second order, first order and the peers.
HVP: list[Method] = [
    engine("second_order", "auto"),
    engine("checkpointed", "auto"),  # hvp="reverse_over_reverse", the default
    engine(maml.Checkpointed(hvp="forward_over_reverse"), "auto"),
    engine("first_order", "auto"),
    learn2learn(first_order=False),
    learn2learn(first_order=True),
    higher_innerloop(),
]
TABLES = {"main": METHODS, "family": FAMILY, "hvp": HVP}
DEFAULT_TABLES = ["main", "family"]


# ---------------------------------------------------------------------------- measuring


class Clock:
    """Wall time on the CPU; CUDA events (no host-side stall between marks) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], None]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3


def peak_flops(device: torch.device, clock: Clock, n: int = 4096) -> float:
    """The machine's float32 matrix-product rate (FLOP/s): the best of a few n x n products."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    return 2 * n**3 / min(clock.time(lambda: a @ b) for _ in range(5))


def run_workload(
    wl: Workload, methods: list[Method], device: torch.device, repeats: int, warmup: int, clock: Clock, peak: float
) -> list[dict[str, object]]:
    torch.manual_seed(0)
    base = wl.net().to(device)
    batches = [wl.sample(torch.Generator().manual_seed(i)) for i in range(warmup + repeats)]

    steps: dict[str, Callable[[maml.TaskBatch], None]] = {}
    grads: dict[str, list[Tensor]] = {}
    flops: dict[str, int] = {}
    convs = any(isinstance(m, nn.Conv2d) for m in base.modules())
    methods = [m for m in methods if convs or not m.channels_last]
    for method in methods:
        model = copy.deepcopy(base)
        if method.channels_last:
            model = model.to(memory_format=torch.channels_last)
        params, backward = method.build(model, wl)
        # The meta-gradient from the shared initial weights, for the agreement column.
        backward(batches[0])
        grads[method.name] = [p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        counted = backward if method.flops_of is None else method.flops_of.build(copy.deepcopy(base), wl)[1]
        flops[method.name] = count_flops(lambda: counted(batches[0]))  # noqa: B023 (called at once)
        for p in params:
            p.grad = None
        # The same optimizer for every method: Adam with its fused kernel (one call for all parameters).
        optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)

        def step(
            batch: maml.TaskBatch, backward: Backward = backward, optimizer: torch.optim.Optimizer = optimizer
        ) -> None:
            optimizer.zero_grad(set_to_none=True)
            backward(batch)
            optimizer.step()

        steps[method.name] = step

    times: dict[str, list[float]] = {m.name: [] for m in methods}
    order = random.Random(0)
    for i, batch in enumerate(batches):
        # Interleaved: every repetition times every method once, in a fresh random order, so that
        # no method always follows the same one (whose garbage it would free, whose cache lines it
        # would find). A rotation would not do: it keeps the cyclic order, hence every predecessor.
        for method in order.sample(methods, len(methods)):
            seconds = clock.time(lambda: steps[method.name](batch))  # noqa: B023 (called at once)
            if i >= warmup:
                times[method.name].append(seconds)

    rows = []
    for method in methods:
        median = statistics.median(times[method.name])
        ref = method.reference or REFERENCE[method.first_order]
        rows.append(
            {
                "method": method.name,
                "median": median,
                "min": min(times[method.name]),
                "max": max(times[method.name]),
                "speedup": statistics.median(times[ref]) / median if ref in times else float("nan"),
                "gflops": flops[method.name] / 1e9,
                "rate": flops[method.name] / median,
                "peak_fraction": flops[method.name] / median / peak,
                "grad_diff": relative_difference(grads[method.name], grads[ref]) if ref in grads else float("nan"),
            }
        )
    return rows


def print_table(title: str, rows: list[dict[str, object]], repeats: int, versus: str = "vs learn2learn") -> None:
    print(f"\n{title}  (median of {repeats}; spread = fastest..slowest)")
    head = (
        f"| {'method':<28} | {'median':>10} | {'spread':>19} | {versus:>14} | {'GFLOP':>7} "
        f"| {'GFLOP/s':>7} | {'% of peak':>9} | {'grad rel. diff':>14} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['method']:<28} | {fmt_time(r['median']):>10} | "
            f"{fmt_time(r['min']) + '..' + fmt_time(r['max']).strip():>19} | {r['speedup']:>13.2f}x | "
            f"{r['gflops']:>7.2f} | {r['rate'] / 1e9:>7.1f} | {100 * r['peak_fraction']:>8.1f}% | "
            f"{r['grad_diff']:>14.1e} |"
        )


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=os.environ.get("OMNIGLOT_DIR"), help="Omniglot archives or folders (default: $OMNIGLOT_DIR)"
    )
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    parser.add_argument("--workloads", nargs="+", default=["sine1", "sine5", "omniglot5", "omniglot20"])
    parser.add_argument("--methods", nargs="+", help="substrings of method names to keep (default: all)")
    parser.add_argument(
        "--tables",
        nargs="+",
        choices=list(TABLES),
        default=DEFAULT_TABLES,
        help="main: MAML against learn2learn, higher, a plain loop; family: ANIL, Meta-SGD, "
        "LSLR, momentum, Adam against their peers; hvp: the checkpointed mode's "
        "checkpoint_hvp choices against second and first order, learn2learn, higher "
        "(default: main family)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        help="inner steps: run every workload at each of these (default: the workload's own)",
    )
    parser.add_argument("--repeats", type=int, help="timed steps per method (default: 30 for sine, 5 for Omniglot)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per method first (default: %(default)s)")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the tables, with device, versions and commit, here"
    )
    args = parser.parse_args(argv)
    if args.data is None and any(k.startswith("omniglot") for k in args.workloads):
        print("--data: no Omniglot folder given and $OMNIGLOT_DIR is unset; pass --data PATH", file=sys.stderr)
        return 2
    tables: list[dict[str, object]] = []

    device = torch.device(args.device)
    clock = Clock(device)
    peak = peak_flops(device, clock)
    threads = torch.get_num_threads()
    print(
        f"device: {device}, torch {torch.__version__}, {threads} CPU threads, "
        f"measured float32 matmul peak {peak / 1e9:.0f} GFLOP/s"
    )

    def save(complete: bool) -> None:
        """Writes --json after every table (a stopped run keeps what it measured), then whole."""
        if args.json is not None:
            command = sys.argv[1:] if argv is None else argv
            write_report(
                args.json, "speed", command, device, threads, peak_gflops=peak / 1e9, complete=complete, tables=tables
            )

    all_workloads = workloads(Path(args.data or "."), device)
    for key in args.workloads:
        for wl in [with_steps(all_workloads[key], s) for s in args.steps] if args.steps else [all_workloads[key]]:
            repeats = args.repeats or (30 if key.startswith("sine") else 5)
            # "auto" times both batchings on its first batch: what it picks here is what the rows' "auto" ran.
            probe = maml.MetaLearner(wl.net().to(device), wl.loss_fn, inner_lr=wl.inner_lr, steps=wl.steps)
            probe.meta_loss(wl.sample(torch.Generator().manual_seed(0)).to(device))
            chosen = probe.resolved_batching
            for table in args.tables:
                methods = [m for m in TABLES[table] if not args.methods or any(s in m.name for s in args.methods)]
                if not methods:
                    continue
                rows = run_workload(wl, methods, device, repeats, args.warmup, clock, peak)
                tables.append(
                    {
                        "workload": key,
                        "name": wl.name,
                        "table": table,
                        "batching": chosen,
                        "repeats": repeats,
                        "rows": rows,
                    }
                )
                if table == "main":
                    print_table(f"{key}: {wl.name}; batching='auto' picks {chosen!r}", rows, repeats)
                elif table == "hvp":
                    print_table(
                        f"{key} hvp: {wl.name}; batching='auto' picks {chosen!r}; checkpointed rows "
                        f"without a checkpoint_hvp are reverse_over_reverse",
                        rows,
                        repeats,
                    )
                else:
                    print_table(
                        f"{key} family: {wl.name}; second order, batching='auto'; each maml row against "
                        f"the peer below it",
                        rows,
                        repeats,
                        versus="vs peer",
                    )
                save(complete=False)
    save(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
