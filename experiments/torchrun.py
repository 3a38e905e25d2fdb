"""Several processes under ``torchrun``: joining them, sharing a meta-batch, and ending together.

Every process runs the same script: :func:`join_processes` joins the process group and gives each
process its device and rank, :func:`check_shards` checks that the meta-batch splits evenly among
them, and :func:`broadcast` sends rank 0's objects to the others. How such a run ends when part of
it goes away: :func:`leave_with_launcher` (torchrun's launcher died), :func:`peer_lost` (another
process died during a collective), and which process prints a usage error
(:func:`prints_usage_errors`, :class:`RankUsageError`).
"""

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

__all__ = [
    "RankUsageError",
    "process_rank",
    "prints_usage_errors",
    "outwait_printer",
    "check_device",
    "join_processes",
    "check_shards",
    "broadcast",
    "peer_lost",
    "leave_with_launcher",
]

_JOINED = threading.Event()  # set once join_processes has joined the process group (leave_with_launcher reads it)
# The parent of this process as soon as it could be read: under torchrun, the launcher's agent
# (unless it died before this module was imported; see leave_with_launcher).
_PARENT_AT_IMPORT = os.getppid()


class RankUsageError(UsageError):
    """A usage error that this process alone meets under torchrun (the GPU its LOCAL_RANK names): it prints it, naming its rank.

    Any other UsageError is one that every process of a machine meets alike (the same flags,
    files, environment and devices), which one process per machine prints
    (:func:`prints_usage_errors`); this one would be lost if its process stayed silent.
    """


def process_rank() -> int:
    """This process's rank under torchrun (0 alone): the process group's, or before it exists torchrun's RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def prints_usage_errors() -> bool:
    """Whether this process prints the usage errors that every process meets alike: the first of each machine.

    One process per machine, not rank 0 alone: each machine's torchrun shows only its own
    processes' output, and a machine may meet an error that rank 0's does not (a --config or
    --data path missing there). With one machine (``--standalone``) that is rank 0 alone.
    """
    local = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))  # LOCAL_RANK: torchrun's; RANK: other launchers
    return local == "0"


PRINTER_PATIENCE_S = 30.0  # how long a process that leaves a usage error to another to print waits for it


def outwait_printer() -> None:
    """Waits for torchrun to end this process (SIGTERM, or Ctrl-C), for :data:`PRINTER_PATIENCE_S` at most; then SystemExit(2).

    For a process that leaves a usage error to the one that prints it (:func:`prints_usage_errors`).
    torchrun ends every other process as soon as one exits with an error: if this one exited
    first, the process that prints the error could be ended before it printed it (on a busy
    machine it may still be importing torch). Under any other launcher, returns at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(2)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    time.sleep(PRINTER_PATIENCE_S)


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
    if _store_gone():
        raise Terminated  # as the SIGTERM that the launcher's death would have sent
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


def _store_gone() -> bool:
    """Whether nothing listens where torchrun's agent keeps the run's store (MASTER_ADDR:MASTER_PORT): the agent died.

    The agent opens its store before it starts the processes, so a refused connection means it
    has ended, maybe before :func:`leave_with_launcher` could see it. Joining would wait for the
    store up to the group's 30-minute timeout, inside C++ where no signal handler runs.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # (a rank 0 of another launcher opens it)
        return False
    try:
        with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, KeyError, ValueError):  # unreachable for now, or no address: joining says what is wrong
        return False


def check_shards(meta_batch: int, opts: RunOptions) -> None:
    """Raises UsageError when the meta-batch cannot be split into equal shares, one per process (``maml.shard_size``).

    Checked at start-up rather than at the first step.
    """
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


# What gloo's TCP transport says when its connection to another process broke: that process
# ended (killed, crashed, out of memory) or its machine went away. A timeout is not among them:
# a process that hangs has not been seen to end.
_GLOO_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket unexpectedly closed")


def peer_lost(error: BaseException) -> str | None:
    """gloo's reason (e.g. "Connection reset by peer") when ``error`` is a collective's failure because another process ended.

    torch 2.15 raises gloo's failure as a :class:`RuntimeError` (:class:`torch.distributed.DistBackendError`
    is one too) whose message names gloo's source file, the peer's address and the socket error:
    ``[.../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:16774: Connection reset by peer. ...``.
    The errors ``error`` was raised while handling count too: torchrun's SIGTERM to the survivors
    can interrupt the unwinding of the collective's error. Any other error: None.
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

    torchrun starts each process in a session of its own, so a launcher killed by SIGKILL (or
    the out-of-memory killer) passes nothing on: its processes would train on, holding ``--out``,
    with nobody to see their output. On Linux the kernel sends SIGTERM to a process whose
    parent dies once it asks for it (``prctl(PR_SET_PDEATHSIG)``); the process then stops after
    its iteration, with a checkpoint, and exits 143, as after ``kill``. The kernel sends it when
    the thread that started the process ends: torchrun's agent starts its processes from its
    main thread, which lives as long as the agent. Elsewhere (macOS, the BSDs) a daemon thread
    compares the parent's pid with the first one every second (an orphan gets another parent)
    and sends the SIGTERM; Windows gives orphans no other parent, so nothing is done there.

    The parent may have died before the request; the kernel then sends nothing. The parent
    read when this module was imported tells: if it is no longer the parent, this process
    sends itself the SIGTERM. A parent pid of 1 proves nothing by itself: in a container
    torchrun is often PID 1. A launcher that died before that read (while the interpreter
    imported torch: seconds on a busy machine) goes unseen here; :func:`join_processes` then
    finds its store gone, on the machine that held it.

    Python runs a signal handler between bytecodes only, and a process that is joining the
    process group waits inside TCPStore's connect for the store that the launcher held (up to
    the group's 30-minute timeout). So the same thread, seeing the launcher gone and the group
    still not joined :data:`LAUNCHER_GRACE_S` later, ends the process itself: nothing is
    written before the group exists. Call it after installing the SIGTERM handler.
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
