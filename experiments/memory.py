"""Whether a run's tensors can fit in memory: lower bounds on what it allocates, checked before anything is written.

A size flag set far too high (``--hidden``, ``--meta-batch``, ``--filters``, ... at 10^12) would
otherwise end in the allocator's traceback after ``config.yaml`` is written, or deep in the
first iteration. Each experiment lists what it must hold at one moment (:class:`Need`: the
parameters' copies, a meta-batch's inputs, the validation and test tasks), each a lower bound
that every mode and batching reaches; :func:`check_fits` refuses a run when one of them alone
exceeds the memory the device has free. Bounds, not estimates: a run that passes can still run
out of memory (activations, the graph of several steps), but a refused run cannot fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from experiments.cli import UsageError

__all__ = ["Need", "parameter_bytes", "free_bytes", "check_fits", "FLOAT_BYTES"]

FLOAT_BYTES = 4  # float32, the experiments' dtype


@dataclasses.dataclass(frozen=True)
class Need:
    """Memory a run holds at one moment: what it is, the flags it grows with, and at least how many bytes."""

    what: str  # e.g. "the training meta-batch's images"
    flags: str  # e.g. "--meta-batch, --ways, --shots, --query"
    bytes: int | None  # None: more than PyTorch can count (sizes whose product overflows)


def parameter_bytes(build: Callable[[], nn.Module]) -> int | None:
    """The bytes of the parameters of the network ``build()`` makes, built on the meta device (no memory).

    None: the sizes overflow what PyTorch can count (a tensor of more than 2^63 elements).
    """
    try:
        with torch.device("meta"):
            net = build()
    except RuntimeError as e:
        if "overflow" in str(e):
            return None
        raise
    return sum(p.numel() * p.element_size() for p in net.parameters())


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device``: the GPU's free memory, or the host's available memory and free swap (Linux).

    None where it cannot be read (then nothing is refused).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def check_fits(needs: Sequence[Need], device: torch.device) -> None:
    """Raises UsageError naming the flags of the largest need when it exceeds ``device``'s free memory."""
    free = free_bytes(device)
    if free is None or not needs:
        return
    worst = max(needs, key=lambda n: float("inf") if n.bytes is None else n.bytes)
    if worst.bytes is not None and worst.bytes <= free:
        return
    amount = "more than PyTorch can count" if worst.bytes is None else f"at least {_size(worst.bytes)}"
    which = "the one set too high" if ", " in worst.flags else "it"
    where = "this machine" if device.type == "cpu" else str(device)
    raise UsageError(
        f"{worst.flags}: {worst.what} need {amount}, and {where} has {_size(free)} of memory free; lower {which}."
    )
