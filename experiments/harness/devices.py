"""Where a run computes: its CPU threads, its device, the C++ compiler, and under ``torchrun`` the process group
that shares each meta-batch."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

import maml
from experiments.harness.folder import UsageError
from experiments.harness.lifecycle import RankUsageError, Terminated

__all__ = ["set_threads", "parse_device", "cxx", "check_device", "join_processes", "check_shards", "broadcast"]


def set_threads(threads: int | None) -> None:
    """Sets this process's CPU threads (intra-op, and inter-op where PyTorch still allows it); None keeps PyTorch's.

    Raises:
        UsageError: ``threads < 1``, or more than the CPUs this process may run on (they would only wait on each other).
    """
    if threads is None:
        return
    if threads < 1:
        raise UsageError(
            f"--threads {threads} must be >= 1, or null for PyTorch's default "
            f"({torch.get_num_threads()} on this machine)."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads > cpus:
        raise UsageError(f"--threads {threads} is more than the {cpus} CPUs this process may run on; pass 1 to {cpus}.")
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # settable once, before any inter-op work; a step uses the intra-op ones
        torch.set_num_interop_threads(threads)


def parse_device(name: str) -> torch.device:
    """The device ``--device name`` names; UsageError if it is not a torch device, or none to train on here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu.")
    if device.type == "meta":
        raise UsageError(f"--device {name} holds shapes without data, so nothing can train on it; use --device cpu.")
    return device


def cxx() -> str | None:
    """The C++ compiler torch.compile's CPU backend would call, if one is installed."""
    return next(
        filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)), None
    )


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
    message = f"--device {device} is not available on this machine ({reason}); use --device cpu{other}."
    # Under torchrun each process checks its own GPU (cuda:LOCAL_RANK): one may fail where the others do not.
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    raise (RankUsageError if grouped and device.index is not None else UsageError)(message)


def join_processes(device: torch.device, joined: threading.Event | None = None) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group: this process's device, rank and world size (alone: ``(device, 0, 1)``).

    gloo on CPU; NCCL on GPUs, each process on ``cuda:LOCAL_RANK``. UsageError for a device the backends cannot serve,
    one GPU for several processes, or fewer GPUs than processes. ``joined`` (the lifecycle's) is set once joined.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if not dist.is_available():
        raise UsageError("this PyTorch build has no torch.distributed; run the script without torchrun.")
    # Nothing listens where the launcher's agent kept the run's store (it opens it before starting the processes):
    # the agent died, maybe before leave_with_launcher could see it, and joining would wait 30 minutes in C++.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # (a rank 0 of another launcher opens it)
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10).close()
        except ConnectionRefusedError:
            raise Terminated from None  # as the SIGTERM that the launcher's death would have sent
        except (OSError, KeyError, ValueError):  # unreachable for now, or no address: joining says what is wrong
            pass
    if device.type == "cuda":
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device.index is not None and local_size > 1:
            raise UsageError(
                f"--device {device}: the {local_size} processes on this machine would share one GPU; "
                f"pass --device cuda, and each process takes the GPU cuda:LOCAL_RANK."
            )
        if device.index is None:
            if local_rank >= torch.cuda.device_count():  # this process's GPU alone: the first ones have theirs
                raise RankUsageError(
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
    # gloo's init returns on a process whose connections are made while another still makes its own: one
    # that then stopped on a usage error would break the other's init. All leave together.
    dist.barrier()
    if joined is not None:
        joined.set()
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, world_size: int) -> None:
    """Raises UsageError, at start-up, when the meta-batch cannot be split into equal shares (``maml.shard_size``)."""
    try:
        maml.shard_size(meta_batch, world_size)
    except ValueError as error:
        raise UsageError(f"--meta-batch {meta_batch}: {error} torchrun starts --nnodes x --nproc-per-node.") from None


def broadcast(value: Any, world_size: int) -> Any:
    """Rank 0's ``value`` on every process (any picklable object); ``value`` itself in one process."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
