"""How a run ends: Ctrl-C and SIGTERM, the stop that every torchrun process honours after the same iteration, the
end of another process or of torchrun's launcher, and the one line and exit code (:mod:`~experiments.harness.folder`)
each leaves: :func:`main`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from experiments import STARTING, release_start_up_signals
from experiments.harness.folder import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    PR_SET_PDEATHSIG,
    UsageError,
)

__all__ = ["STOP_PATIENCE_S", "Terminated", "catch_stop_signals", "RankUsageError", "process_rank"]
__all__ += ["prints_usage_errors", "outwait_printer", "peer_lost", "leave_with_launcher", "main"]

_JOINED = (
    threading.Event()
)  # set once devices.join_processes has joined the process group (leave_with_launcher reads it)
_PARENT_AT_IMPORT = os.getppid()  # under torchrun, the launcher's agent (unless it died already)


STOP_PATIENCE_S = 20.0  # how long a stop request waits for the running iteration to end


class Terminated(KeyboardInterrupt):
    """A stop by SIGTERM that unwinds at once: as Ctrl-C does, but the script exits with 143 instead of 130."""


def catch_stop_signals(main: bool = True, patience: float | None = None) -> tuple[list[int], Callable[[], None]]:
    """Catches Ctrl-C and SIGTERM: returns the list they are recorded in, and the function that restores the handlers.

    The loop stops after the iteration of the first signal. A second one, or ``patience`` s (:data:`STOP_PATIENCE_S`)
    without the iteration ending, raises KeyboardInterrupt (:class:`Terminated` for SIGTERM) at once. ``main``: says so.
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
        signal.signal(sig, lambda signum, frame: sys.exit(EXIT_USAGE))
    time.sleep(30.0)


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
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() != _PARENT_AT_IMPORT:
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
            os._exit(EXIT_TERMINATED)

    threading.Thread(target=watch, name="leave-with-launcher", daemon=True).start()


_STAGE: list[str] = ["start-up"]  # where fit() is, for the line a stop prints: [stage, --out once known]


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated  # SIGTERM outside the training loop unwinds as Ctrl-C does (atomic writes leave nothing half-done)


def _ending_line(lost: str | None = None) -> str:
    """What a stop (or the end of another process, ``lost`` naming gloo's reason) leaves, and what to run next."""
    stage, *out = _STAGE
    if stage == "start-up":
        if lost is None:
            return STARTING
        left = "before training, nothing to resume: run the same command again (once what ended it is fixed)."
    elif stage == "the final evaluation":
        left = f"training is complete in {out[0]}: the same command plus --resume evaluates it."
    elif (Path(out[0]) / "checkpoint.pt").is_file():  # a stop in training is at once: the last checkpoint is whole
        left = f"the last checkpoint in {out[0]} is whole: the same command plus --resume goes on."
    elif lost is None:
        return "stopped at once, before the first checkpoint: nothing to resume; run the same command again."
    elif process_rank() == 0:
        left = "no checkpoint was written yet: run the same command again."
    else:  # rank 0 writes the checkpoints, maybe on a disk this machine does not see
        left = (
            f"rank 0 keeps the checkpoints in {out[0]} on its machine: the same command plus --resume goes on from "
            f"the last one (without --resume if there is none)."
        )
    if lost is None:
        return f"stopped {'at once' if stage == 'training' else 'during ' + stage}; {left}"
    return (
        f"error (rank {process_rank()}): another process of this torchrun run ended during a collective "
        f"(gloo: {lost}); {left}"
    )


def _leaving() -> None:
    """Ignores Ctrl-C and SIGTERM from here on: this process is already ending (torchrun sends the survivors SIGTERM)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _exit_skipping_teardown(code: int) -> None:
    """Ends a torchrun process now: gloo's threads may still release a collective's tensors, and one that takes the
    GIL during the interpreter's teardown aborts a complete run (SIGABRT; pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(run: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Runs an experiment's entry point: a UsageError is one line and exit code 2, a stop one line and 130 or 143.

    Under torchrun it leaves the process group however the run ends: a collective that fails because another process
    ended is one line and exit code 1; the death of torchrun's launcher stops this process as SIGTERM does.
    """
    together: int | None = None  # the exit code of an end that every rank reaches at the same point
    lost: str | None = None  # gloo's reason, when another process ended during a collective
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        release_start_up_signals()  # Ctrl-C raises KeyboardInterrupt from here on
    sigterm = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        if main_thread and "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent, its parent
            leave_with_launcher()  # (its SIGTERM, if the launcher is gone already, raises Terminated here)
        run(argv)
        together = EXIT_OK
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) outside the training loop, or a second one in it
        lost = peer_lost(e)  # torchrun's SIGTERM, come while a failed collective's error unwound
        if lost is None:
            print(f"\n{_ending_line()}", file=sys.stderr)
            raise SystemExit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED) from None
        _leaving()
    except UsageError as e:
        # Under torchrun one process per machine says an error that all meet alike; one of its own, the process.
        if isinstance(e, RankUsageError):
            print(f"error (rank {process_rank()}): {e}", file=sys.stderr)
        elif prints_usage_errors():
            print(f"error: {e}", file=sys.stderr)
        else:
            outwait_printer()
        raise SystemExit(EXIT_USAGE) from None
    except RuntimeError as e:
        lost = peer_lost(e)
        if lost is None:
            raise
        _leaving()
    except SystemExit as e:
        if e.code in (EXIT_INTERRUPTED, EXIT_TERMINATED):  # the stop that every rank voted for after one iteration
            together = e.code
        raise
    finally:
        if main_thread and lost is None:
            signal.signal(signal.SIGTERM, sigterm)
        if dist.is_available() and dist.is_initialized():
            if together is not None:
                # Ranks > 0 finish before rank 0 (which evaluates and writes): they wait for it, so that
                # no rank tears down its gloo connections while another still uses them.
                try:
                    dist.barrier()
                except RuntimeError as e:
                    reason = peer_lost(e)
                    if reason is None:
                        raise
                    _leaving()
                    if not (together == EXIT_OK and dist.get_rank() == 0):  # rank 0 wrote the results: nothing is lost
                        lost = reason
            if lost is not None:
                print(_ending_line(lost), file=sys.stderr)
            dist.destroy_process_group()
            if lost is not None or together is not None:
                _exit_skipping_teardown(EXIT_FAILED if lost is not None else together)
    if lost is not None:  # (a collective's error comes from a process group: not reached)
        print(_ending_line(lost), file=sys.stderr)
        raise SystemExit(EXIT_FAILED)
