"""How a run ends, owned by one object, :class:`Lifecycle`: Ctrl-C and SIGTERM, the stop that every torchrun process
honours after the same iteration (:func:`catch_stop_signals`), the end of another process or of torchrun's launcher,
the folder lock, the stage a stop interrupts, and the one line and exit code (:mod:`~experiments.harness.folder`)
each leaves. Nothing here is installed when the module is imported, and it imports no torch until a run needs it:
a script calls :func:`catch_start_up_stops` before importing torch, and :func:`main` runs it in a Lifecycle.
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
from types import TracebackType
from typing import Any

from experiments.harness.folder import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    PR_SET_PDEATHSIG,
    FolderLock,
    UsageError,
    exit_code,
)

__all__ = ["STOP_PATIENCE_S", "STARTING", "Terminated", "catch_start_up_stops", "catch_stop_signals", "Lifecycle"]
__all__ += ["RankUsageError", "process_rank", "prints_usage_errors", "outwait_printer", "peer_lost", "main"]

STOP_PATIENCE_S = 20.0  # how long a stop request waits for the running iteration to end
LAUNCHER_GRACE_S = 5.0  # how long a process whose launcher died may take to stop by its SIGTERM handler
STARTING = "stopped during start-up, before training: nothing to resume; run the same command again."


class Terminated(KeyboardInterrupt):
    """A stop by SIGTERM that unwinds at once: as Ctrl-C does, but the script exits with 143 instead of 130."""


class RankUsageError(UsageError):
    """A usage error that this process alone meets under torchrun (its GPU): it prints it, where one process per
    machine prints the errors that all meet alike."""


def _group() -> Any:
    """``torch.distributed`` in a process group (torchrun's, once joined), else None; imported when a run needs it."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


# ---------------------------------------------------------------------- start-up


class _StartUp:
    """The handler of Ctrl-C and SIGTERM while a script imports torch: one line, and the exit code, at once (nothing
    is written yet; no traceback to unwind). It keeps the parent's pid read as the script started (torchrun's
    launcher, unless it died already), which the :class:`Lifecycle` taking the signals over reads."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def __call__(self, signum: int, frame: Any) -> None:
        print(f"\n{STARTING}", file=sys.stderr, flush=True)
        os._exit(exit_code(signum))


def catch_start_up_stops() -> None:
    """Called by a script run as such (``if __name__ == "__main__"``) before it imports torch: a Ctrl-C or SIGTERM
    during the seconds that takes is one line. A signal that is ignored (nohup, ``&``) stays ignored."""
    handler = _StartUp()
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, handler)


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


def process_rank() -> int:
    """This process's rank under torchrun (0 alone): the process group's, or before it exists torchrun's RANK."""
    return dist.get_rank() if (dist := _group()) is not None else int(os.environ.get("RANK", "0"))


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


# ---------------------------------------------------------------------- the run


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated  # SIGTERM outside the training loop unwinds as Ctrl-C does (atomic writes leave nothing half-done)


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


class Lifecycle:
    """One run from its start to its exit code, as a context: ``with Lifecycle() as life: ...``.

    It holds what decides how the run ends: the signals (SIGTERM unwinds as Ctrl-C does, :class:`Terminated`), the
    folder lock of ``--out`` (:attr:`lock`), the stage a stop interrupts (:meth:`training`, :meth:`evaluating`),
    under torchrun the launcher's pid and whether the process group is joined. Leaving the context turns how the
    block ended into one line and an exit code (``SystemExit``): a UsageError 2, a stop 130 or 143, a collective
    that failed because another process ended 1; under torchrun it leaves the process group however the run ends.
    """

    def __init__(self) -> None:
        held = signal.getsignal(signal.SIGTERM)
        # torchrun's agent, read as the script started (before importing torch) where catch_start_up_stops ran.
        self.parent = held.parent if isinstance(held, _StartUp) else os.getppid()
        self.lock = FolderLock()  # --out is this run's until it ends
        self.joined = threading.Event()  # set once the process group is joined (the launcher's watch reads it)
        self.stage = "start-up"
        self.out: Path | None = None
        self.main_thread = threading.current_thread() is threading.main_thread()
        self._sigterm: Any = None

    def training(self, out: Path) -> None:
        """From here a stop is at once, and leaves the last checkpoint in ``out``."""
        self.stage, self.out = "training", out

    def evaluating(self) -> None:
        """Training is complete: a stop leaves it to ``--resume`` to evaluate."""
        self.stage = "the final evaluation"

    def __enter__(self) -> Lifecycle:
        if self.main_thread:
            for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
                if isinstance(signal.getsignal(sig), _StartUp):  # Ctrl-C raises KeyboardInterrupt from here on
                    signal.signal(sig, default)
            self._sigterm = signal.signal(signal.SIGTERM, _terminated)
        return self

    def leave_with_launcher(self) -> None:
        """Makes the death of this process's parent, torchrun's agent, stop it as ``kill`` (SIGTERM) does.

        torchrun starts each process in a session of its own: a launcher killed by SIGKILL passes nothing on, and its
        processes would train on, holding ``--out``. On Linux the kernel sends SIGTERM (``prctl(PR_SET_PDEATHSIG)``);
        elsewhere a thread polls the parent's pid. A parent that died before the request (the kernel sends nothing
        then) is seen by the pid read as the script started, :attr:`parent` (not by a pid of 1: in a container,
        torchrun is often PID 1). The thread also ends a process still joining the group (inside C++, where no signal
        handler runs) :data:`LAUNCHER_GRACE_S` later. Call it after installing the SIGTERM handler.
        """
        linux = sys.platform.startswith("linux")
        if linux:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() != self.parent:
                os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before the request
        elif os.name != "posix":
            return

        def watch() -> None:
            while os.getppid() == self.parent:
                time.sleep(1.0)
            if not linux:  # (on Linux the kernel has sent it)
                signal.raise_signal(signal.SIGTERM)  # the main thread runs the handler
            time.sleep(LAUNCHER_GRACE_S)
            if not self.joined.is_set():  # stuck joining: no handler can run
                print(f"\n{STARTING}", file=sys.stderr, flush=True)
                os._exit(EXIT_TERMINATED)

        threading.Thread(target=watch, name="leave-with-launcher", daemon=True).start()

    def ending_line(self, lost: str | None = None) -> str:
        """What a stop (or the end of another process, ``lost`` naming gloo's reason) leaves, and what to run next."""
        stage, out = self.stage, self.out
        if stage == "start-up":
            if lost is None:
                return STARTING
            left = "before training, nothing to resume: run the same command again (once what ended it is fixed)."
        elif stage == "the final evaluation":
            left = f"training is complete in {out}: the same command plus --resume evaluates it."
        elif (Path(str(out)) / "checkpoint.pt").is_file():  # a stop in training is at once: the last one is whole
            left = f"the last checkpoint in {out} is whole: the same command plus --resume goes on."
        elif lost is None:
            return "stopped at once, before the first checkpoint: nothing to resume; run the same command again."
        elif process_rank() == 0:
            left = "no checkpoint was written yet: run the same command again."
        else:  # rank 0 writes the checkpoints, maybe on a disk this machine does not see
            left = (
                f"rank 0 keeps the checkpoints in {out} on its machine: the same command plus --resume goes on from "
                f"the last one (without --resume if there is none)."
            )
        if lost is None:
            return f"stopped {'at once' if stage == 'training' else 'during ' + stage}; {left}"
        return (
            f"error (rank {process_rank()}): another process of this torchrun run ended during a collective "
            f"(gloo: {lost}); {left}"
        )

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        code: int | None = None  # the exit code decided here (None: the block's exception goes on)
        together: int | None = None  # the exit code of an end that every rank reaches at the same point
        lost: str | None = None  # gloo's reason, when another process ended during a collective
        if error is None:
            together = EXIT_OK
        elif isinstance(error, (KeyboardInterrupt, RuntimeError)):
            # Under torchrun, its SIGTERM may come while a failed collective's error unwinds.
            lost = peer_lost(error)
            if lost is not None:
                _leaving()
            elif isinstance(error, KeyboardInterrupt):  # Ctrl-C or SIGTERM outside the loop, or a second one in it
                print(f"\n{self.ending_line()}", file=sys.stderr)
                code = EXIT_TERMINATED if isinstance(error, Terminated) else EXIT_INTERRUPTED
        elif isinstance(error, UsageError):
            # Under torchrun one process per machine says an error that all meet alike; one of its own, the process.
            if isinstance(error, RankUsageError):
                print(f"error (rank {process_rank()}): {error}", file=sys.stderr)
            elif prints_usage_errors():
                print(f"error: {error}", file=sys.stderr)
            else:
                outwait_printer()
            code = EXIT_USAGE
        elif isinstance(error, SystemExit) and error.code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            together = error.code  # the stop that every rank voted for after one iteration
        if self.main_thread and lost is None and self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        self.lock.release()
        if (dist := _group()) is not None:
            self._leave_group(dist, together, lost)
        if lost is not None:  # (a collective's error comes from a process group: not reached)
            print(self.ending_line(lost), file=sys.stderr)
            code = EXIT_FAILED
        if code is not None:
            raise SystemExit(code) from None

    def _leave_group(self, dist: Any, together: int | None, lost: str | None) -> None:
        """Leaves the process group; an end the ranks reach together, or another process's, ends this one here."""
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
            print(self.ending_line(lost), file=sys.stderr)
        dist.destroy_process_group()
        if lost is not None or together is not None:
            _exit_skipping_teardown(EXIT_FAILED if lost is not None else together)


def main(run: Callable[[Sequence[str] | None, Lifecycle], None], argv: Sequence[str] | None = None) -> None:
    """Runs a script's entry point ``run(argv, life)`` in a :class:`Lifecycle`: a UsageError is one line and exit
    code 2, a stop one line and 130 or 143. Under torchrun the death of the launcher stops it as SIGTERM does, and an
    error no line explains (a bug, a CUDA fault) is the failing rank's report in torchrun's summary (``record``)."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # started by torchrun's agent, its parent

    def lifecycle() -> None:
        with Lifecycle() as life:
            if life.main_thread and torchrun:
                life.leave_with_launcher()  # (its SIGTERM, if the launcher is gone already, raises Terminated here)
            run(argv, life)

    if not torchrun:
        return lifecycle()
    from torch.distributed.elastic.multiprocessing.errors import record

    record(lifecycle)()
