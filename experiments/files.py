"""Writing a run's files: atomically (a kill never leaves half a file), with a full disk reported in one line.

Every file the package writes goes through :func:`atomic_write`, or, for a file appended to, :func:`writing`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from experiments.cli import UsageError

__all__ = ["atomic_write", "writing"]


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turns an OSError while writing ``path`` into a UsageError naming the path and what to do (for a full disk,
    the filesystem's mount point and its free space)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            mount = path.resolve()
            while not os.path.ismount(mount):
                mount = mount.parent
            what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
            raise UsageError(
                f"{what} writing {path}; free space on the filesystem mounted at {mount} "
                f"({_size(shutil.disk_usage(mount).free)} free) or pass another --out."
            ) from None
        raise UsageError(
            f"cannot write {path} ({e.strerror or e}); make --out writable or pass another --out."
        ) from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Writes through a temporary file and a rename, so a kill never leaves a half-written file.

    ``write(tmp)`` writes the content to ``tmp`` (``.NAME.tmpPID`` beside ``path``) with Python's file
    I/O (or anything that raises OSError), so that a full disk is reported as one.

    Raises:
        UsageError: the disk is full or the folder cannot be written (the message names the path
            and, for a full disk, its filesystem); the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # gone after the rename; after a failure, a partial file
