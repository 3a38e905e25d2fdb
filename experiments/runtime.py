"""Where a run computes: its CPU threads, its device, the C++ compiler, and how Ctrl-C and SIGTERM stop it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from experiments.cli import UsageError

__all__ = ["set_threads", "parse_device", "cxx", "catch_stop_signals", "STOP_PATIENCE_S", "Terminated"]


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
