"""What CUB-200-2011, FGVC-Aircraft and VGG Flowers 102 share: Meta-Dataset's class splits over one folder.

The three are published as one archive of images and a label file, not split: the split is a list
of classes (Triantafillou et al. 2020, as learn2learn ships it) kept in each set's module. Each image
is cropped (a bounding box, Aircraft's copyright banner) before it is resized to ``side x side``
with Lanczos, up or down: the originals are some hundreds of pixels a side, a crop may be smaller.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from . import image_files as files
from .image_data import FewShotImages, ImageSplits, _root
from .image_layouts import DataSpec

# A crop of an opened image (its width and height known), or None for the whole image.
Crop = Callable[[int, int], tuple[int, int, int, int]] | None


def decode(blob: bytes, side: int, crop: Crop, where: str, help: str) -> np.ndarray:
    """One encoded image, cropped, as ``(side, side, 3)`` uint8 RGB (grayscale, CMYK, 16-bit: converted)."""
    try:
        with Image.open(io.BytesIO(blob)) as im:
            im.load()
            image = files._eight_bit(im, where, help)
            if crop is not None:
                left, top, right, bottom = crop(*im.size)
                image = image.crop((left, top, right, bottom))
            rgb = image.convert("RGB")
            if rgb.size != (side, side):
                rgb = rgb.resize((side, side), Image.Resampling.LANCZOS)
            return np.asarray(rgb, dtype=np.uint8)
    except files._Refused as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - PIL reports broken images as OSError, SyntaxError, ...
        raise ValueError(
            f"cannot decode the image {where} ({files.pil_reason(exc)}): the file is corrupt or truncated; {help}"
        ) from None


def decode_all(jobs: Sequence[tuple[Path, Crop]], side: int, help: str) -> np.ndarray:
    """Every ``(image file, crop)`` decoded into one ``(N, side, side, 3)`` array, on a few threads."""
    out = np.empty((len(jobs), side, side, 3), dtype=np.uint8)

    def run(start: int) -> None:
        for i in range(start, min(start + 256, len(jobs))):
            path, crop = jobs[i]
            try:
                blob = path.read_bytes()
            except OSError as exc:
                raise ValueError(f"{files.unreadable(path, exc)}; {help}") from None
            out[i] = decode(blob, side, crop, str(path), help)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for done in [pool.submit(run, s) for s in range(0, len(jobs), 256)]:
            done.result()
    return out


def lines(path: Path, fields: int, help: str, what: str) -> list[tuple[int, list[str]]]:
    """The ``(line number, fields)`` of a text file of ``fields`` space-separated fields a line (the last
    field may hold spaces when ``fields`` is 2), blank lines skipped; a short line is one line naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path} ({getattr(exc, 'strerror', None) or exc}); {help}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1) if fields == 2 else line.split()
        if len(parts) != fields:
            raise ValueError(f"{path}: line {number} is {line[:80]!r}, not {what}; {help}")
        rows.append((number, parts))
    if not rows:
        raise ValueError(f"{path} lists nothing; it holds {what} a line; {help}")
    return rows


def numbers(path: Path, number: int, fields: Sequence[str], help: str, what: str) -> list[float]:
    """The fields of a line of ``path`` as numbers (a box's coordinates)."""
    try:
        return [float(f) for f in fields]
    except ValueError:
        raise ValueError(f"{path}: line {number} is {' '.join(fields)[:80]!r}, not {what}; {help}") from None


def box_crop(box: tuple[float, float, float, float], where: str, help: str) -> Crop:
    """The crop of ``box`` (left, top, right, bottom in pixels), clipped to the image; an empty one is refused."""

    def crop(width: int, height: int) -> tuple[int, int, int, int]:
        left, top = max(0, int(box[0])), max(0, int(box[1]))
        right, bottom = min(width, int(box[2])), min(height, int(box[3]))
        if right <= left or bottom <= top:
            raise files._Refused(
                f"{where}: the box {tuple(int(v) for v in box)} holds no pixel of its {width}x{height} image; {help}"
            )
        return left, top, right, bottom

    return crop


def refuse_archive(spec: DataSpec, root: Path, archive: str, extract: str) -> None:
    """Refuses the archive itself as ``root``: it is read extracted (decoding from a tarball is not done)."""
    if root.is_file() and (root.name.endswith((".tgz", ".tar.gz", ".tar")) or tarfile.is_tarfile(root)):
        raise ValueError(
            f"{root} is an archive ({archive}); {spec.name} is read from the folder it extracts to: run {extract} "
            f"and pass that folder; {spec.help()}"
        )


class FineGrainedImages(FewShotImages):
    """A split of a Meta-Dataset image set whose decoding has options (crops, images kept or left out).

    The options choose the layout (:meth:`_spec`): its name is in the cache key, so each option reads its
    own cache.
    """

    _archive: ClassVar[tuple[str, str]]  # the archive's name and the command that extracts it

    def _load(self, root: Any, split: str, spec: DataSpec, kwargs: dict[str, Any]) -> None:
        refuse_archive(spec, _root(spec, root), *self._archive)
        self.spec = spec  # type: ignore[misc] - the options' layouts, for this instance
        FewShotImages.__init__(self, root, split, **kwargs)

    @classmethod
    def splits(cls, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> ImageSplits:
        refuse_archive(cls.spec, _root(cls.spec, root), *cls._archive)
        return super().splits(root, **kwargs)
