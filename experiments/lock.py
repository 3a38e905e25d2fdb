"""A folder that belongs to one live process: a run's ``--out``, a sweep's folder.

``flock`` on the folder itself, which the kernel drops however its holder dies (SIGKILL too), so a
dead run's folder is taken over by the next. By hand, not ``filelock``: that library locks a file
it leaves inside the folder and cannot lock a folder (``IsADirectoryError``).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from experiments.cli import UsageError

__all__ = ["lock_folder", "unlock_folders", "lock_holder"]

_LOCKS: dict[Path, int] = {}  # the folders this process holds, and the descriptors that hold them


def lock_folder(folder: Path, what: str = "--out") -> None:
    """Makes the existing ``folder`` this process's until it exits (idempotent); another process asking gets a UsageError.

    Raises:
        UsageError: another live process holds the folder.
    """
    folder = folder.resolve()
    if folder in _LOCKS:
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
            f"{what} {folder} is in use by {by}, a run still going; wait for it to end, stop it, or pass another {what}."
        ) from None
    os.set_inheritable(fd, False)
    _LOCKS[folder] = fd


def unlock_folders() -> None:
    """Gives back every folder this process holds (:func:`lock_folder`): its run ended, the process goes on."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])


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
