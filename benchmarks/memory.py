"""Peak memory and time of one MAML meta-training step: the engine's modes against learn2learn and higher.

    .venv/bin/python -m benchmarks.memory                       # or: .venv/bin/python benchmarks/memory.py
    .venv/bin/python -m benchmarks.memory --steps 1 5 --methods second_order checkpointed
    .venv/bin/python -m benchmarks.memory --device cuda         # peak allocated CUDA memory instead
    .venv/bin/python -m benchmarks.memory --shots 1 --methods second_order checkpointed \
        checkpointed_forward_over_reverse first_order learn2learn higher     # issue 14's table, 1-shot

One meta-training step (zero the gradients, meta-loss, backward, Adam step) on the MAML Omniglot
network (4 blocks of 3x3 conv 64, BatchNorm, ReLU, 2x2 max-pool; 28x28 inputs), 5-way 5-shot
(--shots) with 15 query images per class, meta-batch 8, inner rate 0.4, for every method and
number of inner steps:

  second_order, checkpointed, first_order   maml.MetaLearner in that mode (--batching, default
                                            the engine's "auto": a loop over tasks for this conv
                                            net on the CPU, vmap on a GPU). With a loop, the
                                            checkpointed mode recomputes one task at a time; with
                                            vmap, all tasks together (or --chunk-size of them)
  checkpointed_chunk1                       (only with --methods) the checkpointed mode with
                                            chunk_size=1: one task at a time, also with vmap
  checkpointed_every1                       the checkpointed mode with checkpoint_every=1: every
                                            task's fast weights kept at every step (the default
                                            keeps them every sqrt(steps * tasks / chunk) steps)
  checkpointed_forward_over_reverse         (only with --methods) the checkpointed mode with
                                            checkpoint_hvp="forward_over_reverse" (the others
                                            run the default, "reverse_over_reverse")
  learn2learn                               l2l.algorithms.MAML(model, lr): clone() and adapt()
                                            per task, (query loss / T).backward() after each task
  higher                                    higher.innerloop_ctx(model, SGD, copy_initial_weights=
                                            False) per task, the same way

Every configuration runs in a fresh worker process (``--one METHOD STEPS``), so nothing one
configuration allocated, or left in the allocator, counts in another's measure. The worker
builds the model, a synthetic meta-batch (memory and time do not depend on pixel values) and
the optimizer, and runs one warm-up step on one task with one inner step (it loads the kernels
and lazy imports, and allocates little that the measured step could reuse). On the CPU it then
hands freed heap pages back to the system (``malloc_trim``), reads its resident memory (VmRSS)
as the baseline, resets the peak (``echo 5 > /proc/self/clear_refs``), runs one full step and
reads the peak (VmHWM): the RSS column is that peak minus the baseline. On a GPU it is the
peak of ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step. After the
timed steps, one more step runs under ``benchmarks.tensor_peak``: the peak of live tensor bytes
(on the CPU from the profiler's memory events), the figure that decides between modes; RSS also
counts the heap glibc keeps after tensors are freed, and where fragmentation puts them.

Every worker builds its model from the same seed, so the measured step starts from the same
weights everywhere; it hands the meta-gradient of that step to the parent, which prints, below the
table, each row's largest difference from learn2learn's (relative to the largest entry; second
order's where learn2learn did not run; none for first order, which computes another gradient).
In float32 these differences are rounding, amplified over the inner steps; the float64 tests
(tests/engine/test_meta_gradients.py, tests/engine/test_checkpoint_hvp.py) are the exactness proof.

The time is the median over --repeats further steps (the measured first step also pays for
touching its memory for the first time). On the CPU it is the process's CPU time with one
thread (--threads): on a shared machine, wall-clock times of two threads swing several-fold
with the load, CPU times of one thread by a few percent; on an idle machine they are equal.
Workers run with MALLOC_ARENA_MAX=1, so that with several threads glibc cannot hold the same
memory in several arenas. A worker may grow its address space by --limit-gib over its baseline;
one that needs more reports "> N GiB" (out of memory) instead of pushing the machine into the
OOM killer.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
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

import maml  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.sampling import omniglot_net  # noqa: E402
from benchmarks.tensor_peak import peak_tensor_bytes  # noqa: E402

WAYS, SHOTS, QUERY, TASKS, SIDE = 5, 5, 15, 8, 28
INNER_LR, META_LR = 0.4, 1e-3
STEPS = (1, 5, 10, 20, 40, 80)
FORWARD_OVER_REVERSE = "checkpointed_forward_over_reverse"
CHUNKED = "second_order_chunked"  # learner.backward(batch, chunk=1): one task's graph at a time
EVERY_STEP = "checkpointed_every1"  # the checkpointed mode keeping every step's fast weights
ENGINE = (
    "second_order",
    CHUNKED,
    "checkpointed",
    "checkpointed_chunk1",
    EVERY_STEP,
    FORWARD_OVER_REVERSE,
    "first_order",
    "implicit",
)
PEERS = ("learn2learn", "higher")
METHODS = (*ENGINE, *PEERS)
# checkpointed_chunk1 is the default checkpointed run again where the engine loops over tasks (the CPU);
# the forward-over-reverse row is issue 14's table, asked for by name (the default table stays as it was).
DEFAULT_METHODS = [m for m in METHODS if m not in ("checkpointed_chunk1", FORWARD_OVER_REVERSE)]
# The meta-gradient each row is held against: learn2learn's, else second order's (first order: none).
GRADIENT_REFERENCES = ("learn2learn", "second_order")

# The issue's targets. At TARGET_STEPS inner steps, the checkpointed mode's extra peak memory
# is at most MEMORY_RATIO x second order's and its time at most TIME_RATIO x; at PEER_STEPS it
# runs, and learn2learn's extra peak memory is at least PEER_RATIO x its own.
TARGET_STEPS, MEMORY_RATIO, TIME_RATIO = 20, 0.25, 2.0
PEER_STEPS, PEER_RATIO = 40, 4.0
# Issue 14's targets for the forward-over-reverse row: time at most HVP_TIME_RATIO x second order's at
# every number of steps where both ran, and at TARGET_STEPS on the 5-shot workload extra peak memory at
# most HVP_MEMORY_RATIO x second order's.
HVP_TIME_RATIO, HVP_MEMORY_RATIO, HVP_MEMORY_SHOTS = 1.1, 0.1, 5

Step = Callable[[], None]
# make_step's result: the meta-parameters (their .grad holds the meta-gradient after a step), the step, and
# what the engine's memory planner chose for it (learner.plan; None for a peer or where nothing is planned).
Built = tuple[list[torch.Tensor], Step, Callable[[], str | None]]
Result = dict[str, Any]


def synthetic_batch(tasks: int, generator: torch.Generator, device: torch.device, shots: int = SHOTS) -> maml.TaskBatch:
    """``tasks`` random 5-way ``shots``-shot tasks of 28x28 images, with 15 query images per class."""

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(tasks, WAYS * per_class, 1, SIDE, SIDE, generator=generator)
        y = torch.arange(WAYS).repeat_interleave(per_class).expand(tasks, -1).contiguous()
        return x, y

    return maml.TaskBatch(*split(shots), *split(QUERY)).to(device)


def engine_step(method: str, steps: int, batch: maml.TaskBatch, args: argparse.Namespace) -> Built:
    mode: str | maml.Mode = method.removesuffix("_chunk1").removesuffix("_chunked")
    chunk_size = 1 if method.endswith("_chunk1") else args.chunk_size
    if method == FORWARD_OVER_REVERSE:
        mode = maml.Checkpointed(hvp="forward_over_reverse")
    if method == EVERY_STEP:  # one-step segments: every task's fast weights at every step
        mode = maml.Checkpointed(every=1)
    spec = maml.Mode.of(mode)
    if isinstance(spec, maml.Checkpointed):  # its tasks replayed together are its own option
        mode, chunk_size = maml.Checkpointed(**{**spec.options(), "tasks": chunk_size}), None
    model = omniglot_net(WAYS).to(args.device)
    learner = maml.MetaLearner(
        model,
        F.cross_entropy,
        inner_lr=INNER_LR,
        steps=steps,
        mode=mode,
        batching=args.batching,
        chunk_size=chunk_size,
        memory_budget=args.memory_budget if maml.Mode.of(mode).plans else None,  # the modes that plan
    )
    optimizer = torch.optim.Adam(learner.parameters(), lr=META_LR)

    def meta_gradient() -> None:
        if method == CHUNKED:
            learner.backward(batch, chunk=1)
        elif learner.memory_budget is not None:  # backward runs the chunks the budget plans
            learner.backward(batch)
        else:
            learner.meta_loss(batch).backward()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        meta_gradient()
        optimizer.step()

    if learner.memory_budget is not None or (mode == "checkpointed" and chunk_size is None):
        # The memory planner measures (and times "auto") once per configuration, at its first training call:
        # here, with no optimizer step, so that the measured step is planned as every later one is.
        meta_gradient()

    return list(learner.parameters()), step, lambda: None if learner.plan is None else str(learner.plan)


def peer_step(method: str, steps: int, batch: maml.TaskBatch, args: argparse.Namespace) -> Built:
    with warnings.catch_warnings():  # gym, imported by learn2learn, warns about its own deprecation
        warnings.simplefilter("ignore")
        import higher
        import learn2learn as l2l

    model = omniglot_net(WAYS).to(args.device)
    tasks = list(zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y))
    if method == "learn2learn":
        meta = l2l.algorithms.MAML(model, lr=INNER_LR)
        optimizer = torch.optim.Adam(meta.parameters(), lr=META_LR)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            for sx, sy, qx, qy in tasks:
                learner = meta.clone()
                for _ in range(steps):
                    learner.adapt(F.cross_entropy(learner(sx), sy))
                (F.cross_entropy(learner(qx), qy) / len(tasks)).backward()
            optimizer.step()

        return list(meta.parameters()), step, lambda: None

    optimizer = torch.optim.Adam(model.parameters(), lr=META_LR)
    inner_opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for sx, sy, qx, qy in tasks:
            with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, diffopt):
                for _ in range(steps):
                    diffopt.step(F.cross_entropy(fmodel(sx), sy))
                (F.cross_entropy(fmodel(qx), qy) / len(tasks)).backward()
        optimizer.step()

    return list(model.parameters()), step, lambda: None


def make_step(method: str, steps: int, batch: maml.TaskBatch, args: argparse.Namespace) -> Built:
    if method in PEERS:
        return peer_step(method, steps, batch, args)
    return engine_step(method, steps, batch, args)


def proc_status_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB, e.g. VmRSS (resident now) and VmHWM (resident at the peak)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                values[key] = int(rest.split()[0])
    return values


class Meter:
    """Memory since :meth:`start` over the baseline, and a step's time, on the CPU or a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.baseline = 0

    def start(self) -> float:
        """Takes the baseline and resets the peak; returns the baseline in MiB."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return self.baseline / 2**20
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back: the baseline is live memory only
        self.baseline = proc_status_kib("VmRSS")["VmRSS"] * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident memory
        if proc_status_kib("VmHWM")["VmHWM"] * 1024 > self.baseline + 2**20:
            raise RuntimeError("writing 5 to /proc/self/clear_refs did not reset the peak (VmHWM); cannot measure.")
        return self.baseline / 2**20

    def extra_mib(self) -> float:
        """Peak memory since :meth:`start` minus the baseline, in MiB."""
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.baseline) / 2**20
        return (proc_status_kib("VmHWM")["VmHWM"] * 1024 - self.baseline) / 2**20

    def seconds(self, fn: Step) -> float:
        """CUDA: wall time of ``fn``; CPU: this process's CPU time (all its threads)."""
        if self.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start
        start = time.process_time()
        fn()
        return time.process_time() - start


def worker(method: str, tasks: int, steps: int, args: argparse.Namespace) -> Result:
    """Measures one configuration in this (fresh) process; see the module docstring."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = synthetic_batch(tasks, g, args.device, args.shots)
    make_step(method, 1, synthetic_batch(1, g, args.device, args.shots), args)[1]()  # warm-up
    torch.manual_seed(0)  # the same initial weights in every worker, for the gradient check
    params, step, plan = make_step(method, steps, batch, args)
    meter = Meter(args.device)
    baseline = meter.start()
    if args.limit_gib and not meter.cuda:
        size = proc_status_kib("VmSize")["VmSize"] * 1024
        limit = size + int(args.limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result: Result = {"method": method, "tasks": tasks, "steps": steps, "baseline_mib": baseline}
    try:
        first = meter.seconds(step)
    except (RuntimeError, MemoryError) as e:  # the allocator's failure: over --limit-gib or the GPU's memory
        if not isinstance(e, MemoryError) and "memory" not in str(e).lower():
            raise
        return {**result, "oom": True}
    extra = meter.extra_mib()
    if args.grad_file:  # the meta-gradient of the measured step, from the shared initial weights
        torch.save([p.grad.detach().cpu() for p in params], args.grad_file)
    times = [meter.seconds(step) for _ in range(args.repeats)]
    seconds = statistics.median(times or [first])
    # Last, in a step of its own: the profiler that counts tensors on the CPU slows the step and keeps
    # its records in the heap, so it must not touch the RSS or the time measured above.
    tensors = peak_tensor_bytes(step, args.device) / 2**20
    done = {"oom": False, "extra_mib": extra, "tensor_mib": tensors, "first_s": first, "seconds": seconds}
    return {**result, **done, **({"plan": plan()} if plan() else {})}


def run_worker(method: str, tasks: int, steps: int, args: argparse.Namespace, grad_file: Path | None = None) -> Result:
    """Runs :func:`worker` in a fresh process and returns its result (or its error); the worker
    writes the measured step's meta-gradient to ``grad_file`` if given."""
    command = [sys.executable, "-m", "benchmarks.memory", "--one", method, str(tasks), str(steps)]
    command += ["--device", str(args.device), "--batching", args.batching, "--threads", str(args.threads)]
    command += ["--repeats", str(args.repeats), "--limit-gib", str(args.limit_gib), "--shots", str(args.shots)]
    if grad_file is not None:
        command += ["--grad-file", str(grad_file)]
    if args.chunk_size is not None:
        command += ["--chunk-size", str(args.chunk_size)]
    if args.memory_budget is not None:
        command += ["--memory-budget", str(args.memory_budget)]
    # The repository first, then the caller's own path (where its peers may be installed).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return {"method": method, "tasks": tasks, "steps": steps, "oom": False, "error": lines[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the report


def cell(result: Result | None, limit_gib: float) -> str:
    if result is None:
        return "-"
    if result.get("error"):
        return "error"
    if result["oom"]:
        return f"> {limit_gib:g} GiB"
    tensors = f"{result['tensor_mib']:.0f} MiB tensors, " if "tensor_mib" in result else ""
    return f"{tensors}{result['extra_mib']:.0f} MiB {result['seconds']:.1f} s"


def ratio(results: dict[tuple[str, int], Result], a: str, b: str, steps: int, key: str) -> float | None:
    """``a``'s over ``b``'s measure ``key`` at ``steps``, or None where either did not run."""
    ra, rb = results.get((a, steps)), results.get((b, steps))
    if not ra or not rb or ra.get("error") or rb.get("error") or ra["oom"] or rb["oom"]:
        return None
    return float(ra[key]) / float(rb[key])


def check(ok: bool | None, text: str) -> bool | None:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}: {text}")
    return ok


def relative_difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest entry of ``|got - expected|`` over the largest of ``|expected|``."""
    flat = torch.cat([g.flatten() for g in got]).double()
    ref = torch.cat([e.flatten() for e in expected]).double()
    return float((flat - ref).abs().max() / ref.abs().max())


def gradient_differences(results: dict[tuple[str, int], Result], grad_files: dict[tuple[str, int], Path]) -> None:
    """Adds ``grad_reference`` and ``grad_diff`` to each result whose meta-gradient has a reference."""
    for (method, steps), result in results.items():
        refs = [m for m in GRADIENT_REFERENCES if grad_files.get((m, steps), Path()).is_file()]
        path = grad_files.get((method, steps), Path())
        if method in ("first_order", "implicit") or not refs or not path.is_file():  # other meta-gradients
            continue
        ref = refs[0]
        result["grad_reference"] = ref
        result["grad_diff"] = relative_difference(torch.load(path), torch.load(grad_files[(ref, steps)]))


def grad_cell(result: Result | None) -> str:
    if result is None or "grad_diff" not in result:
        return "-"
    if result["method"] == result["grad_reference"]:
        return "reference"
    suffix = "" if result["grad_reference"] == GRADIENT_REFERENCES[0] else f" (vs {result['grad_reference']})"
    return f"{result['grad_diff']:.1e}{suffix}"


def print_grid(cells: dict[tuple[str, int], str], methods: list[str], steps: list[int]) -> None:
    width = max(len(m) for m in [*methods, "method"])
    widths = [max(len(f"{s} steps"), *(len(cells.get((m, s), "-")) for m in methods)) for s in steps]
    print(f"| {'method'.ljust(width)} | " + " | ".join(f"{f'{s} steps':>{w}}" for s, w in zip(steps, widths)) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for m in methods:
        row = " | ".join(f"{cells.get((m, s), '-'):>{w}}" for s, w in zip(steps, widths))
        print(f"| {m.ljust(width)} | {row} |")


def report(
    results: dict[tuple[str, int], Result], methods: list[str], steps: list[int], limit_gib: float, shots: int = SHOTS
) -> bool:
    """Prints the table, the meta-gradients' differences, the ratios and the issues' checks; returns
    whether no check failed."""
    print_grid({key: cell(r, limit_gib) for key, r in results.items()}, methods, steps)
    if any("grad_diff" in r for r in results.values()):
        print(
            f"\nmeta-gradient of the measured step: largest difference from {GRADIENT_REFERENCES[0]}'s (else "
            f"{GRADIENT_REFERENCES[1]}'s), relative to its largest entry; float32"
        )
        print_grid({key: grad_cell(r) for key, r in results.items()}, methods, steps)

    def fmt(value: float | None, spec: str, unit: str = "") -> str:
        return "-" if value is None else format(value, spec) + unit

    checkpointed = [m for m in ("checkpointed", "checkpointed_chunk1", FORWARD_OVER_REVERSE) if m in methods]
    print("\nratios: memory and time of the checkpointed mode over second order's, learn2learn's memory over its")
    for s in steps:
        parts = []
        for name in checkpointed:
            mem = ratio(results, name, "second_order", s, "extra_mib")
            sec = ratio(results, name, "second_order", s, "seconds")
            peer = ratio(results, "learn2learn", name, s, "extra_mib")
            parts.append(
                f"{name}: memory {fmt(mem, '.3f')}, time {fmt(sec, '.2f')}, learn2learn {fmt(peer, '.1f', 'x')}"
            )
        print(f"  {s:>2} steps: " + "; ".join(parts))
    if FORWARD_OVER_REVERSE in methods:
        print(f"time of {FORWARD_OVER_REVERSE} over checkpointed's (reverse_over_reverse) and learn2learn's")
        for s in steps:
            own = ratio(results, FORWARD_OVER_REVERSE, "checkpointed", s, "seconds")
            peer = ratio(results, FORWARD_OVER_REVERSE, "learn2learn", s, "seconds")
            print(f"  {s:>2} steps: checkpointed {fmt(own, '.2f')}, learn2learn {fmt(peer, '.2f')}")
    print()
    verdicts = []
    for name in (m for m in checkpointed if m != FORWARD_OVER_REVERSE):
        mem = ratio(results, name, "second_order", TARGET_STEPS, "extra_mib")
        sec = ratio(results, name, "second_order", TARGET_STEPS, "seconds")
        ran = results.get((name, PEER_STEPS))
        peer = ratio(results, "learn2learn", name, PEER_STEPS, "extra_mib")
        verdicts += [
            check(
                None if mem is None else mem <= MEMORY_RATIO,
                f"{TARGET_STEPS} steps: {name}'s extra peak memory <= {MEMORY_RATIO} x second order's",
            ),
            check(
                None if sec is None else sec <= TIME_RATIO,
                f"{TARGET_STEPS} steps: {name}'s time <= {TIME_RATIO} x second order's",
            ),
            check(
                None if ran is None or peer is None else peer >= PEER_RATIO,
                f"{PEER_STEPS} steps: {name} runs and learn2learn's extra peak memory >= {PEER_RATIO} x its",
            ),
        ]
    if FORWARD_OVER_REVERSE in methods:  # issue 14's targets
        name = FORWARD_OVER_REVERSE
        for s in steps:
            sec = ratio(results, name, "second_order", s, "seconds")
            verdicts.append(
                check(
                    None if sec is None else sec <= HVP_TIME_RATIO,
                    f"{s} steps: {name}'s time <= {HVP_TIME_RATIO} x second order's",
                )
            )
        mem = ratio(results, name, "second_order", TARGET_STEPS, "extra_mib")
        ran = results.get((name, PEER_STEPS))
        peer = ratio(results, "learn2learn", name, PEER_STEPS, "extra_mib")
        verdicts += [
            check(
                None if mem is None or shots != HVP_MEMORY_SHOTS else mem <= HVP_MEMORY_RATIO,
                f"{TARGET_STEPS} steps, {HVP_MEMORY_SHOTS}-shot: {name}'s extra peak memory <= "
                f"{HVP_MEMORY_RATIO} x second order's",
            ),
            check(
                None if ran is None or peer is None else peer >= PEER_RATIO,
                f"{PEER_STEPS} steps: {name} runs and learn2learn's extra peak memory >= {PEER_RATIO} x its",
            ),
        ]
    return all(v is not False for v in verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=list(STEPS), help="inner steps (default: %(default)s)")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=DEFAULT_METHODS,
        help=f"(default: all but checkpointed_chunk1 and {FORWARD_OVER_REVERSE})",
    )
    parser.add_argument(
        "--tasks", type=int, nargs="+", default=[TASKS], help="meta-batch sizes, one table each (default: %(default)s)"
    )
    parser.add_argument("--shots", type=int, default=SHOTS, help="support images per class (default: %(default)s)")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"), help="(default: cpu)")
    parser.add_argument("--batching", choices=maml.BATCHINGS, default="auto", help="engine batching (default: auto)")
    parser.add_argument("--chunk-size", type=int, default=None, help="engine chunk_size (default: none)")
    parser.add_argument(
        "--memory-budget",
        type=lambda s: int(s) if s.isdigit() else s,
        default=None,
        help="engine memory_budget of the modes that plan (second_order, first_order, checkpointed), e.g. 700MiB",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps after the measured one (default: 1)")
    parser.add_argument(
        "--limit-gib", type=float, default=10.0, help="CPU: address space a worker may add, 0: none (default: 10)"
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a check fails")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the results, with device, versions and commit, here"
    )
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "TASKS", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--grad-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(worker(args.one[0], int(args.one[1]), int(args.one[2]), args)))
        return 0

    timed = " (timed on each worker's first batch)" if args.batching == "auto" else ""
    clock = "wall time" if args.device.type == "cuda" else f"CPU time, {args.threads} thread(s)"
    memory = (
        "peak allocated CUDA memory"
        if args.device.type == "cuda"
        else "peak of live tensor bytes (profiler memory events), peak resident memory"
    )
    sizes = ", ".join(map(str, args.tasks))
    print(
        f"torch {torch.__version__}, device {args.device}; Omniglot conv net, {sizes} tasks {WAYS}-way "
        f"{args.shots}-shot {QUERY} query per class; engine batching={args.batching!r}{timed}, "
        f"chunk_size={args.chunk_size}, memory_budget={args.memory_budget}"
    )
    print(f"each cell: {memory} of one meta-training step over the worker's baseline, and its {clock}\n")
    results: dict[tuple[str, int, int], Result] = {}

    def save(complete: bool) -> None:
        """Writes --json: after every configuration (an interrupted run keeps what it measured), then whole."""
        if args.json is None:
            return
        write_report(
            args.json,
            "memory",
            sys.argv[1:] if argv is None else argv,
            args.device,
            args.threads,
            setting={
                "tasks": args.tasks[0] if len(args.tasks) == 1 else list(args.tasks),
                "ways": WAYS,
                "shots": args.shots,
                "query": QUERY,
                "batching": args.batching,
                "repeats": args.repeats,
                "limit_gib": args.limit_gib,
                **({"memory_budget": args.memory_budget} if args.memory_budget is not None else {}),
            },
            methods=list(args.methods),
            steps=list(args.steps),
            complete=complete,
            results=[{**r, "method": m, "tasks": t, "steps": s} for (m, t, s), r in results.items()],
        )

    ok = True
    for t in args.tasks:
        with tempfile.TemporaryDirectory(prefix="maml-memory-") as folder:
            grad_files = {(m, s): Path(folder) / f"{m}-{s}.pt" for s in args.steps for m in args.methods}
            table: dict[tuple[str, int], Result] = {}
            for s in args.steps:
                for m in args.methods:
                    start = time.perf_counter()
                    table[(m, s)] = r = run_worker(m, t, s, args, grad_files[(m, s)])
                    note = f" ({r['error']})" if r.get("error") else ""
                    print(
                        f"  {m}, {t} tasks, {s} steps: {cell(r, args.limit_gib)}{note}, "
                        f"{time.perf_counter() - start:.0f} s wall",
                        file=sys.stderr,
                        flush=True,
                    )
                    gradient_differences(table, grad_files)
                    results.update({(m, t, s): r for (m, s), r in table.items()})
                    save(complete=False)
        if len(args.tasks) > 1:
            print(f"\n{t} tasks")
        ok = report(table, args.methods, args.steps, args.limit_gib, args.shots) and ok
    save(complete=True)
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
