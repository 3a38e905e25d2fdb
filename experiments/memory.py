"""Whether a run's tensors can fit in memory, checked before anything is written: a size flag set far too high ends
in one line, not a traceback. Each :class:`Need` is a lower bound every mode reaches: a refused run cannot fit.
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
    """The bytes of the parameters of ``build()``, built on the meta device; None where the sizes overflow."""
    try:
        with torch.device("meta"):
            net = build()
    except RuntimeError as e:
        if "overflow" in str(e):
            return None
        raise
    return sum(p.numel() * p.element_size() for p in net.parameters())


def free_bytes(device: torch.device) -> int | None:
    """The GPU's free memory, or the host's available memory and free swap (Linux); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


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
