"""Memory budgets: a step's tensor peak, measured, and the plan that fits the step into a budget.

A researcher thinks "I have 24 GB: give me the exact meta-gradient as fast as that allows", not
in tasks per chunk and segment lengths. :class:`Plan` turns a budget into those choices, from
the tensor peak of one task's step, which the learner measures (:func:`peak_bytes`) before its
first training step on a configuration:

- second and first order: how many tasks' graphs ``MetaLearner.backward`` holds at once (its
  chunks), from one task's peak at one and two inner steps, extrapolated to ``steps``;
- checkpointed: how many tasks replay together and the segment length, from one task's peak
  replaying one step, plus the fast weights the segments keep (``checkpointed.py``'s count).

Tasks batched by ``vmap`` hold more each than one task alone (grouped kernels, their
workspaces); the learner measures two tasks batched before planning several, where the budget
leaves room for that probe. No probe holds more than the step it plans for would: the budget is
never spent to decide. Nothing here is hand-written for want of a library: no library plans a
MAML step against a memory budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "DEFAULT_FLOOR",
    "Plan",
    "budget_bytes",
    "fmt",
    "peak_bytes",
    "saved_bytes",
    "plan_checkpointed",
    "plan_chunks",
]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
# The lean modes' default budget is one task's second-order step (what a per-task loop holds), but
# not below this (nor above every task's second-order step): under it a step's tensors are a
# rounding error of the process, and one task at a time only costs speed (the sine MLP's whole
# second-order step, 25 tasks, holds 2 MiB).
DEFAULT_FLOOR = 16 * 2**20
_CPU = torch._C._autograd.DeviceType.CPU
_PROFILER_LINE = re.compile(r"^(USDT|ERROR):\S+ \S+ \d+:\d+ (SyncActivityProfilerHandler|DeviceProperties)\.cpp")


def fmt(n: float) -> str:
    """Bytes as a person reads them: ``"1.5 GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def free_bytes(device: torch.device) -> int:
    """Memory free for tensors on ``device``: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
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


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Runs ``fn()`` and returns the peak of the bytes of the tensors it allocated on ``device`` that were alive at once.

    On a GPU ``torch.cuda.max_memory_allocated`` over what was allocated before (it resets the
    device's peak statistics). On the CPU, where PyTorch keeps no allocation statistics, the
    running sum of the profiler's memory events (``+bytes`` per allocation, ``-bytes`` per free),
    in order, as ``benchmarks/tensor_peak.py`` reads them; their public ``events()`` fold an
    operator's allocations into it and lose that order. Under a profiler the user runs, which a
    second one would cancel, :func:`saved_bytes` stands in.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu" or torch.autograd.profiler._is_profiler_enabled:
        return saved_bytes(fn)
    with _profiler_lines_dropped(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == _CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _profiler_lines_dropped() -> Iterator[None]:
    """Drops the lines PyTorch's profiler library writes to the process's stderr as it starts and stops.

    Kineto writes ``USDT: ... profiler_start`` and, in a CUDA build without a GPU, ``ERROR: ...
    gpuGetDeviceCount failed``, from C++ and past every setting, for a probe the user never asked
    for. What else reaches file descriptor 2 meanwhile is written back.
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

    The graph is most of a meta-training step's tensor peak (conv net with batch norm, CPU,
    second order: 21 MiB saved against a 21 MiB peak at one task, 161 against 160 at two), but not
    all of it where transient tensors weigh (a small conv net's checkpointed replay: 12 MiB saved
    against a 17 MiB peak), so it only stands in where :func:`peak_bytes` cannot measure.
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a training step fits a memory budget; ``learner.plan``, kept by ``state_dict``.

    Attributes:
        budget: the budget, bytes.
        default: the budget is the lean modes' default rule (no ``memory_budget`` given).
        task_bytes: one task's measured need at the step's inner steps (second/first order: its
            whole step; checkpointed: replaying one step), batched as planned.
        tasks: second and first order: tasks per ``backward`` chunk; checkpointed: tasks replayed together.
        checkpoint_every: checkpointed: inner steps per segment; else ``None``.
        batching: ``"vmap"`` or ``"loop"``, how the tasks of a chunk run.
        estimate: the planned step's estimated tensor peak, bytes.
    """

    budget: int
    default: bool
    task_bytes: int
    tasks: int
    checkpoint_every: int | None
    batching: str
    estimate: int

    def __str__(self) -> str:
        every = self.checkpoint_every
        segments = f", segments of {every} step{'s' * (every != 1)}" if every else ""
        rule = " (the default: one task's second-order step)" if self.default else ""
        return (
            f"{self.tasks} task{'s' * (self.tasks != 1)} at once{segments}, {self.batching}; about "
            f"{fmt(self.estimate)} of a {fmt(self.budget)} budget{rule}"
        )


def plan_chunks(budget: int, tasks: int, per_task: int, batching: str, mode: str, steps: int) -> Plan:
    """Second and first order: the most tasks whose graphs fit ``budget`` at ``per_task`` bytes each.

    Raises:
        ValueError: one task does not fit, naming the smallest budget that would run.
    """
    fits = min(tasks, budget // per_task)
    if fits < 1:
        raise ValueError(
            f"memory_budget={fmt(budget)} is below what one task of mode={mode!r} holds at steps={steps} (about "
            f"{fmt(per_task)}): pass at least memory_budget={per_task}, or mode='checkpointed', which holds less."
        )
    return Plan(budget, False, per_task, fits, None, batching, fits * per_task)


def checkpointed_peak(tasks: int, steps: int, chunk: int, every: int, replay: int, iterate: int) -> int:
    """The checkpointed step's peak: the kept iterates of every task and one chunk's replay of a segment.

    ``replay``: one task's peak replaying one step (its second-order graph and query pass);
    ``iterate``: one task's fast weights and rule state, bytes (``checkpointed.py``'s count).
    """
    kept = math.ceil(steps / every) * tasks * iterate
    return kept + chunk * (every * iterate + replay)


def plan_checkpointed(
    budget: int,
    default: bool,
    tasks: int,
    steps: int,
    replay: int,
    iterate: int,
    every: int | None,
    batching: str,
) -> Plan:
    """The fastest checkpointed step that fits ``budget``: the most tasks replayed together, then the shortest segments.

    A segment of ``e`` steps replays ``e - 1`` of them for values before walking them back
    (``checkpointed.py``), so the shortest segments that fit are the fastest: with ``e = 1`` the
    step costs second order's plus one values pass. Tasks replayed together run faster only
    batched (``batching="vmap"``); in a loop they run no faster than one at a time and hold more,
    so the loop replays one. Of the chunk sizes that take as many calls, the smallest is kept (a
    chunk of 13 rather than 18 for 25 tasks): it holds less, and may allow shorter segments.

    ``every``: the mode's ``Checkpointed(every=...)`` if set (only the chunk is planned). Where nothing
    fits, a default budget takes one task at a time at the segment length that holds least (what
    the mode held before it planned); an explicit one refuses.

    Raises:
        ValueError: one task does not fit an explicit budget, naming the smallest that would run.
    """
    lengths = [every] if every else range(1, max(steps, 1) + 1)
    for most in range(tasks if batching == "vmap" else 1, 0, -1):
        chunk = math.ceil(tasks / math.ceil(tasks / most))  # as many calls as ``most``, fewer tasks each
        for e in lengths:
            need = checkpointed_peak(tasks, steps, chunk, e, replay, iterate)
            if need <= budget:
                return Plan(budget, default, replay, chunk, e, batching if chunk > 1 else "loop", need)
    need, e = min((checkpointed_peak(tasks, steps, 1, e, replay, iterate), e) for e in lengths)
    if not default:
        raise ValueError(
            f"memory_budget={fmt(budget)} is below what mode='checkpointed' holds replaying one task at a time "
            f"(about {fmt(need)}): pass at least memory_budget={need}."
        )
    return Plan(budget, default, replay, 1, e, "loop", need)
