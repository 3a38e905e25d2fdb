"""Omniglot (Lake et al., 2015) in its published layout, decoded once into one uint8 tensor."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from . import cache, checks
from .image_files import pil_reason
from .sampler import FewShotSampler

OMNIGLOT_URL = "https://github.com/brendenlake/omniglot"
LAYOUT_HELP = (
    "Expected the Omniglot layout <split>/<Alphabet>/<characterNN>/<image>.png: a zip archive such as "
    "images_background.zip, an extracted split folder such as images_background/ (holding "
    "<Alphabet>/<characterNN>/*.png), or a folder holding such archives or split folders. The official "
    f"archives are published at {OMNIGLOT_URL} (python/images_background.zip and "
    "python/images_evaluation.zip; images_background_small1.zip and images_background_small2.zip beside them)."
)
SPLIT_BY: tuple[str, ...] = ("character", "alphabet", "archive")
SplitBy = Literal["character", "alphabet", "archive"]

# Bump when decoding changes, so that caches written by older code are never read.
_CACHE_FORMAT = 1
_ROTATIONS = 4
_CHUNK = 256  # images per decoding job: large enough to amortise the thread pool's overhead


@dataclasses.dataclass(frozen=True)
class _Source:
    """One archive (zip) or extracted split folder; ``name`` is its stem, e.g. ``images_background``."""

    name: str
    path: Path
    is_zip: bool


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One image: its character and where its bytes are (a zip member name or a file path)."""

    alphabet: str
    character: str
    member: str

    @property
    def key(self) -> str:
        return f"{self.alphabet}/{self.character}"


class OmniglotSplits(NamedTuple):
    """Character-disjoint train, validation and test parts of an :class:`Omniglot`."""

    train: Omniglot
    validation: Omniglot
    test: Omniglot


class Omniglot:
    """Every Omniglot image under ``root``, preprocessed as in MAML, as one tensor in memory.

    ``root`` is a zip archive, an extracted split folder, or a folder holding any number of
    them (e.g. ``images_background.zip`` and ``images_evaluation.zip``, or
    ``images_background_small1.zip`` and ``images_background_small2.zip``). Characters are
    identified by ``Alphabet/characterNN``: one that appears in several archives (Greek and
    Latin are in both "small" archives) is read once, from the first archive by name.

    Preprocessing: each 105x105 image is converted to greyscale and resized to
    ``image_size`` x ``image_size`` with PIL's Lanczos filter (antialiased, so thin strokes
    survive as grey levels), then inverted, so strokes are 255 and background 0; samplers
    scale it to [0, 1]. Converting to greyscale first matters: PIL resizes bilevel (mode "1")
    images with nearest neighbour whatever filter is asked for.

    The decoded images are cached on disk (see ``cache_dir``), keyed on the files read (their
    paths, sizes, times and content: ``tasks._src.cache.fingerprint``) and on the preprocessing,
    so later loads skip decoding.

    Args:
        root: a zip archive, a split folder, or a folder holding archives or split folders.
        rotations: add the 90, 180 and 270 degree (counter-clockwise) rotations of every
            character as classes of their own (the usual augmentation for meta-training).
        image_size: side of the resized images.
        cache_dir: folder for the decoded cache. Default: ``$MAML_CACHE_DIR`` when set (the
            data folder is then never written into), else ``.maml-cache`` next to the data
            when writable (a folder without write permission bits counts as read-only, even
            for root), else ``$XDG_CACHE_HOME/maml-toolkit`` or ``~/.cache/maml-toolkit``.
        cache: read and write the decoded cache at all.

    Attributes:
        images: ``(N, image_size, image_size)`` uint8, strokes high.
        labels: ``(N,)`` int64 class of each image, ``0..num_classes-1``: the character index,
            or with rotations ``4 * character + rotation / 90``.
        drawers: ``(N,)`` int64 drawer (person) number of each image, 1..20 in Omniglot.
        image_characters: ``(N,)`` int64 character index of each image.
        characters: ``"Alphabet/characterNN"`` of each character index.
        character_archives: the archive each character was read from.
        alphabets: the alphabets present, sorted.
        archives: the archives present, sorted.
        classes: the name of each class (``"Alphabet/characterNN/rot90"`` with rotations).
        class_characters: ``(num_classes,)`` int64 character index of each class.
        class_rotations: ``(num_classes,)`` int64 rotation of each class, in degrees.
        from_cache: whether the images came from the decoded cache.
        cache_path: the cache file read or written, or ``None``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: ``root`` holds no image in the Omniglot layout, or an archive or image is
            corrupt.
    """

    images: Tensor
    labels: Tensor
    drawers: Tensor
    image_characters: Tensor
    characters: list[str]
    character_archives: list[str]
    alphabets: list[str]
    archives: list[str]
    classes: list[str]
    class_characters: Tensor
    class_rotations: Tensor
    rotations: bool
    root: Path | None
    from_cache: bool
    cache_path: Path | None

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rotations: bool = True,
        image_size: int = 28,
        cache_dir: str | os.PathLike[str] | None = None,
        cache: bool = True,
    ) -> None:
        if not isinstance(rotations, bool):
            raise TypeError(f"rotations must be True or False, got {rotations!r}.")
        checks.positive_int("image_size", image_size)
        root = Path(root).expanduser()
        sources = _find_sources(root)
        settings = {"format": _CACHE_FORMAT, "image_size": image_size, "resize": "L-lanczos-inverted"}
        identity = json.dumps({**settings, "sources": [_identity(s) for s in sources]}, sort_keys=True)
        key = hashlib.sha256(identity.encode()).hexdigest()
        name = f"omniglot-{image_size}px-{key[:24]}.pt"
        folders = _cache_folders(root, cache_dir) if cache else []

        found = _load_cache(folders, name, key, image_size)
        if found is not None:
            payload, path = found
        else:
            payload = _decode_sources(sources, image_size)
            payload["key"] = key
            path = _save_cache(folders, name, payload) if folders else None
        self.root = root
        self.from_cache = found is not None
        self.cache_path = path
        self._assemble(
            payload["images"],
            payload["image_characters"],
            payload["drawers"],
            list(payload["characters"]),
            list(payload["character_archives"]),
            rotations,
        )

    # ------------------------------------------------------------------ public API

    @property
    def num_classes(self) -> int:
        """The number of classes: characters, times 4 with rotations."""
        return len(self.classes)

    @property
    def image_size(self) -> int:
        """The side of the images in pixels."""
        return self._base.shape[-1]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __repr__(self) -> str:
        return (
            f"Omniglot({len(self.characters)} characters in {len(self.alphabets)} alphabets from "
            f"{self.archives}, {self.num_classes} classes, {len(self)} images of "
            f"{self.image_size}x{self.image_size}, rotations={self.rotations})"
        )

    def sampler(self, ways: int, shots: int, query: int) -> FewShotSampler:
        """A :class:`FewShotSampler` of ``ways``-way ``shots``-shot tasks over these images."""
        return FewShotSampler(self.images, self.labels, ways, shots, query, class_names=self.classes)

    def split(
        self,
        by: SplitBy = "character",
        fractions: Sequence[float] = (0.7, 0.15, 0.15),
        seed: int = 0,
        *,
        rotations: bool | Sequence[bool] | None = None,
    ) -> OmniglotSplits:
        """Splits the characters into disjoint train, validation and test parts.

        The units (characters, alphabets or archives) are sorted by name, shuffled with
        ``seed`` and dealt to the parts in proportion to ``fractions`` (largest remainder),
        so a seed fixes the split on any machine. A character read from several archives
        belongs to the one it was read from (see ``character_archives``).

        The defaults (by character, ``(0.7, 0.15, 0.15)``, rotations in the train part only) are
        not ``python -m experiments.omniglot``'s, which splits by alphabet, ``(0.6, 0.15, 0.25)``,
        with every part rotated (the reference's protocol: ``--split-by alphabet
        --split-fractions 0.6,0.15,0.25 --rotations all``). Its split, the same classes in each
        part, is ``tasks.Omniglot(root).split("alphabet", (0.6, 0.15, 0.25), seed=0, rotations=True)``
        (``seed`` is its ``--split-seed``).

        Args:
            by: ``"character"``, ``"alphabet"`` (no alphabet in two parts) or ``"archive"``
                (e.g. background vs evaluation).
            fractions: ``(train, validation, test)`` shares of the units, >= 0, summing to 1;
                a zero share gives an empty part.
            seed: fixes the shuffle.
            rotations: rotation classes per part, ``(train, validation, test)``, or one bool
                for all. Default: the train part has them if this object has, the others not.

        Returns:
            ``OmniglotSplits(train, validation, test)``, each an :class:`Omniglot` over its
            characters, with character indices and labels renumbered from 0.
        """
        checks.one_of("by", by, SPLIT_BY)
        shares = _fractions(fractions)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__}).")
        if rotations is None:
            per_part = (self.rotations, False, False)
        elif isinstance(rotations, bool):
            per_part = (rotations,) * 3
        elif isinstance(rotations, Sequence) and len(rotations) == 3 and all(isinstance(r, bool) for r in rotations):
            per_part = tuple(rotations)
        else:
            raise TypeError(
                f"rotations must be None, a bool or three bools (train, validation, test), got {rotations!r}."
            )

        if by == "character":
            unit_names = list(self.characters)
        elif by == "alphabet":
            unit_names = [c.split("/", 1)[0] for c in self.characters]
        else:
            unit_names = list(self.character_archives)
        units = sorted(set(unit_names))
        counts = _deal(len(units), shares)
        for part, (count, share) in enumerate(zip(counts, shares)):
            if share > 0 and count == 0:
                raise ValueError(
                    f"split(by={by!r}, fractions={tuple(fractions)}): there are only {len(units)} "
                    f"{by}s ({', '.join(units) if len(units) <= 8 else '...'}), too few to give the "
                    f"{OmniglotSplits._fields[part]} part any; set its fraction to 0 or split by a finer unit."
                )
        order = torch.randperm(len(units), generator=torch.Generator().manual_seed(seed)).tolist()
        dealt = [part for part, count in enumerate(counts) for _ in range(count)]  # the part of each position
        part_of_unit = {units[u]: dealt[position] for position, u in enumerate(order)}
        parts = [[c for c, u in enumerate(unit_names) if part_of_unit[u] == p] for p in range(3)]
        return OmniglotSplits(*(self._subset(chars, rot) for chars, rot in zip(parts, per_part)))

    # ------------------------------------------------------------------ internals

    def _assemble(
        self,
        base: Tensor,
        image_characters: Tensor,
        drawers: Tensor,
        characters: list[str],
        character_archives: list[str],
        rotations: bool,
    ) -> None:
        """Sets every attribute from the unrotated images ``base`` (n, S, S) and their metadata."""
        self._base = base
        self._base_characters = image_characters
        self._base_drawers = drawers
        self.characters = characters
        self.character_archives = character_archives
        self.alphabets = sorted({c.split("/", 1)[0] for c in characters})
        self.archives = sorted(set(character_archives))
        self.rotations = rotations
        n_chars = len(characters)
        if rotations:
            # rot90 on the small uint8 tensor: a copy, no decoding; class = 4 * character + k.
            self.images = torch.cat([torch.rot90(base, k, dims=(1, 2)) for k in range(_ROTATIONS)])
            self.labels = torch.cat([image_characters * _ROTATIONS + k for k in range(_ROTATIONS)])
            self.drawers = drawers.repeat(_ROTATIONS)
            self.class_characters = torch.arange(n_chars).repeat_interleave(_ROTATIONS)
            self.class_rotations = torch.arange(0, 360, 90).repeat(n_chars)
            self.classes = [f"{c}/rot{d}" for c in characters for d in range(0, 360, 90)]
        else:
            self.images = base
            self.labels = image_characters
            self.drawers = drawers
            self.class_characters = torch.arange(n_chars)
            self.class_rotations = torch.zeros(n_chars, dtype=torch.int64)
            self.classes = list(characters)
        self.image_characters = self.class_characters[self.labels]

    def _subset(self, characters: list[int], rotations: bool) -> Omniglot:
        """A new :class:`Omniglot` over the given character indices, renumbered from 0."""
        index = torch.tensor(characters, dtype=torch.int64)
        renumber = torch.full((len(self.characters),), -1, dtype=torch.int64)
        renumber[index] = torch.arange(index.numel())
        keep = renumber[self._base_characters] >= 0
        part = Omniglot.__new__(Omniglot)
        part.root, part.from_cache, part.cache_path = self.root, self.from_cache, self.cache_path
        part._assemble(
            self._base[keep],
            renumber[self._base_characters[keep]],
            self._base_drawers[keep],
            [self.characters[c] for c in characters],
            [self.character_archives[c] for c in characters],
            rotations,
        )
        return part


def _fractions(fractions: Any) -> tuple[float, float, float]:
    ok = (
        isinstance(fractions, Sequence)
        and len(fractions) == 3
        and all(not isinstance(f, bool) and isinstance(f, (int, float)) and math.isfinite(f) for f in fractions)
    )
    if not ok:
        raise TypeError(f"fractions must be three numbers (train, validation, test), got {fractions!r}.")
    if any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"fractions={tuple(fractions)} must be >= 0 and sum to 1, e.g. (0.7, 0.15, 0.15) or (0.8, 0.0, 0.2)."
        )
    return tuple(float(f) for f in fractions)  # type: ignore[return-value]


def _deal(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` units dealt in proportion to ``shares`` by largest remainder (ties: earlier part first)."""
    exact = [n * s for s in shares]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(shares)), key=lambda p: (-(exact[p] - counts[p]), p))
    for p in by_remainder[: n - sum(counts)]:
        counts[p] += 1
    return counts


# ---------------------------------------------------------------------- finding the data


def _is_split_folder(folder: Path) -> bool:
    """Whether ``folder`` holds ``<Alphabet>/<characterNN>/*.png``."""
    return any(not _hidden(p, folder) for p in folder.glob("*/*/*.png"))


def _hidden(path: Path, below: Path) -> bool:
    return any(part.startswith(".") or part == "__MACOSX" for part in path.relative_to(below).parts)


def _find_sources(root: Path) -> list[_Source]:
    if not root.exists():
        raise FileNotFoundError(f"Omniglot root {str(root)!r} does not exist. {LAYOUT_HELP}")
    if root.is_file():
        if not zipfile.is_zipfile(root):
            raise ValueError(
                f"{str(root)!r} is not a zip archive (it is corrupt, truncated or another kind of file). {LAYOUT_HELP}"
            )
        return [_Source(root.stem, root, True)]
    if _is_split_folder(root):
        return [_Source(root.name, root, False)]
    children = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    folders = [_Source(p.name, p, False) for p in children if p.is_dir() and _is_split_folder(p)]
    # An archive extracted beside itself is read once, from the folder.
    taken = {s.name for s in folders}
    zips = [
        _Source(p.stem, p, True) for p in children if p.is_file() and p.suffix.lower() == ".zip" and p.stem not in taken
    ]
    sources = sorted(folders + zips, key=lambda s: (s.name, not s.is_zip))
    if not sources:
        raise ValueError(
            f"found no Omniglot images under {str(root)!r}: no *.zip archive and no folder holding "
            f"<Alphabet>/<characterNN>/*.png. {LAYOUT_HELP}"
        )
    return sources


def _folder_files(source: _Source) -> list[Path]:
    return sorted(p for p in source.path.glob("*/*/*.png") if not _hidden(p, source.path))


def _identity(source: _Source) -> list[Any]:
    """What the cache is keyed on: the source and its files' :func:`tasks._src.cache.fingerprint`.

    Relative paths, sizes and times of the files read, and their content (Omniglot's 15 MB are hashed
    in well under a second), so that an image moved to another character, a renamed character folder
    or an image replaced by one of the same size with its time kept is a miss.
    """
    if source.is_zip:
        return [source.name, str(source.path.resolve()), cache.fingerprint(source.path.parent, [source.path])]
    return [source.name, str(source.path.resolve()), cache.fingerprint(source.path, _folder_files(source))]


def _list_entries(source: _Source) -> list[_Entry]:
    if not source.is_zip:
        return [_Entry(p.parent.parent.name, p.parent.name, str(p)) for p in _folder_files(source)]
    try:
        with zipfile.ZipFile(source.path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(
            f"cannot open the zip archive {str(source.path)!r} ({exc}); it is corrupt or truncated: "
            f"download it again. {LAYOUT_HELP}"
        ) from exc
    entries = []
    for member in names:
        parts = member.split("/")
        if len(parts) < 3 or not member.lower().endswith(".png"):
            continue
        if any(p.startswith(".") or p == "__MACOSX" for p in parts):
            continue
        entries.append(_Entry(parts[-3], parts[-2], member))
    if not entries:
        raise ValueError(
            f"the zip archive {str(source.path)!r} holds no .png image in the Omniglot layout "
            f"(it is empty or holds something else). {LAYOUT_HELP}"
        )
    return entries


# ---------------------------------------------------------------------- decoding


def _decode(blob: bytes, size: int) -> np.ndarray:
    with Image.open(io.BytesIO(blob)) as im:
        # Greyscale first: PIL resizes bilevel images with nearest neighbour, whatever the filter.
        small = im.convert("L").resize((size, size), Image.Resampling.LANCZOS)
    return 255 - np.asarray(small, dtype=np.uint8)


def _decode_chunk(jobs: list[tuple[str, bytes]], size: int, out: np.ndarray, start: int) -> None:
    for i, (where, blob) in enumerate(jobs):
        try:
            out[start + i] = _decode(blob, size)
        except Exception as exc:  # noqa: BLE001 - PIL reports broken PNGs as OSError, SyntaxError, ...
            raise ValueError(
                f"cannot decode the image {where} ({pil_reason(exc)}); the data is corrupt: download it again from {OMNIGLOT_URL}."
            ) from exc


def _read_blobs(source: _Source, entries: list[_Entry]) -> dict[str, bytes]:
    """The bytes of ``entries``, by member; a zip is opened once for all of them."""
    if not source.is_zip:
        return {e.member: Path(e.member).read_bytes() for e in entries}
    blobs = {}
    with zipfile.ZipFile(source.path) as z:
        for e in entries:
            try:
                blobs[e.member] = z.read(e.member)
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as exc:
                raise ValueError(
                    f"cannot read {e.member} from the zip archive {str(source.path)!r} ({exc}); the archive "
                    f"is corrupt or truncated: download it again. {LAYOUT_HELP}"
                ) from exc
    return blobs


def _decode_sources(sources: list[_Source], size: int) -> dict[str, Any]:
    """Decodes every distinct character's images into the cache payload."""
    chosen: dict[str, tuple[_Source, list[_Entry]]] = {}
    for source in sources:
        per_character: dict[str, list[_Entry]] = {}
        for entry in _list_entries(source):
            per_character.setdefault(entry.key, []).append(entry)
        for key, entries in per_character.items():
            # The same character in a later archive (Greek, Latin in both "small" ones) is skipped.
            chosen.setdefault(key, (source, entries))
    characters = sorted(chosen, key=lambda k: tuple(k.split("/", 1)))

    wanted: dict[_Source, list[_Entry]] = {}
    for source, entries in chosen.values():
        wanted.setdefault(source, []).extend(entries)
    blobs = {source: _read_blobs(source, entries) for source, entries in wanted.items()}

    jobs: list[tuple[str, bytes]] = []
    image_characters: list[int] = []
    drawers: list[int] = []
    for index, key in enumerate(characters):
        source, entries = chosen[key]
        entries = sorted(entries, key=lambda e: Path(e.member).name)
        where = "" if not source.is_zip else f" in {source.path}"
        jobs.extend((f"{e.member}{where}", blobs[source][e.member]) for e in entries)
        image_characters.extend([index] * len(entries))
        drawers.extend(_drawer(e.member, i) for i, e in enumerate(entries))

    images = np.empty((len(jobs), size, size), dtype=np.uint8)
    chunks = [(jobs[s : s + _CHUNK], s) for s in range(0, len(jobs), _CHUNK)]
    # Decoding and resizing in PIL release the GIL for part of the work; threads cost no start-up.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for done in [pool.submit(_decode_chunk, chunk, size, images, start) for chunk, start in chunks]:
            done.result()
    return {
        "format": _CACHE_FORMAT,
        "images": torch.from_numpy(images),
        "image_characters": torch.tensor(image_characters, dtype=torch.int64),
        "drawers": torch.tensor(drawers, dtype=torch.int64),
        "characters": characters,
        "character_archives": [chosen[k][0].name for k in characters],
    }


def _drawer(member: str, position: int) -> int:
    """The drawer number from Omniglot's ``<character id>_<drawer>.png`` names, else 1-based position."""
    suffix = Path(member).stem.rsplit("_", 1)[-1]
    return int(suffix) if suffix.isdigit() else position + 1


# ---------------------------------------------------------------------- cache


def _cache_folders(root: Path, cache_dir: str | os.PathLike[str] | None) -> list[Path]:
    return cache.candidates(root if root.is_dir() else root.parent, cache_dir)


def _load_cache(folders: list[Path], name: str, key: str, size: int) -> tuple[dict[str, Any], Path] | None:
    def valid(p: Any) -> bool:
        if not isinstance(p, dict) or p.get("format") != _CACHE_FORMAT or p.get("key") != key:
            return False
        images, chars, drawers = p.get("images"), p.get("image_characters"), p.get("drawers")
        names, archives = p.get("characters"), p.get("character_archives")
        if not all(isinstance(t, Tensor) for t in (images, chars, drawers)):
            return False
        if not isinstance(names, list) or not isinstance(archives, list) or len(names) != len(archives):
            return False
        n = images.shape[0]
        return (
            images.dtype == torch.uint8
            and tuple(images.shape[1:]) == (size, size)
            and chars.dtype == drawers.dtype == torch.int64
            and tuple(chars.shape) == tuple(drawers.shape) == (n,)
            and (n == 0 or (int(chars.min()) >= 0 and int(chars.max()) < len(names)))
        )

    return cache.load(folders, name, valid)


def _save_cache(folders: list[Path], name: str, payload: dict[str, Any]) -> Path | None:
    path = cache.save(folders, name, payload)
    if path is None:
        warnings.warn(
            f"could not write the decoded Omniglot cache in any of {[str(f) for f in folders]}; every load "
            f"will decode the images again. Pass cache_dir= a writable folder or set ${cache.CACHE_ENV}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return path
