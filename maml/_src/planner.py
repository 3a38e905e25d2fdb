"""The plan of a training step: the memory budget, what is measured, the memory model, the batching, what is kept.

A researcher thinks "I have 24 GB: give me the exact meta-gradient as fast as that allows", not in
tasks per chunk and segment lengths. This module turns a budget into those choices and owns all
of it: reading the budget (:func:`budget_bytes`), measuring (:func:`measure`, :func:`time_batchings`),
the memory model (:class:`Footprint`), the plan (:class:`Plan`, :class:`Planner`), the choice of
``batching="auto"`` (:func:`choose_batching`), and what a checkpoint keeps (``Planner.measured``).

**What is measured.** At most two inner steps: the mode's own training step (meta-loss and its
gradient) of one task at one inner step, or at two where the call has more (a first step starts
from views of the parameters and holds less than any later one), and its forward pass at one step;
where a plan could run two tasks in one call and the budget holds them, the same step of two tasks
(in a loop, and batched by ``vmap``). Each probe's tensor peak and the bytes it still holds when its
forward pass ends are read from one pass (:func:`measure`). A probe runs only where the step it
stands for could fit the budget, so no probe holds more than the plans it decides between.

**The memory model.** A call of ``B`` tasks at ``n`` inner steps holds one task's step at the
probes' depth ``P``, plus for each further task what a second task added (``P2 - P``, measured: its
graph, its fast weights, the cotangents ``backward`` holds for it), plus for each further inner step
of each task the bytes one step leaves on the graph (``g``, the forward pass's held bytes at two
steps less those at one; a peak is not linear in the steps, what the graph holds is). The checkpointed mode
keeps, instead of a graph per step, one iterate (fast weights and rule state, counted from their
shapes) per task and kept step, and one per step of the segment being replayed. Every term is an
upper bound of what is alive at the peak: ``tests/engine/test_memory_budget.py`` holds the first call
and later calls of many model families to the budget, counted by a probe the engine does not use.

**Batching.** ``"auto"`` times vmap against the loop on the tasks a plan would batch, in CPU time of
the calling thread on one intra-op thread (:func:`_one_thread`: then it is all the work, and a
descheduled timing on a busy machine loses no time it did not run), the better of three passes
each, interleaved; the loop only where it is :data:`LOOP_MARGIN` times faster (planned: vmap only
where it is that much faster, its tasks hold more). A busy machine can flip the choice only where
the one-thread ratio lies within timing noise of the margin (``benchmarks.auto_choice``: higher's
Omniglot net, 32 filters, 4 tasks, 10 fresh processes beside a busy one, ratios 0.70 to 0.95). The choice is kept by
``state_dict`` and the scripts' ``results.json``, so a resumed or repeated run takes the same path.

Nothing here is hand-written for want of a library: no library plans a MAML step against a memory
budget; the CPU's tensor bytes come from ``torch.profiler``'s memory events, as its own memory
profiler reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._C._profiler import ProfilerActivity as _ProfilerActivity
from torch._C._profiler import (
    ProfilerConfig,
    ProfilerState,
    _ExperimentalConfig,
    _ExtraFields_Allocation,
    _ExtraFields_TorchOp,
)
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch.profiler import record_function

from . import modes
from .forward import Params, TaskForward, exact_attention, unfused_layers
from .loop import Problem, per_task

__all__ = [
    "DEFAULT_FLOOR",
    "LOOP_MARGIN",
    "MemoryBudgetWarning",
    "allowance",
    "data_dependent",
    "Footprint",
    "Plan",
    "Planner",
    "budget_bytes",
    "choose_batching",
    "fmt",
    "measure",
    "peak_bytes",
    "time_batchings",
]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
# The checkpointed mode's default budget is one task's second-order step (what a per-task loop holds), but
# not below this: under it a step's tensors are a rounding error of the process, and one task at a time only
# costs speed (the sine MLP's whole second-order step, 25 tasks, holds 2 MiB).
DEFAULT_FLOOR = 16 * 2**20
# "auto" takes the other batching only when it is this much faster; measured ratios are far from it both ways
# (CPU, Omniglot 32 tasks: max-pool net loop 2-2.5x faster, strided net vmap 2x faster).
LOOP_MARGIN = 1.5
# MetaLearner.backward's default budget in second and first order: this share of the memory free for tensors on the
# device when its first call reads it (the rest: the allocator's rounding, what other code allocates meanwhile).
FREE_SHARE = 0.9
_FREE = "free memory on "  # Planner.measured's key of that budget, by device
TIMED_TASKS = 16  # "auto" times at most this many tasks (the cost grows with them, the ratio little)
# A batched probe of two tasks runs where the budget holds this many times two lone tasks' step (grouped
# kernels and their workspaces hold more per task than a loop).
_VMAP_ROOM = 1.5
_FORWARD_END = "maml::forward_end"
_PROFILER_LINE = re.compile(
    r"^(USDT|ERROR):\S+ \S+ \d+:\d+ (SyncActivityProfilerHandler|DeviceProperties)\.cpp"
    r"|^\[W\S* [0-9:.]+ (\d+ )?\S*CPUAllocator\.cpp:\d+\] Memory block of unknown size"  # a thread id or none
)
_CHOICES: dict[tuple[object, ...], str] = {}  # what "auto" timed, by configuration (one timing per process)


# ---------------------------------------------------------------------------------------------- the budget


def fmt(n: float) -> str:
    """Bytes as a person reads them: ``"1.5 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def free_bytes(device: torch.device) -> int:
    """Memory free for tensors on ``device``: the GPU's free memory (with what PyTorch's caching allocator holds
    unused), or the machine's available memory."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def budget_bytes(value: Any, device: torch.device) -> int | None:
    """A ``memory_budget`` as bytes: an int of bytes, a string (``"6GiB"``, ``"500 MB"``) or a fraction of free memory.

    Raises:
        TypeError, ValueError: naming the value and the forms it may take.
    """
    if value is None:
        return None
    forms = "bytes (an int), a string such as '6GiB' or '500MB', or a fraction of the free memory in (0, 1] ('0.8')"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"memory_budget must be {forms}, got {value!r} ({type(value).__name__}).")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget={value!r} is not a size; it must be {forms}.")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not unit and "." in match.group(1):  # "0.8", as a command line gives it: a fraction
            return budget_bytes(number, device)
        if number * _UNITS[unit] < 1:
            raise ValueError(f"memory_budget={value!r} is under one byte; it must be {forms}.")
        return int(number * _UNITS[unit])
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"memory_budget={value!r}: a float is a fraction of the free memory, in (0, 1].")
        return int(value * free_bytes(device))
    if value < 1:
        raise ValueError(f"memory_budget={value!r} must be at least one byte; it must be {forms}.")
    return value


# ---------------------------------------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one run of a function held: its tensor peak, and the bytes alive at the end of its forward pass."""

    peak: int
    held: int


def measure(fn: Callable[[], object], device: torch.device) -> Measured:
    """Runs ``fn()``: the peak of the bytes of the tensors it allocated on ``device`` alive at once, and those alive
    at its :func:`forward_ends` mark (or at its end).

    On a GPU ``torch.cuda.max_memory_allocated`` over what was allocated before (it resets the
    device's peak statistics), the mark reading ``torch.cuda.memory_allocated``. On the CPU, where
    PyTorch keeps no allocation statistics, the running sum of the profiler's memory events
    (``+bytes`` per allocation, ``-bytes`` per free of a block allocated during the call), in order
    (:func:`_cpu_allocations`); the public ``events()`` fold an operator's allocations into it and
    lose that order. Under a profiler the user runs, which a second one would cancel,
    :func:`saved_bytes` stands in.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _CUDA_MARKS.append([])
        try:
            fn()
        finally:
            marks = _CUDA_MARKS.pop()
        torch.cuda.synchronize(device)
        end = marks[0] if marks else torch.cuda.memory_allocated(device)
        return Measured(torch.cuda.max_memory_allocated(device) - base, end - base)
    if device.type != "cpu" or torch.autograd._profiler_enabled():
        saved = saved_bytes(fn)
        return Measured(saved, saved)
    allocations, mark = _cpu_allocations(fn)
    alive: dict[int, int] = {}  # the blocks the call allocated and has not freed, by address
    live = peak = 0
    held = None
    for at, ptr, nbytes in allocations:
        if held is None and mark is not None and at > mark:
            held = live
        if nbytes > 0:
            alive[ptr] = nbytes
            live += nbytes
            peak = max(peak, live)
        elif ptr in alive:  # a block allocated before the call (or its stale record) frees nothing the call held
            live -= alive.pop(ptr)
    return Measured(peak, live if held is None else held)


def _cpu_allocations(fn: Callable[[], object]) -> tuple[list[tuple[int, int, int]], int | None]:
    """Runs ``fn()`` under the profiler: its CPU allocator's events ``(time, address, +bytes or -bytes)`` in order,
    and the time of its first :func:`forward_ends` mark.

    The addresses come from the event tree (``experimental_event_tree``, as ``torch.profiler``'s
    memory profiler reads them): the allocator reports a free of any block it saw allocated under an
    earlier profile, so a free counts only where this call allocated the block.
    """
    allocations: list[tuple[int, int, int]] = []
    mark = None
    for node in _profiled(fn, memory=True):
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif node.name == _FORWARD_END and (mark is None or node.start_time_ns < mark):
            mark = node.start_time_ns
    allocations.sort(key=lambda a: a[0])
    return allocations, mark


_CUDA_MARKS: list[list[int]] = []  # on a GPU, what each :func:`measure` running now read at its mark


def forward_ends() -> None:
    """Marks, inside a function :func:`measure` runs, the moment whose live bytes are its ``held``."""
    if _CUDA_MARKS and not _CUDA_MARKS[-1]:
        _CUDA_MARKS[-1].append(torch.cuda.memory_allocated())
    with record_function(_FORWARD_END):
        pass


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Runs ``fn()`` and returns the peak of the bytes of the tensors it allocated on ``device`` that were alive at once."""
    return measure(fn, device).peak


class MemoryBudgetWarning(UserWarning):
    """A planned call held more than its memory budget: a model whose activations' size follows the data
    (:func:`data_dependent`) met tasks heavier than the one its plan measured."""


def allowance(budget: int) -> int:
    """What a call may hold beyond a budget of ``budget`` bytes, counted by the allocator's blocks: 1 % of it and
    64 KiB (a kernel's scratch at a size the probes did not run, the batch's slices). A data-dependent model's
    call past it is said and planned again (:meth:`Planner.exceeded`)."""
    return budget // 100 + 64 * 2**10


def data_dependent(fn: Callable[[], object]) -> str | None:
    """Runs ``fn()`` (a forward pass) and returns the first operator whose output's size follows the data, or ``None``.

    Such an operator (``torch.Tag.dynamic_output_shape``: ``nonzero``, which a boolean mask's indexing
    calls, ``masked_select``, ``unique``; ``data_dependent_output``: a value read back to Python, which
    a branch or a slice can follow; packed sequences) makes a model hold, on another batch, other
    activations than the task its plan measured: its planned calls are measured as they run
    (``MetaLearner.backward``), and one past the budget is said and planned again from its figure
    (:meth:`Planner.exceeded`). Read from the profiler's operator events, which see the operators an
    operator calls (a Python dispatch mode sees only the outer one, and its first use imports dynamo).
    Under a profiler of the user's, which a second one would cancel: ``None``.
    """
    if torch.autograd._profiler_enabled():
        return None
    ops = (n.name for n in _profiled(fn, memory=False) if isinstance(n.extra_fields, _ExtraFields_TorchOp))
    return next((name for name in ops if _from_data(name)), None)


def _profiled(fn: Callable[[], object], memory: bool) -> list[Any]:
    """Runs ``fn()`` under the profiler (its allocations too where ``memory``); the events it recorded, in the tree's
    order (each before its children, siblings in time), which breaks ties in time.

    Started through ``torch.autograd``'s profiler calls rather than ``torch.profiler.profile``,
    whose first start imports ``torch._inductor`` (and with it dynamo and triton): about 1 s and
    160 MiB of resident memory for a probe that itself takes milliseconds.
    """
    config = ProfilerConfig(ProfilerState.KINETO, False, memory, False, False, False, _ExperimentalConfig())
    activities = {_ProfilerActivity.CPU}
    with _profiler_lines_dropped():
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities)
        try:
            fn()
        finally:
            result = _disable_profiler()
    events, nodes = [], result.experimental_event_tree()[::-1]  # a stack, popped in the tree's order
    while nodes:
        events.append(node := nodes.pop())
        nodes += node.children[::-1]
    return events


def _from_data(name: str) -> bool:
    """Whether the ATen operator ``name`` (``"aten::nonzero"``) has an output whose size, or a value, follows its
    inputs' values. Indexing itself is not: its integer indices give their own shape; a boolean mask calls nonzero."""
    namespace, _, op = name.partition("::")
    if namespace != "aten" or op == "index":
        return False
    if op == "_pack_padded_sequence":
        return True
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return False
    tags = {tag for overload in packet.overloads() for tag in getattr(packet, overload).tags}
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


@contextlib.contextmanager
def _profiler_lines_dropped() -> Iterator[None]:
    """Drops the lines PyTorch's profiler library writes to the process's stderr as it starts and stops.

    Kineto writes ``USDT: ... profiler_start``, in a CUDA build without a GPU ``ERROR: ...
    gpuGetDeviceCount failed``, and the CPU allocator a warning for each block allocated before the
    profile and freed in it, from C++ and past every setting, for a probe the user never asked for.
    What else reaches file descriptor 2 meanwhile is written back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_LINE.search(line)]  # fmt: skip
            sys.stderr.write("".join(kept))


def saved_bytes(fn: Callable[[], object]) -> int:
    """Runs ``fn()`` and returns the bytes of the storages autograd saved for backward passes while it ran.

    The graph is most of a meta-training step's tensor peak, but not all of it where transient
    tensors weigh, so it only stands in where :func:`measure` cannot measure (a profiler of the user's).
    """
    storages: dict[tuple[str, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a tensor without storage (functorch's wrappers)
            storage = t.untyped_storage()
            storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


# ---------------------------------------------------------------------------------------------- batching


def _cpu_seconds(device: torch.device) -> Callable[[], float]:
    """The clock a timing reads: the calling thread's CPU time on the CPU, read on one intra-op thread
    (:func:`_one_thread`), wall time with synchronisation on a GPU."""
    if device.type == "cuda":

        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return wall
    return time.thread_time


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On the CPU, torch's intra-op threads set to one for the timing, then back to as many as before.

    On one thread the calling thread's CPU time is all the work, and time it was descheduled is not
    counted, so a busy machine does not add to it. On several it is neither: it misses the work done
    on the worker threads, and it counts the calling thread's waits at each parallel region's barrier
    for a worker the machine has descheduled (OpenMP's workers spin as they wait). On a loaded 2-core
    machine, 2 threads, higher's Omniglot net at 32 filters on 4 tasks, that put the loop's time
    over vmap's anywhere from 0.10 to 1.81 in 5 fresh processes beside a busy one (2 chose the loop, 3 vmap)
    (``benchmarks.auto_choice``); on one thread the two are the same work in every process.
    """
    if device.type == "cuda":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def time_batchings(
    forward: TaskForward,
    fast: Params,
    consts: Params,
    data: Sequence[tuple[Tensor, Tensor]],
    second_order: bool = False,
    task_by_task: bool = False,
) -> dict[str, float]:
    """Seconds of forward and backward passes over ``data`` for each batching, ``{"vmap": s, "loop": s}``.

    Which is faster depends on the model, the sizes and the device, not on layer types: under
    ``vmap`` a convolution with per-task weights becomes one grouped convolution. Measured on the
    CPU (one thread, 32 Omniglot tasks, forward and backward): the reference's strided net, 5
    support and 5 query images a task, 209 + 292 ms batched against 340 + 373 ms in a loop; the
    max-pool net with 15 query images a class, 0.7 + 15.9 s batched against 0.8 + 8.0 s in a
    loop. So the support and query sets are timed alike (the query set can decide, as there),
    one warm-up pass each, then three passes of each batching interleaved, the better of the three.
    A parameter the forward pass does not use has no gradient, and is timed as such.

    ``second_order``: time what a second-order step runs instead, one inner step on the support set
    (its gradient with ``create_graph=True``), the query set at the stepped weights, and the gradient of
    that through both: its double backward can rank the batchings otherwise (learn2learn's Omniglot MLP,
    32 tasks of 5 images: vmap 1.6x faster in first-order passes, 1.3x slower in the second-order step).

    Args:
        fast: ``(T, *shape)`` per-task parameters.
        data: ``(x, y)`` pairs of ``(T, n, ...)`` inputs and targets, e.g. the support and query sets
            (with ``second_order``: exactly those two).
        task_by_task: time the loop one task a pass, as ``MetaLearner.backward`` runs a loop plan's calls.
    """
    device = data[0][0].device
    weights = {k: v.detach().requires_grad_() for k, v in fast.items()}
    clock = _cpu_seconds(device)
    devices = [device.index] if device.type == "cuda" else []
    seconds: dict[str, list[float]] = {"vmap": [], "loop": []}

    def passes(weights: Params, data: Sequence[tuple[Tensor, Tensor]], batching: str) -> None:
        if second_order:
            (sx, sy), (qx, qy) = data
            support, _ = forward(weights, consts, sx, sy, batching=batching, inner=True)
            grads = torch.autograd.grad(
                support.sum(), list(weights.values()), create_graph=True, allow_unused=True, materialize_grads=True
            )
            stepped = {k: torch.add(weights[k], g, alpha=-1e-3) for k, g in zip(weights, grads)}
            query, _ = forward(stepped, consts, qx, qy, batching=batching)
            torch.autograd.grad(query.sum(), list(weights.values()), allow_unused=True)
            return
        for x, y in data:
            losses, _ = forward(weights, consts, x, y, batching=batching)
            torch.autograd.grad(losses.sum(), list(weights.values()), allow_unused=True)

    one_by_one = [  # each task's weights and data alone, as backward's calls of a loop plan run them
        ({k: v[t : t + 1] for k, v in weights.items()}, [(x[t : t + 1], y[t : t + 1]) for x, y in data])
        for t in range(data[0][0].shape[0] if task_by_task else 0)
    ]

    def one_pass(batching: str) -> float:
        began = clock()
        if batching == "loop" and task_by_task:
            for w, d in one_by_one:
                passes(w, d, batching)
        else:
            passes(weights, data, batching)
        return clock() - began

    # Differentiated twice: attention on its math kernel, whose backward has a derivative (forward.exact_attention).
    layers = exact_attention() if second_order else unfused_layers()
    # Forked: dropout's stream stays as it was. On one thread: the CPU time is all the work (_one_thread).
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), layers, _one_thread(device):
        for batching in seconds:
            one_pass(batching)  # warm-up: allocations, kernel choice
        for _ in range(3):
            for batching in seconds:
                seconds[batching].append(one_pass(batching))
    return {k: min(v) for k, v in seconds.items()}


def choose_batching(
    forward: TaskForward,
    fast: Params,
    consts: Params,
    data: Sequence[tuple[Tensor, Tensor]],
    prefer: str = "vmap",
    second_order: bool = False,
    task_by_task: bool = False,
) -> str:
    """With ``"auto"``, settles ``forward``'s batching on the device of ``data``: the other where it is clearly faster.

    "Clearly": by :data:`LOOP_MARGIN` (:func:`time_batchings`); otherwise ``prefer`` (``"vmap"``; a
    memory plan prefers the loop, whose tasks hold less each). A configuration (device, model
    architecture, loss, shapes) is timed once per process: its learners batch alike and agree to
    the bit. The choice is kept (``TaskForward.chosen``, ``state_dict``), so a resumed run takes it again.

    Args:
        fast: ``(T, *shape)`` per-task parameters, detached; ``T`` of them are timed.
        data: ``(x, y)`` pairs of ``(T, n, ...)``: the support set, then the query set.
        second_order: the steps to run differentiate the inner steps (:func:`time_batchings` times those).
        task_by_task: the loop would run one task a call (a memory plan's calls).
    """
    device = data[0][0].device
    if forward.settled(device):
        return forward.resolve(device)
    shapes = lambda tensors: tuple((tuple(t.shape), t.dtype) for t in tensors)  # noqa: E731
    key = (
        device,
        repr(forward.model),
        getattr(forward.loss_fn, "__qualname__", repr(forward.loss_fn)),
        shapes(fast.values()),
        shapes(consts.values()),
        shapes(t for pair in data for t in pair),
        prefer,
        second_order,
        task_by_task,
    )
    if key not in _CHOICES:
        seconds = time_batchings(forward, fast, consts, data, second_order, task_by_task)
        other = "loop" if prefer == "vmap" else "vmap"
        _CHOICES[key] = other if seconds[other] * LOOP_MARGIN < seconds[prefer] else prefer
    forward.settle(device, _CHOICES[key])
    return _CHOICES[key]


# ---------------------------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one configuration's probes measured, bytes; the memory model of its calls (module docstring).

    Attributes:
        depth: the inner steps the probes ran: one, or two for second and first order at two steps or more
            (a first step starts from views of the parameters, and holds less than any later one).
        one: one task's step at ``depth`` inner steps (the checkpointed mode: replaying one).
        task: what a second task adds to a call, run one after the other (``P2 - P1``); ``None``: not measured.
        batched: what a second task adds batched by ``vmap``; ``None``: not measured.
        step: what one more inner step of one task leaves on the graph (second and first order).
        batched_step: the same per task, two tasks batched; ``None``: not measured.
        iterate: one task's fast weights and rule state; ``fast``: its fast weights alone.
        grads: the meta-gradients (``.grad`` of every meta-parameter), which a call may allocate.
    """

    depth: int
    one: int
    task: int | None
    batched: int | None
    step: int
    batched_step: int | None
    iterate: int
    fast: int
    grads: int

    def eager(self, tasks: int, steps: int, batching: str) -> int | None:
        """Second and first order: a call of ``tasks`` tasks at ``steps`` inner steps; ``None``: not known (not measured)."""
        more = max(steps, 1) - self.depth
        if tasks == 1:
            return self.grads + self.one + more * self.step
        if batching == "vmap":
            if self.batched is None or self.batched_step is None:
                return None
            return self.grads + self.one + (tasks - 1) * self.batched + more * tasks * self.batched_step
        if self.task is None:
            return None
        return self.grads + self.one + (tasks - 1) * self.task + more * tasks * self.step

    def checkpointed(self, tasks: int, replayed: int, steps: int, every: int, batching: str) -> int | None:
        """The checkpointed mode: a call of ``tasks`` tasks, ``replayed`` at a time, segments of ``every`` steps.

        Each task keeps one iterate per segment after the first; the segment being replayed keeps
        the iterate (and support gradient) entering each of its steps after the first.
        """
        extra = tasks - replayed
        if (replayed > 1 and (batching != "vmap" or self.batched is None)) or (extra and self.task is None):
            return None
        grow = (replayed - 1) * (self.batched or 0) + extra * (self.task or 0)
        kept = (math.ceil(max(steps, 1) / every) - 1) * tasks * self.iterate
        return self.grads + self.one + grow + kept + (every - 1) * replayed * (self.iterate + self.fast)


# ---------------------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a training step fits a memory budget; ``learner.plan``, kept by ``state_dict``.

    Attributes:
        budget: the budget, bytes.
        default: the budget is the checkpointed mode's default rule (no ``memory_budget`` given).
        tasks: tasks per call (``MetaLearner.backward``'s chunks; one call: the batch).
        replayed: checkpointed: tasks replayed together within a call; else ``tasks``.
        checkpoint_every: checkpointed: inner steps per segment; else ``None``.
        batching: ``"vmap"`` or ``"loop"``, how the tasks of a call run.
        estimate: a call's tensor peak by the memory model, bytes.
        calls: calls of ``tasks`` tasks (the last may have fewer) that run the batch.
    """

    budget: int
    default: bool
    tasks: int
    replayed: int
    checkpoint_every: int | None
    batching: str
    estimate: int
    calls: int = 1

    def __str__(self) -> str:
        every = self.checkpoint_every
        segments = f", segments of {every} step{'s' * (every != 1)}" if every else ""
        replay = f" ({self.replayed} replayed together)" if self.replayed != self.tasks else ""
        calls = f" in {self.calls} calls" if self.calls > 1 else ""
        rule = " (the default: one task's second-order step)" if self.default else ""
        over = " over" if self.estimate > self.budget else ""
        return (
            f"{self.tasks} task{'s' * (self.tasks != 1)} at once{calls}{replay}{segments}, {self.batching}; about "
            f"{fmt(self.estimate)} of a {fmt(self.budget)} budget{over}{rule}"
        )


class TooSmall(ValueError):
    """The budget holds no plan of the call.

    Attributes:
        fits: a plan of the batch in several calls (``MetaLearner.backward``'s chunks) within the
            budget, where the call was one piece and such a plan exists; else ``None``.
        least: the bytes of the plan that holds least (one task a call).
    """

    def __init__(self, message: str, fits: Plan | None, least: int = 0) -> None:
        super().__init__(message)
        self.fits, self.least = fits, least


class Planner:
    """Plans a learner's training calls against its memory budget, from measurements it keeps (``measured``).

    Args:
        forward: the learner's per-task forward pass, whose ``"auto"`` batching a plan settles.
    """

    def __init__(self, forward: TaskForward, measured: dict[str, dict[str, int]] | None = None) -> None:
        self.forward = forward
        self.measured: dict[str, dict[str, int]] = {}  # configuration -> what its probes measured
        # The free-memory budgets read before (free_budget): a decision kept across reconfigurations.
        self.measured.update({k: v for k, v in (measured or {}).items() if k.startswith(_FREE)})
        self._key: str | None = None  # the configuration the last plan was made for

    def outgrown(self) -> bool:
        """Whether the last plan's configuration was planned again from a call past its budget (:meth:`exceeded`)."""
        return bool(self.measured.get(self._key or "", {}).get("outgrown"))

    def exceeded(self, held: int, plan: Plan) -> None:
        """A planned call of a data-dependent model held ``held`` bytes where ``plan`` estimated less: the
        configuration's one-task step grows by the difference and what each further task and step adds by the
        ratio, so that the plan of the next call expects such tasks (the same plan's estimate becomes ``held``)."""
        m = self.measured.get(self._key or "")
        if m is None or held <= plan.estimate:
            return
        ratio = held / max(plan.estimate, 1)
        m["one"] += held - plan.estimate
        m["outgrown"] = 1
        for k in ("held", "step", "task", "batched", "batched_step"):
            if k in m:
                m[k] = math.ceil(m[k] * ratio)

    def free_budget(self, device: torch.device) -> int:
        """``MetaLearner.backward``'s budget where none was given (second and first order): :data:`FREE_SHARE` of the
        device's free memory, read at the first call on ``device`` and kept (``state_dict``), so that neither a busier
        machine later nor a resumed run plans otherwise."""
        key = _FREE + str(device)
        if key not in self.measured:
            self.measured[key] = {"bytes": max(1, int(FREE_SHARE * free_bytes(device)))}
        return self.measured[key]["bytes"]

    def plan(
        self, p: Problem, *, mode: modes.Mode, memory_budget: Any, one_call: bool, outputs: bool = False
    ) -> Plan | None:
        """The plan of a training step on ``p.batch``; ``None`` where the mode plans nothing.

        Args:
            p: the call's problem (the learner's loop and parameters, the tasks, the steps).
            mode: the learner's mode, with its options.
            memory_budget: the learner's option, as given (:func:`budget_bytes` reads it).
            one_call: the batch runs as one call (``run``, ``meta_loss``, a chunk of ``backward``);
                otherwise in as many calls as the budget needs (``backward``).
            outputs: ``backward(return_output=True)``: the batch's fast weights are kept across its calls.

        Raises:
            TooSmall: the budget holds no plan (explicit budgets only; a default one takes the plan that holds least).
        """
        kind = mode.plans
        device = p.batch.support_x.device
        limit = budget_bytes(memory_budget, device)
        if kind is None or (kind == "chunks" and limit is None):
            return None
        tasks, steps = p.batch.num_tasks, p.steps
        every = getattr(mode, "every", None)
        every = None if every is None else min(every, max(steps, 1))  # a segment longer than the loop is the loop
        settled = self.forward.settled(device)
        batchings = [self.forward.resolve(device)] if settled else ["loop", "vmap"]
        lone = "vmap" if self.forward.batching == "vmap" else "loop"  # how one task runs (auto: the plain call)
        depth = 1 if kind == "segments" else min(max(steps, 1), 2)
        key = repr((str(device), repr(_replay(mode)), lone, depth, _shapes(p)))  # what the probes run
        m = self.measured.setdefault(key, {})
        self._key = key
        default = limit is None
        _measure_one(m, p, mode, lone, default, depth)
        if default:  # one task's second-order step at the call's steps, at least the floor
            limit = max(DEFAULT_FLOOR, m["grads"] + m["one"] + (max(steps, 1) - 1) * m.get("step", 0))
        if tasks > 1:
            room = limit
            if default:  # no probe holds more than the plan chosen: the loop's (one task at a time) at most
                lean = _best(_footprint(m, depth, 0), kind, tasks, steps, every, "loop", limit, default, False)
                room = lean.estimate if lean is not None else limit
            _measure_two(m, p, mode, room, batchings, depth, whole=one_call or kind == "chunks", default=default)
        fp = _footprint(m, depth, tasks * m["fast"] if outputs and not one_call else 0)
        plans = {b: _best(fp, kind, tasks, steps, every, b, limit, default, one_call) for b in batchings}
        # The checkpointed mode's plan holds less than a second-order pass of its tasks: it is timed first order, within it.
        twice = mode.twice and kind != "segments"
        made = plans[batchings[0]] if settled else self._choose(p, plans, twice, one_call)
        if made is not None:
            return made
        split = None
        if one_call:  # what backward's calls would fit
            split = next((q for b in batchings if (q := _best(fp, kind, tasks, steps, every, b, limit, False, False))
                          and q.calls > 1), None)  # fmt: skip
        least = min(q.estimate for b in batchings for q in _candidates(fp, kind, 1, steps, every, b, True))
        # Named rounded up to the KiB: a new learner measures again, and an allocation of a few bytes more (a scalar)
        # must not refuse the figure this one named.
        least = -(-least // 2**10) * 2**10
        whole = [q.estimate for b in batchings for q in _candidates(fp, kind, tasks, steps, every, b, one_call)]
        name = f"mode={mode.name!r}"
        if split is not None and whole:
            message = (
                f"{tasks} tasks of {name} hold about {fmt(min(whole))} in one call, over memory_budget={fmt(limit)}"
            )
        elif split is not None:  # no call of them was measured: the budget holds too little to probe two together
            message = (
                f"{tasks} tasks of {name} in one call are over memory_budget={fmt(limit)}, which holds one (about "
                f"{fmt(least)}) but too little to measure two together"
            )
        elif kind == "chunks":
            message = (
                f"memory_budget={fmt(limit)} is below what one task of {name} holds at steps={steps} (about "
                f"{fmt(least)}): pass at least memory_budget={least}, or mode='checkpointed', which holds less."
            )
        else:
            message = (
                f"memory_budget={fmt(limit)} is below what {name} holds replaying one task at a time "
                f"(about {fmt(least)}): pass at least memory_budget={least}."
            )
        raise TooSmall(message, split, least)

    def _choose(self, p: Problem, plans: dict[str, Plan | None], twice: bool, one_call: bool) -> Plan | None:
        """With ``"auto"``: the loop's plan, unless vmap's batches tasks and times clearly faster on them; settled."""
        device = p.batch.support_x.device
        loop, vmap = plans["loop"], plans["vmap"]
        if vmap is None or vmap.replayed < 2:
            if loop is not None and p.batch.num_tasks > 1:
                self.forward.settle(device, "loop")  # the budget batches none: one task at a time, the plain call
            return loop  # (one task runs unbatched whatever is chosen: a larger batch decides)
        # Timed on the tasks the batched plan runs together (at most TIMED_TASKS): a first-order pass over them
        # holds less than the plan's step of them.
        k = min(vmap.replayed, TIMED_TASKS)
        part = p.batch[:k]
        fast = per_task({n: v.detach() for n, v in p.params.items()}, k)
        shared = {n: v.detach() for n, v in p.consts.items()}
        data = [part.support_at(0), (part.query_x, part.query_y)]
        chosen = choose_batching(
            self.forward, fast, shared, data, prefer="loop", second_order=twice, task_by_task=not one_call
        )
        return vmap if chosen == "vmap" or loop is None else loop


def _measure_one(m: dict[str, int], p: Problem, mode: modes.Mode, lone: str, default: bool, depth: int) -> None:
    """One task's probes, where ``m`` lacks them: the mode's step at ``depth`` inner steps (the checkpointed mode:
    replaying one), and, for more steps, the bytes one more inner step leaves on the graph (the forward pass at two
    steps less at one; for the checkpointed mode second order's, and only where it sets the default budget)."""
    segments = mode.plans == "segments"
    if "one" not in m:
        one = _probe(p, _replay(mode), 1, 1, depth, lone)
        m.update(one=one.peak, held=one.held)
        m["iterate"], m["fast"] = _iterate_bytes(p)
        m["grads"] = sum(v.numel() * v.element_size() for v in _trained(p))
    if "step" not in m and p.steps >= 2 and (not segments or default):
        graph = modes.Mode.of("second_order") if segments else mode
        at_one = _probe(p, graph, 1, 1, 1, lone, backward=False).held
        at_two = _probe(p, graph, 1, 1, 2, lone, backward=False).held if segments else m["held"]
        m["step"] = max(at_two - at_one, 0)


def _measure_two(
    m: dict[str, int],
    p: Problem,
    mode: modes.Mode,
    limit: int,
    batchings: list[str],
    depth: int,
    *,
    whole: bool,
    default: bool,
) -> None:
    """Two tasks' probes at ``depth`` steps, where ``m`` lacks them and a plan could run them: one after the other in
    one call (``whole``), and batched by vmap; each only where the budget could hold the step it stands for."""
    segments = mode.plans == "segments"
    # Two tasks in a loop can hold twice one (the wide MLP of benchmarks.budgets does: its backward's cotangents
    # weigh as much as its graph). On a default budget a whole call of them runs anyway.
    if whole and "task" not in m and (default and segments or 2 * m["one"] <= limit):
        m["task"] = max(_probe(p, _replay(mode), 2, 1, depth, "loop").peak - m["one"], 0)
    if "vmap" in batchings and "batched" not in m and 2 * _VMAP_ROOM * m["one"] <= limit:
        two = _probe(p, _replay(mode), 2, 2, depth, "vmap")
        m["batched"] = max(two.peak - m["one"], 0)
        if depth == 2:  # what a further step leaves per task, batched: the forward pass at two steps less at one
            at_one = _probe(p, mode, 2, 2, 1, "vmap", backward=False).held
            m["batched_step"] = math.ceil(max(two.held - at_one, 0) / 2)


def _replay(mode: modes.Mode) -> modes.Mode:
    """The mode as its probes run it: the checkpointed mode's segments of one step (one inner step is probed)."""
    return modes.Checkpointed(every=1, hvp=mode.hvp) if isinstance(mode, modes.Checkpointed) else mode


def _footprint(m: dict[str, int], depth: int, kept: int) -> Footprint:
    """The memory model of what ``m`` measured at ``depth`` steps; ``kept``: bytes a call's plan holds besides
    (outputs kept across calls)."""
    return Footprint(
        depth=depth,
        one=m["one"],
        task=m.get("task"),
        batched=m.get("batched"),
        step=m.get("step", 0),  # measured where a call has more steps than one
        batched_step=m.get("batched_step", 0 if "batched" in m else None),
        iterate=m["iterate"],
        fast=m["fast"],
        grads=m["grads"] + kept,
    )


def _chunk(tasks: int, most: int) -> tuple[int, int]:
    """As many calls as with ``most`` tasks a call, with the fewest tasks each: ``(tasks a call, calls)``."""
    calls = math.ceil(tasks / most)
    return math.ceil(tasks / calls), calls


def _candidates(
    fp: Footprint, kind: str, tasks: int, steps: int, every: int | None, batching: str, one_call: bool
) -> Iterator[Plan]:
    """Every plan of ``batching`` that the footprint can estimate, fastest first (most tasks together, then the
    shortest segments: a segment of ``e`` steps replays ``e - 1`` of them for values); their budget is 0."""
    if kind == "chunks":
        # backward's calls of a loop take one task each: a loop runs them one after another anyway, and a call of
        # several holds each one's fast weights at once, a task-sized copy of every parameter to write and read back
        # (learn2learn's Omniglot MLP, 32 tasks: 0.144 s a step in one call, 0.119 s in 32).
        for most in [tasks] if one_call else [1] if batching == "loop" else range(tasks, 0, -1):
            size, calls = _chunk(tasks, most)
            need = fp.eager(size, steps, batching)
            if need is not None:
                yield Plan(0, False, size, size, None, batching if size > 1 else "loop", need, calls)
        return
    lengths = [every] if every else range(1, max(steps, 1) + 1)
    for most in range(tasks, 0, -1) if batching == "vmap" else [1]:
        # backward's calls replay their tasks together; one call of the batch replays chunks of it.
        chunk, calls = _chunk(tasks, most)
        size, replayed, calls = (tasks, chunk, 1) if one_call else (chunk, chunk, calls)
        for e in lengths:
            need = fp.checkpointed(size, replayed, steps, e, batching)
            if need is not None:
                yield Plan(0, False, size, replayed, e, batching if replayed > 1 else "loop", need, calls)


def _best(
    fp: Footprint,
    kind: str,
    tasks: int,
    steps: int,
    every: int | None,
    batching: str,
    limit: int,
    default: bool,
    one_call: bool,
) -> Plan | None:
    """The fastest plan within ``limit``; on a default budget, where none fits, the one that holds least."""
    plans = list(_candidates(fp, kind, tasks, steps, every, batching, one_call))
    for plan in plans:
        if plan.estimate <= limit:
            return dataclasses.replace(plan, budget=limit, default=default)
    if default and plans:
        return dataclasses.replace(min(plans, key=lambda q: q.estimate), budget=limit, default=default)
    return None


# ---------------------------------------------------------------------------------------------- the probes


def _shapes(p: Problem) -> tuple[Any, ...]:
    """One task's shapes and dtypes, and the trained parameters: what a configuration's measurements depend on."""
    tensors = [*p.params.values(), *(t[0] for t in (p.batch.support_x, p.batch.support_y, p.batch.query_x))]
    tensors.append(p.batch.query_y[0])
    trained = tuple(sorted(k for k, v in p.consts.items() if v.requires_grad))
    return (*((tuple(t.shape), str(t.dtype)) for t in tensors), trained)


def _trained(p: Problem) -> list[Tensor]:
    """The meta-parameters a step differentiates: the adapted parameters, the rates, the trained constants."""
    tensors = (*p.params.values(), *p.rate_values.values(), *p.consts.values())
    # Once each: an inner loss that reads the initial weights has them in the consts too (forward.with_initial).
    return list({id(v): v for v in tensors if v.requires_grad}.values())


def _iterate_bytes(p: Problem) -> tuple[int, int]:
    """One task's fast weights and rule state, and its fast weights alone, bytes (what the checkpointed mode keeps)."""
    fast = per_task({k: v.detach() for k, v in p.params.items()}, 1)
    state = p.loop.rule.init(fast)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    weights = size(fast.values())
    return weights + size(t for d in state for t in d.values()), weights


def _probe(
    p: Problem, mode: modes.Mode, tasks: int, replayed: int, steps: int, batching: str, *, backward: bool = True
) -> Measured:
    """The tensor peak of ``mode``'s training step (meta-loss and its gradient) on ``tasks`` tasks of ``p`` at ``steps``
    (the checkpointed mode replaying ``replayed`` together), and the bytes its forward pass holds at its end;
    with ``backward=False`` the forward pass alone.

    The gradient is taken by ``torch.autograd.grad``, so no ``.grad`` changes; random draws
    (dropout) leave the stream as they found it.
    """
    f = p.loop.forward
    loop = dataclasses.replace(p.loop, forward=f.with_batching(batching))
    problem = p._replace(loop=loop, batch=p.batch[:tasks], steps=steps)
    call = modes.Call(problem, None, replayed, mode)
    leaves = _trained(p)
    device = p.batch.support_x.device

    def step() -> None:
        out = modes.TABLE[mode.name].train(call)
        forward_ends()
        if backward:
            torch.autograd.grad(out.loss, leaves, allow_unused=True)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), modes.attention(mode.name):
        return measure(step, device)
