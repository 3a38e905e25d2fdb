"""The peak of live tensor bytes while a function runs: what a step needs, not what the heap keeps.

On a GPU it is ``torch.cuda.max_memory_allocated`` over the memory allocated before the call.
On the CPU PyTorch keeps no allocation statistics, so the call runs under ``torch.profiler``
with ``profile_memory=True``, whose trace holds one memory event per allocation (``+bytes``) and
per free (``-bytes``) of a block allocated while it records, in order: their running sum is the
bytes of the tensors allocated during the call and alive at that moment, and its maximum the peak
(the GPU's figure differs only by blocks allocated before the call and freed during it, which
lower it there and not here: a step that frees last step's gradients). The events
are read from the profiler's raw trace (``prof.profiler.kineto_results``), as its own memory
profiler reads them: the public ``events()`` fold an operator's allocations into the operator,
which loses the order of its allocations and frees. (``export_memory_timeline`` infers lifetimes
from the operator graph and overcounts under ``torch.func``'s forward mode by ten times.)

Peak RSS (VmHWM) counts what glibc keeps after tensors are freed and where fragmentation puts
them, so two modes can differ in RSS by more than they differ in tensors; the benchmarks report
it beside this figure, never instead. The profiler slows the call: time steps in runs of their own.

:func:`dispatch_peak_bytes` counts the same bytes another way, below autograd in a dispatch mode (the
storages operators create, until they are freed), so that a test can hold the engine's memory plans
to a measure the engine does not use itself; the two agree to the byte on the steps tried.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from maml._src.planner import peak_bytes

__all__ = ["dispatch_peak_bytes", "peak_tensor_bytes"]


def peak_tensor_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs ``fn()`` and returns the peak of the bytes of tensors it allocated on ``device`` that were alive at once.

    The engine's own measure (its memory planner's, ``maml._src.planner.peak_bytes``), so that a
    benchmark and a plan count the same bytes.
    """
    return peak_bytes(fn, torch.device(device))


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operators create and that are still alive, and their peak.

    A storage is counted when an operator returns a tensor on a storage none of its inputs has (an
    in-place write or a view adds nothing), and uncounted when it is freed (a weak reference's
    callback: PyTorch keeps one Python object per live storage).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.live, self.peak = device, 0, 0
        self._alive: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == self.device and (key := _key(t)) not in given | {None}:
                self._count(t.untyped_storage(), key)
        return out

    def _count(self, storage: torch.UntypedStorage, key: int) -> None:
        if key in self._alive:
            return
        n = storage.nbytes()

        def freed(_: object, key: int = key, n: int = n) -> None:
            self.live -= n
            self._alive.pop(key, None)

        self._alive[key] = weakref.ref(storage, freed)
        self.live += n
        self.peak = max(self.peak, self.live)


def _key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return None


def dispatch_peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs ``fn()`` and returns the peak of the bytes of live tensors it created on ``device``, counted below autograd
    by a dispatch mode (:class:`_LiveBytes`): a measure independent of the profiler's, which the engine plans with."""
    with _LiveBytes(torch.device(device)) as counter:
        fn()
    return counter.peak
