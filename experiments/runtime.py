"""Where a run computes: its CPU threads, its device, the C++ compiler, its processes under torchrun, its signals.

Under ``torchrun`` every process runs the same script: :func:`join_processes` joins the process
group and gives each process its device and rank, :func:`check_shards` checks that the
meta-batch splits evenly among them, and :func:`broadcast` sends rank 0's objects to the others.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from experiments.cli import UsageError

if TYPE_CHECKING:
    from experiments.config import RunOptions

__all__ = [
    "set_threads",
    "parse_device",
    "check_device",
    "cxx",
    "join_processes",
    "check_shards",
    "broadcast",
    "catch_stop_signals",
    "STOP_PATIENCE_S",
    "Terminated",
]


def set_threads(threads: int | None) -> None:
    """Sets this process's CPU threads (intra-op, and inter-op where PyTorch still allows it); None keeps PyTorch's.

    Raises:
        UsageError: ``threads < 1``, or more threads than the CPUs this process may run on.
    """
    if threads is None:
        return
    if threads < 1:
        raise UsageError(
            f"--threads {threads} must be >= 1, or null for PyTorch's default "
            f"({torch.get_num_threads()} on this machine)."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads > cpus:  # more threads than CPUs only wait on each other
        raise UsageError(f"--threads {threads} is more than the {cpus} CPUs this process may run on; pass 1 to {cpus}.")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # settable once, before any inter-op work; the intra-op threads are what a step uses
        pass


def parse_device(name: str) -> torch.device:
    """The device ``--device name`` names.

    Raises:
        UsageError: not a torch device, or CUDA on a machine without it.
    """
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu.")
    if device.type == "meta":
        raise UsageError(f"--device {name} holds shapes without data, so nothing can train on it; use --device cpu.")
    return device


def check_device(device: torch.device) -> None:
    """Raises UsageError, naming what to pass instead, when ``device`` is not usable on this machine."""
    available = {
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    names = {"cuda": "CUDA GPU", "mps": "Apple MPS GPU", "xpu": "Intel XPU"}
    if device.type in available and not available[device.type]():
        reason = f"this PyTorch finds no {names[device.type]}"
    else:
        try:
            torch.empty(1, device=device).add_(1)  # an allocation and a kernel: e.g. cuda:3 on a 1-GPU machine fails
            return
        except Exception as e:  # whatever the backend raises (RuntimeError, NotImplementedError, AssertionError)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    other = f" or --device {accelerator.type}" if accelerator is not None and accelerator.type != device.type else ""
    raise UsageError(f"--device {device} is not available on this machine ({reason}); use --device cpu{other}.")


def cxx() -> str | None:
    """The C++ compiler torch.compile's CPU backend would call, if one is installed."""
    return next(
        filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)), None
    )


def join_processes(device: torch.device) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group; returns this process's device, rank and world size.

    torchrun (or any launcher of ``init_method="env://"``) sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; without them this is the only process: ``(device, 0, 1)``.
    The backend is gloo on CPU and NCCL on GPUs, each process on the GPU ``cuda:LOCAL_RANK``.

    Raises:
        UsageError: a device that the backends cannot serve, a GPU index that several
            processes of this machine would share, or fewer GPUs than processes.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if not dist.is_available():
        raise UsageError("this PyTorch build has no torch.distributed; run the script without torchrun.")
    if device.type == "cuda":
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device.index is not None and local_size > 1:
            raise UsageError(
                f"--device {device}: the {local_size} processes on this machine would share one GPU; "
                f"pass --device cuda, and each process takes the GPU cuda:LOCAL_RANK."
            )
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise UsageError(
                    f"process LOCAL_RANK={local_rank} needs the GPU cuda:{local_rank}, but this machine has "
                    f"{torch.cuda.device_count()}; start at most that many processes per machine "
                    f"(--nproc-per-node)."
                )
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL and broadcast_object_list use the current device
        dist.init_process_group("nccl")
    elif device.type == "cpu":
        dist.init_process_group("gloo")
    else:
        raise UsageError(f"--device {device}: several processes need --device cpu (gloo) or --device cuda (NCCL).")
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, opts: RunOptions) -> None:
    """Raises UsageError when the meta-batch cannot be split into equal shares, one per process.

    Equal shares make the mean of the processes' meta-gradients the meta-gradient of the whole
    meta-batch (see ``maml.shard``); checked at start-up rather than at the first step.
    """
    if meta_batch % opts.world_size:
        fits = [n for n in range(1, meta_batch + 1) if meta_batch % n == 0]
        raise UsageError(
            f"--meta-batch {meta_batch} cannot be split evenly across {opts.world_size} processes (the world size "
            f"torchrun started): each process adapts the same number of tasks. Pass a --meta-batch that is a "
            f"multiple of {opts.world_size}, or start a number of processes (--nnodes x --nproc-per-node) that "
            f"divides {meta_batch}: {', '.join(map(str, fits))}."
        )


def broadcast(value: Any, opts: RunOptions) -> Any:
    """Rank 0's ``value`` on every process (any picklable object); ``value`` itself in one process."""
    if opts.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


STOP_PATIENCE_S = 20.0  # how long a stop request waits for the running iteration to end


class Terminated(KeyboardInterrupt):
    """A stop by SIGTERM that unwinds at once: as Ctrl-C does, but the script exits with 143 instead of 130."""


def catch_stop_signals(main: bool = True, patience: float | None = None) -> tuple[list[int], Callable[[], None]]:
    """Catches Ctrl-C and SIGTERM: returns the list they are recorded in, and the function that restores the handlers.

    The first signal is appended to the list, for the training loop to stop at the end of its
    iteration. An iteration that does not end within ``patience`` seconds (default
    :data:`STOP_PATIENCE_S`: a very long inner loop or validation) is interrupted, as is the
    iteration at a second signal: :class:`KeyboardInterrupt` (:class:`Terminated` for SIGTERM)
    is raised at once, and the last checkpoint is what the run keeps. ``main``: whether this
    process prints the line that says so.
    """
    stop: list[int] = []
    wait = STOP_PATIENCE_S if patience is None else patience

    def at_once() -> None:
        raise Terminated if stop[0] == signal.SIGTERM else KeyboardInterrupt

    def request_stop(signum: int, frame: Any) -> None:
        if stop:
            at_once()
        stop.append(signum)
        signal.setitimer(signal.ITIMER_REAL, wait)
        if main:
            again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
            print(f"\nstopping after this iteration (or at once: in {wait:g} s, or at {again})", file=sys.stderr)

    handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    handlers[signal.SIGALRM] = signal.signal(signal.SIGALRM, lambda signum, frame: at_once())

    def restore() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)  # a stop being honoured is not interrupted by the timer
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    return stop, restore
