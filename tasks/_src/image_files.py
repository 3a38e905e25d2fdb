"""Reading the files few-shot image data sets come in: pickles (safely), npz arrays, image files.

Each reader returns ``(images, labels, classes)``: ``(N, S, S, 3)`` uint8 images, ``(N,)`` int64
labels in ``0..C-1`` and the ``C`` class names; every failure is a ``ValueError`` of one line
naming the file, the layout that was expected and where the data comes from (``help``).
"""

from __future__ import annotations

import csv
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

Decoded = tuple[np.ndarray, np.ndarray, list[str]]  # (N, S, S, 3) uint8, (N,) int64, class names
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")

# What a data set pickle may build: numpy arrays and the containers around them. Anything else
# (a pickle can run any code as it loads) is refused, so a wrong file is an error and no exploit.
_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),  # how protocol-2 pickles (Python 2 era) store bytes
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("builtins", "set"),
    ("builtins", "bytearray"),
    ("__builtin__", "list"),
    ("copy_reg", "_reconstructor"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("__builtin__", "object"),
}


# The pure-Python unpickler, not the C one: the C unpickler allocates the length a BINBYTES8 (or
# BINUNICODE8, BYTEARRAY8, FRAME) opcode claims before it reads a byte, so 12 bytes claiming 2**62
# end in a MemoryError; the Python one asks its file for the bytes, and _Bounded refuses to read
# more than the file holds. It reads data set pickles about as fast (their time is in the arrays).
class _DataUnpickler(pickle._Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which no image data set holds")
        return super().find_class(module, name)


class _Bounded:
    """A binary file's ``read`` and ``readline`` that refuse to read past its end, before allocating.

    A length field in a pickle can claim any size; one larger than the bytes left is a damaged or
    hostile file, and reading it would allocate the claimed size first.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._left = os.fstat(file.fileno()).st_size - file.tell()

    def read(self, n: int = -1) -> bytes:
        if n > self._left:
            raise pickle.UnpicklingError(f"it asks for {n:,} more bytes where {self._left:,} remain")
        data = self._file.read(n)
        self._left -= len(data)
        return data

    def readline(self) -> bytes:
        line = self._file.readline()
        self._left -= len(line)
        return line


def read_pickle(path: Path, help: str) -> Any:
    """The object in the pickle ``path`` (Python 2 pickles too: their strings are read as latin-1).

    No read is larger than what the file still holds, so a length field claiming more is an error,
    not an allocation; what is built from what the file holds may still exceed the memory (an array
    of 2**40 elements), and that is an error naming the file too.
    """
    try:
        with open(path, "rb") as f:
            return _DataUnpickler(_Bounded(f), encoding="latin1").load()
    except MemoryError:
        size = path.stat().st_size
        raise ValueError(
            f"cannot read the pickle {path}: what it describes needs more memory than this machine has free (the "
            f"file holds {size:,} bytes); a damaged or foreign pickle can describe far more than it holds; {help}"
        ) from None
    # What a damaged file makes the unpickler raise: LookupError for an unknown opcode (a KeyError in the
    # Python unpickler) or encoding, struct.error for a short field, OverflowError for a length past sys.maxsize.
    except (
        pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, LookupError, IndexError,
        OverflowError, struct.error, OSError,
    ) as exc:  # fmt: skip
        raise ValueError(
            f"cannot read the pickle {path} ({exc or type(exc).__name__}): it is truncated or another file; {help}"
        ) from None


def field(payload: Any, keys: Sequence[str], path: Path, help: str) -> Any:
    """``payload[key]`` for the first of ``keys`` present (a Python 2 pickle may key by bytes)."""
    if isinstance(payload, dict):
        for key in keys:
            for k in (key, key.encode()):
                if k in payload:
                    return payload[k]
    have = sorted(str(k) for k in payload) if isinstance(payload, dict) else type(payload).__name__
    raise ValueError(f"{path} holds no {keys[0]!r} (it holds {have}); {help}")


def as_array(value: Any, what: str, help: str) -> np.ndarray:
    """``np.asarray(value)``; lists nested deeper than numpy's 32 dimensions, or ragged, are one line naming ``what``."""
    try:
        return np.asarray(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what}: not a flat list of numbers ({exc}); {help}") from None


def as_images(array: Any, side: int, path: Path, help: str) -> np.ndarray:
    """``array`` checked to be ``(N, side, side, 3)`` uint8 images."""
    array = as_array(array, f"{path}: the images", help)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[1:] != (side, side, 3):
        raise ValueError(
            f"{path} holds images of shape {array.shape} and dtype {array.dtype}, not (N, {side}, {side}, 3) "
            f"uint8; {help}"
        )
    return array


def relabel(raw: Sequence[Any], names: dict[Any, str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Labels of any values as ``0..C-1`` in sorted order of the values, and each class's name."""
    values, labels = np.unique(np.asarray(raw), return_inverse=True)
    classes = [names.get(v, str(v)) if names else str(v) for v in values.tolist()]
    return labels.astype(np.int64).reshape(-1), classes


def read_npz(path: Path, key: str, help: str) -> np.ndarray:
    """The array ``key`` of the npz archive ``path`` (no pickled objects allowed)."""
    try:
        # The file opened here, so that it is closed when numpy fails on a truncated archive (np.load(path) leaks it).
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as archive:
            if key not in archive.files:
                raise ValueError(f"{path} holds no {key!r} array (it holds {archive.files}); {help}")
            return archive[key]
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(
            f"cannot read the npz archive {path} ({exc}): it is truncated or another file; {help}"
        ) from None
    except (OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"cannot read the npz archive {path} ({exc}): it is truncated or another file; {help}"
        ) from None


_SIDES = "CIFAR-FS and FC100 are 32x32, mini-ImageNet and tieredImageNet 84x84 (or larger originals, resized)"


def decode(blob: bytes, side: int, where: str, help: str, exact: bool = False) -> np.ndarray:
    """One encoded image as ``(side, side, 3)`` uint8 RGB, resized with Lanczos if it is larger.

    Lanczos is what cbfinn/maml's ``data/miniImagenet/proc_images.py`` resizes the originals with.
    An image smaller than ``side`` both ways, or of another size when ``exact`` (CIFAR's 32x32), is
    another data set's: mini-ImageNet's 84-pixel images would otherwise train as CIFAR-FS shrunk to 32.
    """
    try:
        with Image.open(io.BytesIO(blob)) as im:
            w, h = im.size
            if (w != side or h != side) if exact else (w < side and h < side):
                raise _WrongSize(
                    f"{where} is {w}x{h} pixels, not {side}x{side}{'' if exact else ' or larger'}: the folder holds "
                    f"another data set's images ({_SIDES}); read it as the data set it holds; {help}"
                )
            rgb = im.convert("RGB")
            if rgb.size != (side, side):
                rgb = rgb.resize((side, side), Image.Resampling.LANCZOS)
            return np.asarray(rgb, dtype=np.uint8)
    except _WrongSize as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - PIL reports broken images as OSError, SyntaxError, ...
        raise ValueError(f"cannot decode the image {where} ({exc}): the file is corrupt or truncated; {help}") from None


class _WrongSize(Exception):
    pass


def decode_all(
    jobs: Sequence[tuple[str, Callable[[], bytes]]], side: int, help: str, exact: bool = False
) -> np.ndarray:
    """Every ``(where, read bytes)`` job decoded into one ``(N, side, side, 3)`` array, on a few threads."""
    out = np.empty((len(jobs), side, side, 3), dtype=np.uint8)

    def run(start: int) -> None:
        for i in range(start, min(start + 256, len(jobs))):
            where, read = jobs[i]
            out[i] = decode(read(), side, where, help, exact)

    # PIL releases the GIL while it decodes and resizes; threads cost no start-up.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for done in [pool.submit(run, s) for s in range(0, len(jobs), 256)]:
            done.result()
    return out


def class_folders(folder: Path) -> list[Path]:
    """The class folders under a split folder (hidden ones skipped), sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))


def folder_images(split: Path) -> list[tuple[int, Path]]:
    """``(class index, image file)`` of every image under ``split/<class>/``, classes and files sorted by name."""
    return [(c, p) for c, folder in enumerate(class_folders(split)) for p in image_files(folder)]


def read_folders(split: Path, side: int, help: str, exact: bool = False) -> Decoded:
    """``split/<class>/<image>``: a folder per class (cbfinn/maml's and MAML++'s layout); ``exact``: as :func:`decode`."""
    folders = class_folders(split)
    files = folder_images(split)
    empty = [f.name for f in folders if not image_files(f)]
    if not folders or empty:
        what = f"class folders without images ({', '.join(empty[:3])})" if empty else "no class folder"
        raise ValueError(f"{split} has {what}; {help}")
    images = decode_all([(str(p), p.read_bytes) for _, p in files], side, help, exact)
    return images, np.array([c for c, _ in files], dtype=np.int64), [f.name for f in folders]


def csv_rows(csv_path: Path, help: str) -> list[tuple[str, str]]:
    """The ``(filename, label)`` rows of Ravi and Larochelle's ``<split>.csv``, each image once.

    A UTF-8 byte-order mark (as spreadsheets write one) is skipped.
    """
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {csv_path} ({exc}); {help}") from None
    body = [(line, r) for line, r in enumerate(rows[1:], start=2) if r]
    if not rows or [c.strip() for c in rows[0][:2]] != ["filename", "label"]:
        first = ",".join(rows[0]) if rows else ""
        raise ValueError(f"{csv_path} begins with {first[:80]!r}, not the header 'filename,label'; {help}")
    short = [(line, r) for line, r in body if len(r) < 2 or not r[0].strip() or not r[1].strip()]
    if short:
        line, r = short[0]
        cut = " (the last row: the file is cut short; copy it again)" if line == body[-1][0] else ""
        raise ValueError(
            f"{csv_path}: row {line} is {','.join(r)[:80]!r}, not 'filename,label'{cut}; {len(short)} such rows; {help}"
        )
    if not body:
        raise ValueError(f"{csv_path} lists no image; {help}")
    # An image listed twice could be the support and the query image of one task.
    first: dict[str, tuple[int, str]] = {}
    for line, (name, label, *_) in body:
        if name in first:
            seen, before = first[name]
            classes = f"class {label}" if before == label else f"classes {before} and {label}"
            raise ValueError(
                f"{csv_path} lists {name} twice, in rows {seen} and {line} ({classes}); an image is listed once; {help}"
            )
        first[name] = (line, label)
    return [(r[0], r[1]) for _, r in body]


def read_csv_split(csv_path: Path, images: Path, side: int, help: str) -> Decoded:
    """Ravi and Larochelle's ``<split>.csv`` (``filename,label`` with a header) of files in ``images/``."""
    body = csv_rows(csv_path, help)
    missing = [r[0] for r in body if not (images / r[0]).is_file()]
    if missing:
        raise ValueError(f"{csv_path} lists {len(missing)} images missing from {images} (first: {missing[0]}); {help}")
    labels, classes = relabel([r[1] for r in body])
    decoded = decode_all([(str(images / r[0]), (images / r[0]).read_bytes) for r in body], side, help)
    return decoded, labels, classes
