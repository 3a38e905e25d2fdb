"""Reading the files few-shot image data sets come in: pickles (safely), npz arrays, image files.

Each reader returns a :class:`Decoded` ``(images, labels, classes)``: ``(N, S, S, 3)`` uint8 images, ``(N,)``
int64 labels in ``0..C-1`` and the ``C`` class names; every failure is a ``ValueError`` of one line
naming the file, the layout that was expected and where the data comes from (``help``).
"""

from __future__ import annotations

import csv
import io
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
from PIL import Image


class Decoded(NamedTuple):
    """What a reader returns: the images, their labels and the classes' names."""

    images: np.ndarray  # (N, S, S, 3) uint8
    labels: np.ndarray  # (N,) int64 in 0..C-1
    classes: list[str]  # the C class names
    # A warning line saying what the names cannot tell (they name no class across the splits); "" when they do.
    unchecked: str = ""


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
# Modes of one channel wider than 8 bits. PIL's convert("RGB") clips them at 255 instead of scaling, so a
# 16-bit image read white. "I" (32-bit) is how Pillow before 10.3 opened 16-bit grayscale PNGs
# (python-pillow/Pillow#7849), so its values are read as 16-bit ones.
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def pil_reason(exc: BaseException) -> str:
    """PIL's reason for refusing an image, without the ``<_io.BytesIO object at 0x...>`` it names an in-memory file by."""
    text = str(exc) or type(exc).__name__
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", text)


def decode(blob: bytes, side: int, where: str, help: str, exact: bool = False) -> np.ndarray:
    """One encoded image as ``(side, side, 3)`` uint8 RGB, resized with Lanczos if it is larger.

    Lanczos is what cbfinn/maml's ``data/miniImagenet/proc_images.py`` resizes the originals with.
    An image smaller than ``side`` both ways, or of another size when ``exact`` (CIFAR's 32x32), is
    another data set's: mini-ImageNet's 84-pixel images would otherwise train as CIFAR-FS shrunk to 32.
    A 16-bit grayscale image (modes ``I;16`` and ``I``) is scaled to 8 bits (``v / 257``, rounded); a
    floating-point one (mode ``F``), whose range no file states, is refused.
    """
    try:
        with Image.open(io.BytesIO(blob)) as im:
            w, h = im.size
            if (w != side or h != side) if exact else (w < side and h < side):
                raise _Refused(
                    f"{where} is {w}x{h} pixels, not {side}x{side}{'' if exact else ' or larger'}: the folder holds "
                    f"another data set's images ({_SIDES}); read it as the data set it holds; {help}"
                )
            rgb = _eight_bit(im, where, help).convert("RGB")
            if rgb.size != (side, side):
                rgb = rgb.resize((side, side), Image.Resampling.LANCZOS)
            return np.asarray(rgb, dtype=np.uint8)
    except _Refused as exc:
        raise ValueError(str(exc)) from None
    except Image.DecompressionBombError as exc:
        raise ValueError(
            f"cannot decode the image {where}: {pil_reason(exc)}; the data sets' images are some hundreds of pixels a "
            f"side: resize it (or remove it) before reading the folder; {help}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - PIL reports broken images as OSError, SyntaxError, ...
        raise ValueError(
            f"cannot decode the image {where} ({pil_reason(exc)}): the file is corrupt or truncated; {help}"
        ) from None


def _eight_bit(im: Image.Image, where: str, help: str) -> Image.Image:
    """``im`` itself, or its 16-bit grayscale values scaled to an 8-bit (mode ``L``) image."""
    if im.mode == "F":
        raise _Refused(
            f"{where} is a floating-point image (PIL mode F), whose range (0-1, 0-255 or other) no file states; "
            f"save it as an 8-bit or 16-bit image; {help}"
        )
    if im.mode not in _WIDE_MODES:
        return im
    values = np.asarray(im).astype(np.int64)
    if values.size and (values.min() < 0 or values.max() > 65535):
        raise _Refused(
            f"{where} is a {im.mode} image with values from {values.min()} to {values.max()}, outside the 0-65535 "
            f"of a 16-bit image; save it as an 8-bit or 16-bit image; {help}"
        )
    return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8))  # 2-D uint8: mode L


class _Refused(Exception):
    pass


def decode_all(
    jobs: Sequence[tuple[str, Callable[[], bytes]]], side: int, help: str, exact: bool = False
) -> np.ndarray:
    """Every ``(where, read bytes)`` job decoded into one ``(N, side, side, 3)`` array, on a few threads."""
    out = np.empty((len(jobs), side, side, 3), dtype=np.uint8)

    def run(start: int) -> None:
        for i in range(start, min(start + 256, len(jobs))):
            where, read = jobs[i]
            try:
                blob = read()
            except OSError as exc:  # a file removed, a link broken or unreadable since it was listed
                raise ValueError(f"{unreadable(Path(exc.filename or where), exc)}; {help}") from None
            out[i] = decode(blob, side, where, help, exact)

    # PIL releases the GIL while it decodes and resizes; threads cost no start-up.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for done in [pool.submit(run, s) for s in range(0, len(jobs), 256)]:
            done.result()
    return out


def unreadable(path: Path, exc: OSError) -> str:
    """Why the file ``path`` cannot be read (``exc``), for a message: a broken link says where it points."""
    if path.is_symlink() and not path.exists():
        return (
            f"{path} is a broken link: it points to {os.readlink(path)}, which does not exist; copy the file it "
            f"pointed to there, or remove the link"
        )
    return f"cannot read {path} ({exc.strerror or exc})"


# What a macOS zip holds beside the files it archived (resource forks, ``._<name>`` files), as a folder.
MACOS_ZIP_FOLDER = "__MACOSX"


def class_folders(folder: Path) -> list[Path]:
    """The class folders under a split folder (hidden ones and macOS's ``__MACOSX`` skipped), sorted by name."""
    return sorted(
        (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != MACOS_ZIP_FOLDER),
        key=_name,
    )


def _name(path: Path) -> str:
    # The order of sorting the paths themselves, within one folder, at a fraction of the cost: comparing Paths
    # took 1.2 s of a warm load of mini-ImageNet's 60,000 images.
    return path.name


def _form(name: str) -> str:
    """The form of a folder name: ``n01532829`` -> ``a99999999``, ``NTR000000`` -> ``AAA999999``."""
    return re.sub(r"[0-9]", "9", re.sub(r"[a-z]", "a", re.sub(r"[A-Z]", "A", name)))


def odd_class_folders(split: Path) -> list[str]:
    """The class folders of ``split`` that look like no class, each with why: a link to a folder above it (a
    loop), a folder without images, or a name of another form than most (``zz`` among WordNet ids)."""
    folders = class_folders(split)
    forms = [_form(p.name) for p in folders]
    common = max(set(forms), key=forms.count) if forms else ""
    odd = []
    for folder, form in zip(folders, forms):
        target = folder.resolve()
        if folder.is_symlink() and (target == split.resolve() or target in split.resolve().parents):
            odd.append(f"{folder.name} (a link to {os.readlink(folder)}, a folder above it)")
        elif not image_files(folder):
            odd.append(f"{folder.name} (no image)")
        elif form != common and forms.count(common) > len(forms) // 2:
            odd.append(f"{folder.name} (named unlike the others, such as {folders[forms.index(common)].name})")
    return odd


def one_file_each(paths: Sequence[Path], help: str) -> None:
    """Refuses two of ``paths`` that are one file (hard links, or links to one image): an image read twice
    could be a task's support and query image, or in two classes at once."""
    seen: dict[tuple[int, int], Path] = {}
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue  # the reader names a file it cannot read
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is not path:
            raise ValueError(
                f"{first} and {path} are one file (hard links, or links to one image): it would be read twice, as "
                f"two images{' of two classes' if first.parent != path.parent else ''}; keep one of them; {help}"
            )


def image_files(folder: Path) -> list[Path]:
    """The image files of ``folder`` (hidden ones skipped), sorted by name."""
    names = sorted(
        n for n in os.listdir(folder) if not n.startswith(".") and os.path.splitext(n)[1].lower() in IMAGE_SUFFIXES
    )
    return [folder / n for n in names]


def folder_images(split: Path) -> list[tuple[int, Path]]:
    """``(class index, image file)`` of every image under ``split/<class>/``, classes and files sorted by name."""
    return [(c, p) for c, folder in enumerate(class_folders(split)) for p in image_files(folder)]


def read_folders(split: Path, side: int, help: str, exact: bool = False) -> Decoded:
    """``split/<class>/<image>``: a folder per class (cbfinn/maml's and MAML++'s layout); ``exact``: as :func:`decode`."""
    folders = class_folders(split)
    files = folder_images(split)
    empty = [
        f.name + (f" (a link to {os.readlink(f)})" if f.is_symlink() else "") for f in folders if not image_files(f)
    ]
    if not folders or empty:
        what = f"class folders without images ({', '.join(empty[:3])})" if empty else "no class folder"
        raise ValueError(f"{split} has {what}; {help}")
    one_file_each([p for _, p in files], help)
    images = decode_all([(str(p), p.read_bytes) for _, p in files], side, help, exact)
    return Decoded(images, np.array([c for c, _ in files], dtype=np.int64), [f.name for f in folders])


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
        first = images / missing[0]
        link = f", a broken link to {os.readlink(first)}" if first.is_symlink() else ""
        raise ValueError(
            f"{csv_path} lists {len(missing)} images missing from {images} (first: {missing[0]}{link}); {help}"
        )
    one_file_each([images / r[0] for r in body], help)
    labels, classes = relabel([r[1] for r in body])
    decoded = decode_all([(str(images / r[0]), (images / r[0]).read_bytes) for r in body], side, help)
    return Decoded(decoded, labels, classes)
