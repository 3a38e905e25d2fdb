"""An on-disk cache of decoded tensors.

Where: an explicit folder if given; else ``$MAML_CACHE_DIR`` if set (and then only there, so a
shared or version-controlled data folder is never written into); else a ``.maml-cache`` folder
next to the data if writable, else ``$XDG_CACHE_HOME/maml-toolkit`` or ``~/.cache/maml-toolkit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

CACHE_ENV = "MAML_CACHE_DIR"
_NEXT_TO_DATA = ".maml-cache"
# Up to this many bytes of data files, a cache key hashes their content; above, their status-change
# times stand in for it. Hashing reads every byte: 256 MiB is about 0.2-0.5 s (a mini-ImageNet split of
# proc_images.py's JPEGs is ~120 MB, CIFAR-FS's ~100 MB, Omniglot ~15 MB), where tieredImageNet's 12 GB,
# mini-ImageNet's 0.8 GB pickles or full-size images would take minutes. A file's digest is kept (``memo``)
# under what stat() says of it, so a later load reads only the files changed since.
HASH_LIMIT = 256 * 2**20
_HASH_CHUNK = 64  # files per hashing job: enough to amortise the thread pool's overhead


def fingerprint(root: Path, paths: Sequence[Path], digests: Digests | None = None) -> dict[str, Any]:
    """What a cache decoded from the files ``paths`` (under ``root``) is keyed on.

    Every file's path relative to ``root`` (so a moved image or a renamed class folder changes the key),
    its size and modification time, and then

    - when the files hold at most :data:`HASH_LIMIT` bytes, a SHA-256 of each file's content: a file
      replaced by another of the same size with its time kept (``cp -p``, ``rsync -a``) changes the key;
    - else each file's status-change time (``st_ctime``), which the kernel sets on every write and
      rename and nothing can set back, so the same replacements change the key without reading the
      data; a ``chmod`` or ``chown`` changes it too, and costs one decoding.

    ``digests``: the digests of an earlier load (:class:`Digests`): a file whose device, inode, size,
    modification and status-change times are those it was hashed at is not read again.

    Returns:
        A JSON-serialisable summary: the number of files and bytes, ``"by"`` (``"content"`` or
        ``"ctime"``), the digest, and ``"content"``: a digest of the relative paths, sizes and
        contents alone (no times: the same files copied elsewhere have it too), ``None`` by ``ctime``.
    """
    listed = sorted((_relative(p, root), p) for p in paths)
    stats = [p.stat() for _, p in listed]
    total = sum(st.st_size for st in stats)
    by_content = total <= HASH_LIMIT
    extra = _digests([p for _, p in listed], stats, digests) if by_content else [str(st.st_ctime_ns) for st in stats]
    digest, content = hashlib.sha256(), hashlib.sha256()
    for (name, _), st, more in zip(listed, stats, extra):
        # NUL cannot be in a file name: the fields of a line cannot run into each other.
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{more}\n".encode("utf-8", "surrogateescape"))
        content.update(f"{name}\0{st.st_size}\0{more}\n".encode("utf-8", "surrogateescape"))
    return {
        "files": len(listed),
        "bytes": total,
        "by": "content" if by_content else "ctime",
        "digest": digest.hexdigest(),
        "content": content.hexdigest() if by_content else None,
    }


def _relative(path: Path, root: Path) -> str:
    """``path.relative_to(root).as_posix()``, by the strings where they allow (relative_to is slow on 60,000)."""
    text, prefix = str(path), str(root).rstrip(os.sep) + os.sep
    return text[len(prefix) :] if os.sep == "/" and text.startswith(prefix) else path.relative_to(root).as_posix()


class Digests:
    """The SHA-256s of data files, kept in a file beside the cache under what stat() says of each file.

    The kernel sets a file's status-change time on every write and rename and nothing sets it back, so
    a file whose device, inode, size, modification and status-change times are those it was hashed at
    holds what it held: it is not read again. A file stat() cannot vouch for (touched, chmod-ed, copied,
    written) is hashed, and its content decides.

    Args:
        paths: where the digests may be kept, best first: the first readable is read, and :meth:`save`
            writes the first whose folder accepts it.
    """

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self.known: dict[str, str] = {}
        for path in self.paths:  # a missing, unreadable or foreign file is none kept
            try:
                known = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(known, dict) and all(isinstance(v, str) for v in known.values()):
                self.known = known
                break
        self.changed = False

    def save(self) -> Path | None:
        """Writes the digests if they changed, whole or not at all; the file written, else ``None``."""
        if not self.changed:
            return None
        for path in self.paths:
            if not _writable(path.parent):
                continue
            tmp = None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
                with os.fdopen(fd, "w") as f:
                    json.dump(self.known, f)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
                self.changed = False
                return path
            except OSError:  # not kept: the next load hashes again
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
        return None


def _digests(paths: list[Path], stats: list[os.stat_result], digests: Digests | None) -> list[str]:
    """The SHA-256 of each file: kept in ``digests`` under its stat, else read on a few threads (reading and
    hashing release the GIL); ``digests`` then holds these files' digests, and no others."""
    keys = [f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}" for st in stats]
    known = digests.known if digests is not None else {}
    out = [known.get(key, "") for key in keys]
    todo = [i for i, digest in enumerate(out) if not digest]

    def run(start: int) -> None:
        for i in todo[start : start + _HASH_CHUNK]:
            digest = hashlib.sha256()
            with open(paths[i], "rb") as f:
                while chunk := f.read(1 << 20):  # a pickle of 200 MB is not held whole
                    digest.update(chunk)
            out[i] = digest.hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for done in [pool.submit(run, s) for s in range(0, len(todo), _HASH_CHUNK)]:
            done.result()
    if digests is not None and (todo or len(known) != len(keys)):  # files hashed, or gone since
        digests.known, digests.changed = dict(zip(keys, out)), True
    return out


def user_cache_dir() -> Path:
    """``$MAML_CACHE_DIR``, else ``$XDG_CACHE_HOME/maml-toolkit``, else ``~/.cache/maml-toolkit``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "maml-toolkit"


def candidates(data_dir: Path, cache_dir: str | os.PathLike[str] | None) -> list[Path]:
    """Folders to look for and write the cache in, best first.

    Args:
        data_dir: the folder the data lies in.
        cache_dir: an explicit folder (then the only candidate), or ``None``: then
            ``$MAML_CACHE_DIR`` when set (the only candidate too), else a ``.maml-cache``
            folder next to the data, then :func:`user_cache_dir`.
    """
    if cache_dir is not None:
        return [Path(cache_dir).expanduser()]
    if os.environ.get(CACHE_ENV):
        # Setting the variable says where the cache belongs: the data folder may be shared or
        # under version control, so it is not written into even when the variable's folder fails.
        return [user_cache_dir()]
    return [data_dir / _NEXT_TO_DATA, user_cache_dir()]


def load(
    folders: list[Path], name: str, validate: Callable[[Any], bool], *, mmap: bool = False
) -> tuple[Any, Path] | None:
    """The first readable, valid cache file ``name`` in ``folders`` and its path, else ``None``.

    ``mmap``: map the file's tensors into memory instead of reading them (pages are read when
    touched, and processes reading the same file share them): for caches of gigabytes.

    An unreadable or invalid file (truncated, from another version, tampered with) is a miss,
    never an error: the caller decodes again and overwrites it.
    """
    for folder in folders:
        path = folder / name
        if not path.is_file():
            continue
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            if validate(payload):
                return payload, path
        except Exception:  # noqa: BLE001 - any failure to read a cache is a cache miss
            continue
    return None


def save(folders: list[Path], name: str, payload: Any) -> Path | None:
    """Writes ``payload`` as ``name`` in the first folder that accepts it; its path, or ``None``.

    The file is written under a temporary name and renamed into place, so readers (other
    processes too) never see a partial file; a write that fails (a full disk, a file-size limit)
    removes it and tries the next folder.
    """
    for folder in folders:
        if not _writable(folder):
            continue
        tmp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache is shared by the users of the data
            os.replace(tmp, folder / name)
            return folder / name
        # torch.save reports a write that fails mid-file (a disk filling up) as a RuntimeError of its
        # zip writer ("[enforce fail at inline_container.cc] unexpected pos"), not as an OSError.
        except (OSError, RuntimeError):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            continue
    return None


def _writable(folder: Path) -> bool:
    """Whether ``folder`` may be written: neither it nor its parent is marked read-only.

    A folder without any write permission bit (a read-only data set) is respected even
    where the permissions would not stop us, as for root.
    """
    for path in (folder, folder.parent):
        try:
            mode = path.stat().st_mode
        except OSError:
            continue  # not there yet: mkdir decides
        if not mode & 0o222 or not os.access(path, os.W_OK):
            return False
    return True
