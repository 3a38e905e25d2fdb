"""The CPU allocator's own blocks, counted exactly: the measure tests and benchmarks hold a memory budget to.

PyTorch's CPU allocator takes every tensor's storage, and the buffers kernels allocate through it
(convolution's columns, a reduction's partial sums), from ``posix_memalign`` with 64-byte alignment,
and keeps no statistics of them. ``blocks.c`` is a wrapper of ``posix_memalign`` and ``free`` that a
process loads before the C library (``LD_PRELOAD``): it records each such block at its requested size
and forgets it when freed, and :func:`peak_block_bytes` reads, over a call, the peak of the bytes of
the blocks allocated during it and alive at once (a block allocated before and freed during the call
lowers nothing). It allocates nothing and changes nothing the process does, unlike a Python dispatch
mode (which changes what autograd accumulates and never sees a kernel's own buffers) or the profiler
(whose memory events read a free of a block from an earlier profile as the call's); the engine plans
with the profiler's events, so this count is independent of the code under test.

A process must start with the library preloaded: :func:`preloaded_env` gives the environment, and
:func:`library` builds it once with the system's C compiler into a cache folder. Known allocation
patterns check the count in ``tests/tools/test_blocks.py``.

    LD_PRELOAD=$(python -m benchmarks.blocks) python -m benchmarks.budgets --json budgets.json

Written by hand: no Python library counts a process's allocator blocks with their lifetimes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["CountUnavailable", "counting", "library", "peak_block_bytes", "preloaded_env"]

_SOURCE = Path(__file__).with_name("blocks.c")


class CountUnavailable(RuntimeError):
    """The count cannot run here: no C compiler, or the process was started without the library preloaded."""


def library() -> Path:
    """The wrapper's shared library, built once per source version into ``$XDG_CACHE_HOME/maml-toolkit``."""
    source = _SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maml-toolkit"
    built = cache / f"blocks-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if built.exists():
        return built
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise CountUnavailable("no C compiler (cc or gcc) to build benchmarks/blocks.c: install one or set CC")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole: a reader never sees half
        partial = Path(tmp) / built.name
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(_SOURCE), "-ldl"], check=True)
        os.replace(partial, built)
    return built


def preloaded_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the library first in ``LD_PRELOAD``, for a process that counts."""
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library()), env.get("LD_PRELOAD", "")]))
    return env


def _counter() -> ctypes.CDLL | None:
    process = ctypes.CDLL(None)
    if not hasattr(process, "blocks_begin"):
        return None
    for name in ("blocks_peak", "blocks_live", "blocks_total", "blocks_overflow"):
        getattr(process, name).restype = ctypes.c_size_t
    return process


def counting() -> bool:
    """Whether this process runs with the library preloaded (:func:`preloaded_env`)."""
    return _counter() is not None


def peak_block_bytes(fn: Callable[[], object]) -> int:
    """Runs ``fn()`` and returns the peak of the bytes of the CPU allocator's blocks it allocated that were alive at once.

    Raises:
        CountUnavailable: the process was not started with the library preloaded.
    """
    lib = _counter()
    if lib is None:
        raise CountUnavailable("this process was started without benchmarks/blocks.c preloaded: run it with "
                               "LD_PRELOAD=$(python -m benchmarks.blocks) or benchmarks.blocks.preloaded_env()")  # fmt: skip
    lib.blocks_begin()
    fn()
    if lib.blocks_overflow():
        raise CountUnavailable("benchmarks/blocks.c's table of live blocks overflowed: raise its SLOTS")
    return int(lib.blocks_peak())


if __name__ == "__main__":  # prints the library's path, for LD_PRELOAD=$(python -m benchmarks.blocks)
    try:
        print(library())
    except (CountUnavailable, subprocess.CalledProcessError) as e:
        print(f"benchmarks.blocks: {e}", file=sys.stderr)
        sys.exit(2)
