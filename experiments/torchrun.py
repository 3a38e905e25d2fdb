"""Several processes under ``torchrun``: joining them, sharing a meta-batch, and ending when part of the run goes away."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import maml
from experiments import STARTING
from experiments.cli import UsageError
from experiments.run_options import RunOptions
from experiments.runtime import Terminated

__all__ = ["RankUsageError", "process_rank", "prints_usage_errors", "outwait_printer", "check_device"]
__all__ += ["join_processes", "check_shards", "broadcast", "peer_lost", "leave_with_launcher"]

_JOINED = threading.Event()  # set once join_processes has joined the process group (leave_with_launcher reads it)
_PARENT_AT_IMPORT = os.getppid()  # under torchrun, the launcher's agent (unless it died already)


class RankUsageError(UsageError):
    """A usage error that this process alone meets under torchrun (its GPU): it prints it, where one process per
    machine prints the errors that all meet alike."""


def process_rank() -> int:
    """This process's rank under torchrun (0 alone): the process group's, or before it exists torchrun's RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def prints_usage_errors() -> bool:
    """Whether this process prints the usage errors every process meets alike: the first of each machine, as each
    machine's torchrun shows its own processes' output (RANK: launchers other than torchrun)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def outwait_printer() -> None:
    """Under torchrun, waits 30 s at most for its SIGTERM (or Ctrl-C), then SystemExit(2): for a process that leaves a
    usage error to another, which torchrun would end, maybe before it printed (still importing torch), if this one
    exited first."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: sys.exit(2))
    time.sleep(30.0)


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


def join_processes(device: torch.device) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group: this process's device, rank and world size (alone: ``(device, 0, 1)``).

    gloo on CPU; NCCL on GPUs, each process on ``cuda:LOCAL_RANK``. UsageError for a device the backends cannot serve,
    one GPU for several processes, or fewer GPUs than processes.
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
    _JOINED.set()
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, opts: RunOptions) -> None:
    """Raises UsageError, at start-up, when the meta-batch cannot be split into equal shares (``maml.shard_size``)."""
    try:
        maml.shard_size(meta_batch, opts.world_size)
    except ValueError as error:
        raise UsageError(f"--meta-batch {meta_batch}: {error} torchrun starts --nnodes x --nproc-per-node.") from None


def broadcast(value: Any, opts: RunOptions) -> Any:
    """Rank 0's ``value`` on every process (any picklable object); ``value`` itself in one process."""
    if opts.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# What gloo's TCP transport says when another process ended or its machine went away (a timeout: it may only hang).
_GLOO_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket unexpectedly closed")


def peer_lost(error: BaseException) -> str | None:
    """gloo's reason (e.g. "Connection reset by peer") when ``error`` is a collective's failure because another process ended.

    The errors ``error`` was raised while handling count too: torchrun's SIGTERM can interrupt the unwinding of the
    collective's error (a RuntimeError naming gloo's source file and the socket error). Any other error: None.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, RuntimeError) and "gloo" in text.lower():
            reason = next((r for r in _GLOO_PEER_LOST if r in text), None)
            if reason is not None:
                return reason
        current = current.__cause__ or current.__context__
    return None


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
LAUNCHER_GRACE_S = 5.0  # how long a process whose launcher died may take to stop by its SIGTERM handler


def leave_with_launcher() -> None:
    """Makes the death of this process's parent, torchrun's agent, stop it as ``kill`` (SIGTERM) does.

    torchrun starts each process in a session of its own: a launcher killed by SIGKILL passes nothing on, and its
    processes would train on, holding ``--out``. On Linux the kernel sends SIGTERM (``prctl(PR_SET_PDEATHSIG)``);
    elsewhere a thread polls the parent's pid. A parent that died before the request (the kernel sends nothing then)
    is seen by the pid read at import (not by a pid of 1: in a container, torchrun is often PID 1). The thread also
    ends a process still joining the group (inside C++, where no signal handler runs) :data:`LAUNCHER_GRACE_S` later.
    Call it after installing the SIGTERM handler.
    """
    linux = sys.platform.startswith("linux")
    if linux:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() != _PARENT_AT_IMPORT:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before the request
    elif os.name != "posix":
        return

    def watch() -> None:
        while os.getppid() == _PARENT_AT_IMPORT:
            time.sleep(1.0)
        if not linux:  # (on Linux the kernel has sent it)
            signal.raise_signal(signal.SIGTERM)  # the main thread runs the handler
        time.sleep(LAUNCHER_GRACE_S)
        if not _JOINED.is_set():  # stuck joining: no handler can run
            print(f"\n{STARTING}", file=sys.stderr, flush=True)
            os._exit(143)

    threading.Thread(target=watch, name="leave-with-launcher", daemon=True).start()
