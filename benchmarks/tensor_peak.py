"""The peak of live tensor bytes while a function runs: what a step needs, not what the heap keeps.

On a GPU it is ``torch.cuda.max_memory_allocated`` over the memory allocated before the call.
On the CPU PyTorch keeps no allocation statistics, so the call runs under ``torch.profiler``
with ``profile_memory=True``, whose trace holds one memory event per allocation (``+bytes``) and
per free (``-bytes``) of a block allocated while it records, in order: their running sum is the
bytes of the tensors allocated during the call and alive at that moment, and its maximum the peak
(the GPU's figure differs only by blocks allocated before the call and freed during it, which
lower it there and not here: a step that frees last step's gradients). The events are read from
the profiler's event tree with their addresses (``maml._src.planner.measure``), so that a free
counts only for a block the call allocated: the allocator also reports frees of blocks it saw
allocated under an earlier profile. (``export_memory_timeline`` infers lifetimes from the
operator graph and overcounts under ``torch.func``'s forward mode by ten times.)

Peak RSS (VmHWM) counts what glibc keeps after tensors are freed and where fragmentation puts
them, so two modes can differ in RSS by more than they differ in tensors; the benchmarks report
it beside this figure, never instead. The profiler slows the call: time steps in runs of their own.

A memory budget is held to an exact count the engine does not use, of the allocator's blocks
themselves (``benchmarks/blocks.py``); the two agree to the byte on the steps tried
(``tests/tools/test_blocks.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from maml._src.planner import peak_bytes

__all__ = ["peak_tensor_bytes"]


def peak_tensor_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs ``fn()`` and returns the peak of the bytes of tensors it allocated on ``device`` that were alive at once.

    The engine's own measure (its memory planner's, ``maml._src.planner.peak_bytes``), so that a
    benchmark and a plan count the same bytes.
    """
    return peak_bytes(fn, torch.device(device))
