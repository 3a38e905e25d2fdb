"""The peak of live tensor bytes while a function runs: what a step needs, not what the heap keeps.

On a GPU it is ``torch.cuda.max_memory_allocated`` over the memory allocated before the call.
On the CPU PyTorch keeps no allocation statistics, so the call runs under ``torch.profiler``
with its memory events, and the peak is the largest sum of its memory timeline's categories
(``export_memory_timeline``): every tensor allocated during the call, from its allocation to
its free, and nothing allocated before it (parameters, data). Peak RSS (VmHWM) counts what glibc
keeps after tensors are freed and where fragmentation puts them, so two modes can differ in RSS
by more than they differ in tensors; the benchmarks report it beside this figure, never instead.

The profiler slows the call down (it records every operator and its stack): time a step in a
separate run, never under this measure.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["peak_tensor_bytes"]


def peak_tensor_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs ``fn()`` and returns the peak of the bytes of tensors it allocated on ``device`` that were alive at once."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"device={device}: the tensor peak is measured on the CPU or a CUDA GPU.")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        # Deprecated in favour of CUDA's memory snapshots, which do not exist on the CPU.
        warnings.simplefilter("ignore", FutureWarning)
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return int(max((sum(s) for s in sizes), default=0))
