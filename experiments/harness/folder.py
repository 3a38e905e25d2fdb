"""What every part of a run shares, and the sweep imports without torch: :class:`UsageError` and the exit codes,
the run's file names, atomic writes (a kill never leaves half a file, a full disk is one line), and the folder lock.

The lock is ``flock`` on the folder itself, which the kernel drops however its holder dies (SIGKILL too), so a dead
run's folder is taken over by the next. By hand, not ``filelock``: that library locks a file it leaves inside the
folder and cannot lock a folder (``IsADirectoryError``). A :class:`FolderLock` is held by its owner (a run's
lifecycle, the sweep runner), not by the module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["UsageError", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "exit_code"]
__all__ += ["BEST_FILE", "RUN_FILES", "METRICS_FILE", "PLOTS", "atomic_write", "writing", "FolderLock", "lock_holder"]
__all__ += ["PR_SET_PDEATHSIG"]

# The exit codes of every script, the sweep runner's included: the one place they are defined.
EXIT_OK = 0
EXIT_FAILED = 1  # training diverged; another torchrun process ended; every trial of a sweep failed
EXIT_USAGE = 2  # bad input (flags, config file, data, --out): one ``error:`` line, nothing written
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C (a run stopped with a whole checkpoint, resumable)
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM (kill, a cluster's pre-emption), as Ctrl-C


def exit_code(signum: int) -> int:
    """The exit code of a stop by the signal ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED


class UsageError(Exception):
    """Bad input from the user: the script prints the message and exits with code 2 (:data:`EXIT_USAGE`)."""


BEST_FILE = "best.pt"  # the meta-parameters of the best validation so far (Trainer.select)
RUN_FILES = ("config.yaml", "checkpoint.pt", BEST_FILE, "results.json")
METRICS_FILE = "metrics.jsonl"  # every logged row, one JSON object a line, as the checkpoint's history
PLOTS = ("learning_curves.png", "sine_fit.png", "task_grid.png")  # the PNG plots the scripts write
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>: a child (a run, a sweep's trial) stopped as its parent dies


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


class FolderLock:
    """The folders one owner holds (a run's lifecycle, the sweep runner) until :meth:`release` or the end of a
    ``with`` block; the kernel gives them back however the process dies."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}  # the folders held, and the descriptors that hold them

    def take(self, folder: Path) -> None:
        """Makes the existing ``folder`` this owner's (idempotent); another live process holding it: UsageError."""
        folder = folder.resolve()
        if folder in self._held:
            return
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return  # a file system without flock: no lock, as before
            holder = lock_holder(folder)
            by = f"process {holder}" if holder else "another process"
            raise UsageError(
                f"--out {folder} is in use by {by}, still running there; wait for it to end, stop it, or pass "
                f"another --out."
            ) from None
        os.set_inheritable(fd, False)
        self._held[folder] = fd

    def release(self) -> None:
        """Gives back every folder held: the run ended, the process goes on (tests, notebooks)."""
        while self._held:
            os.close(self._held.popitem()[1])

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(folder: Path) -> int | None:
    """The PID holding a ``flock`` on ``folder``, from ``/proc/locks`` (Linux); None where that cannot tell."""
    try:
        st = folder.stat()
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and fields[-3] == inode:
                return int(fields[-4])
    except (OSError, ValueError, IndexError):
        pass
    return None
