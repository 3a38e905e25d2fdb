"""mini-ImageNet, tieredImageNet, CIFAR-FS and FC100, read offline from any layout they are held in.

Each split is decoded once into a uint8 cache file (``tasks._src.cache``) that later loads map
into memory instead of reading, so a 16 GB tieredImageNet costs no start-up and no private copy.
The cache is keyed on every file the split is read from (``cache.fingerprint``: relative paths,
sizes, times, and content up to 256 MiB, each file's digest kept under its stat), so a moved image,
a renamed class folder or a file replaced with its time kept decodes again, and the whole folder
moved does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from . import cache as cache_files
from . import checks
from . import image_files as files
from .image_layouts import (
    CIFAR_FS,
    DTD,
    FC100,
    FUNGI,
    MINI_IMAGENET,
    SPLITS,
    TIERED_IMAGENET,
    DataSpec,
    Layout,
    detect,
)
from .sampler import FewShotSampler

# Bump when decoding changes, so that caches written by older code are never read.
_CACHE_FORMAT = 2  # 2: 16-bit images scaled to 8 bits (1 read them white); what the classes' names leave unchecked
_SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}


class ImageSplits(NamedTuple):
    """The train, validation and test splits of a data set (disjoint classes: :meth:`FewShotImages.splits` checks)."""

    train: FewShotImages
    validation: FewShotImages
    test: FewShotImages


class FewShotImages:
    """One split of a few-shot image data set, as uint8 tensors mapped from a decoded cache.

    Subclasses name the data set (:class:`MiniImageNet`, :class:`TieredImageNet`, :class:`CIFARFS`,
    :class:`FC100`). The layout is detected by its files (``tasks.IMAGE_LAYOUTS`` lists them);
    the number of classes of the split is checked against the published split, and
    :meth:`splits` checks that no class is in two splits (one split alone cannot tell).

    Args:
        root: the folder holding the data (default: the data set's variable, e.g. ``$MINIIMAGENET_DIR``).
        split: ``"train"``, ``"val"`` (or ``"validation"``) or ``"test"``.
        class_counts: the classes expected in train, val and test (default: the published split,
            e.g. 64, 16, 20 for mini-ImageNet); pass others only for a subset you made on purpose.
        cache_dir: folder for the decoded cache (default as :class:`tasks.Omniglot`:
            ``$MAML_CACHE_DIR``, else ``.maml-cache`` next to the data when writable, else the
            user cache folder).
        cache: read and write the decoded cache at all.

    Attributes:
        images: ``(N, 3, S, S)`` uint8 RGB images (S = 84, or 32 for CIFAR-FS and FC100).
        labels: ``(N,)`` int64 class of each image, ``0..num_classes-1``.
        classes: the name of each class (a WordNet id such as ``n01532829``, or a number).
        layout: the layout read, e.g. ``"ren-pickles"``.
        from_cache: whether the images came from the decoded cache.
        unchecked: what the classes' names cannot tell, also warned at each load (tieredImageNet's labels
            without ``label_specific_str``: whether a class is in two splits), else ``""``.
        cache_path: the cache file read or written, or ``None``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: one line naming the file, the layout expected and where the data comes from:
            no layout's files, a missing, truncated or wrong file, or the wrong number of classes.
    """

    spec: ClassVar[DataSpec]
    images: Tensor
    labels: Tensor
    classes: list[str]
    split: str
    layout: str
    root: Path
    from_cache: bool
    unchecked: str
    cache_path: Path | None
    _files: list[Path]  # the layout's files of this split, for messages
    _digests_path: Path | None = None  # the file of the digests this load wrote (cache.Digests), if any

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        split: str = "train",
        *,
        class_counts: tuple[int, int, int] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache: bool = True,
    ) -> None:
        spec = self.spec
        if split not in _SPLIT_NAMES:
            raise ValueError(f"split={split!r} is not one of 'train', 'val' ('validation') or 'test'.")
        split = _SPLIT_NAMES[split]
        counts = _counts(class_counts, spec)
        self.root = _root(spec, root)
        layout = detect(spec, self.root, split)
        folders = cache_files.candidates(self.root, cache_dir) if cache else []
        # The files' digests beside the cache: a warm load reads only the files changed since (one name per split:
        # the same files moved keep their inodes, and two copies of a data set in one cache folder take turns).
        digests = cache_files.Digests([folder / f"{spec.key}-{split}.hashes.json" for folder in folders])
        # Not the folder's path: the same files moved elsewhere (with their .maml-cache) load the cache they wrote.
        identity = json.dumps(
            {"format": _CACHE_FORMAT, "data": spec.key, "split": split, "layout": layout.name, "side": spec.side,
             "files": _fingerprint(spec, layout, self.root, split, digests)},
            sort_keys=True,
        )  # fmt: skip
        key = hashlib.sha256(identity.encode()).hexdigest()
        name = f"{spec.key}-{split}-{spec.side}px-{key[:24]}.pt"
        expected = counts[SPLITS.index(split)]
        found = cache_files.load(folders, name, lambda p: _valid(p, key, spec.side), mmap=True)
        if found is None:
            payload = _decode(spec, layout, self.root, split)
            payload["key"] = key
            _check_count(len(payload["classes"]), expected, spec, layout, self.root, split)  # before it is cached
            path = _save(folders, name, payload, spec) if folders else None
            # Mapped from the file just written: the decoded copy in memory is let go.
            found = cache_files.load([path.parent], name, lambda p: True, mmap=True) if path is not None else None
            self.from_cache, self.cache_path = False, path
        else:
            payload, self.cache_path = found
            self.from_cache = True
            _check_count(len(payload["classes"]), expected, spec, layout, self.root, split)
        if found is not None:
            payload = found[0]
            self._digests_path = digests.save()  # once a cache is there to go with them
        self.images, self.labels, self.classes = payload["images"], payload["labels"], list(payload["classes"])
        self.unchecked = payload["unchecked"]
        if self.unchecked:  # at every load: a warm one leaves the check undone as the first did
            warnings.warn(f"{self.unchecked}.", RuntimeWarning, stacklevel=2)
        self.split, self.layout = split, layout.name
        self._files = layout.files(self.root, split)

    @classmethod
    def splits(cls, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> ImageSplits:
        """The train, validation and test splits under ``root`` (keyword arguments as the constructor's).

        Every split's files are found, and where the layout names its classes without decoding (class
        folders, Ravi's CSVs) their counts and disjointness checked, before any split is decoded; a
        split refused after others were decoded removes the caches this call wrote, so a refused folder
        leaves none (0.81 GB for mini-ImageNet's train split).

        Raises:
            ValueError: as the constructor, or one line naming a class that two splits hold.
        """
        spec = cls.spec
        where = _root(spec, root)
        layouts = [detect(spec, where, split) for split in SPLITS]
        if all(layout.names is not None for layout in layouts):
            counts = _counts(kwargs.get("class_counts"), spec)
            named = []
            for split, layout, count in zip(SPLITS, layouts, counts):
                names = layout.names(where, split, spec.help())  # type: ignore[misc]
                _check_count(len(names), count, spec, layout, where, split)
                named.append((split, names, layout.files(where, split)))
            _check_disjoint(where, named, spec)
            # An image in two splits (a hard link, a link to the same file) is a class's of both. A file of the
            # layout that every split reads (CUB's images.txt, Flowers' imagelabels.mat, Fungi's
            # train.json and val.json) is one file, counted once.
            read = [p for split, layout in zip(SPLITS, layouts) for p in layout.read_files(where, split)]
            declared = {p for split, layout in zip(SPLITS, layouts) for p in layout.files(where, split)}
            files.one_file_each(
                [*dict.fromkeys(p for p in read if p in declared), *(p for p in read if p not in declared)], spec.help()
            )
        parts: list[FewShotImages] = []
        try:
            for split in SPLITS:
                parts.append(cls(root, split, **kwargs))
            _check_disjoint(where, [(p.split, p.classes, p._files) for p in parts if not p.unchecked], spec)
        except ValueError:  # a refusal; an interrupted run keeps the valid caches it wrote
            for part in parts:
                if not part.from_cache and part.cache_path is not None:
                    part.cache_path.unlink(missing_ok=True)
                    if part._digests_path is not None:
                        part._digests_path.unlink(missing_ok=True)
            raise
        return ImageSplits(*parts)

    @property
    def num_classes(self) -> int:
        """The number of classes of this split."""
        return len(self.classes)

    @property
    def image_size(self) -> int:
        """The side of the images in pixels."""
        return self.images.shape[-1]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.split}: {self.num_classes} classes, {len(self)} images of "
            f"{self.image_size}x{self.image_size}, layout {self.layout!r})"
        )

    def sampler(self, ways: int, shots: int, query: int) -> FewShotSampler:
        """A :class:`FewShotSampler` of ``ways``-way ``shots``-shot tasks: ``(T, ways * n, 3, S, S)`` batches."""
        return FewShotSampler(self.images, self.labels, ways, shots, query, class_names=self.classes)


class MiniImageNet(FewShotImages):
    """mini-ImageNet (Vinyals et al. 2016, Ravi and Larochelle's split): 64/16/20 classes of 600 84x84 images."""

    spec = MINI_IMAGENET


class TieredImageNet(FewShotImages):
    """tieredImageNet (Ren et al. 2018): 351/97/160 classes of 84x84 images (608 classes, 779,165 images)."""

    spec = TIERED_IMAGENET


class CIFARFS(FewShotImages):
    """CIFAR-FS (Bertinetto et al. 2019): 64/16/20 CIFAR-100 classes of 600 32x32 images."""

    spec = CIFAR_FS


class FC100(FewShotImages):
    """FC100 (Oreshkin et al. 2018): 60/20/20 CIFAR-100 classes split by superclass, 600 32x32 images each."""

    spec = FC100


class DescribableTextures(FewShotImages):
    """Describable Textures (DTD; Cimpoi et al. 2014) in Meta-Dataset's split: 33/7/7 classes of 120 images, 84x84.

    ``root`` is the ``dtd/`` folder of ``dtd-r1.0.1.tar.gz`` extracted (``images/<class>/*.jpg``) or the folder
    holding it (``tasks._src.textures``).
    """

    spec = DTD


class FGVCFungi(FewShotImages):
    """FGVC Fungi (the FGVCx 2018 challenge) in Meta-Dataset's split: 994/200/200 categories, 84x84 images.

    ``root`` holds ``images/`` of ``fungi_train_val.tgz`` and ``train.json``, ``val.json`` of
    ``train_val_annotations.tgz``; a class is a category, named ``0226.Cortinarius malicorius`` as Meta-Dataset
    names it (``tasks._src.fungi``).
    """

    spec = FUNGI


IMAGE_DATASETS: dict[str, type[FewShotImages]] = {
    c.spec.key: c for c in (MiniImageNet, TieredImageNet, CIFARFS, FC100, DescribableTextures, FGVCFungi)
}
# Then CUB200, Aircraft, Flowers102 and QuickDraw, which their modules (tasks/_src/cub.py, aircraft.py, flowers.py,
# quickdraw.py) add.


def _counts(class_counts: Any, spec: DataSpec) -> tuple[int, int, int]:
    if class_counts is None:
        return spec.counts
    if not isinstance(class_counts, (tuple, list)) or len(class_counts) != 3:
        raise TypeError(f"class_counts must be three ints (train, val, test), got {class_counts!r}.")
    return tuple(checks.positive_int("class_counts", c) for c in class_counts)  # type: ignore[return-value]


def _root(spec: DataSpec, root: str | os.PathLike[str] | None) -> Path:
    if root is None:
        if not os.environ.get(spec.env):
            raise ValueError(f"no {spec.name} folder: pass root= the folder or set ${spec.env}; {spec.help()}")
        root = os.environ[spec.env]
    return Path(root).expanduser()


def _fingerprint(
    spec: DataSpec, layout: Layout, root: Path, split: str, digests: cache_files.Digests
) -> dict[str, Any]:
    """The cache key's summary of the split's files (``cache.fingerprint``); a file it cannot stat is one line."""
    try:
        return cache_files.fingerprint(root, layout.read_files(root, split), digests)
    except OSError as exc:  # a broken link among the images, a file removed while listed, no permission
        raise ValueError(f"{files.unreadable(Path(exc.filename or root), exc)}; {spec.help()}") from None


def _decode(spec: DataSpec, layout: Layout, root: Path, split: str) -> dict[str, Any]:
    images, labels, classes, unchecked = layout.read(root, split, spec.side, spec.help())
    return {
        "unchecked": unchecked,
        "format": _CACHE_FORMAT,
        # (N, S, S, 3) as stored -> (N, 3, S, S) as the network reads, contiguous, once.
        "images": torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        "labels": torch.from_numpy(labels),
        "classes": classes,
    }


def _check_disjoint(root: Path, parts: list[tuple[str, list[str], list[Path]]], spec: DataSpec) -> None:
    """Refuses a class held by two splits: a split's file copied over another's, or a class listed in two.

    A class's name is its identity across the splits in every layout: a WordNet id (Ravi's CSVs, Ren's
    ``class_dict`` keys and tieredImageNet's ``label_specific_str``, a folder's name) or MetaOptNet's
    label, which numbers the classes of all three splits together.
    """
    for i, (split_a, classes_a, paths_a) in enumerate(parts):
        for split_b, classes_b, paths_b in parts[i + 1 :]:
            # By case-folded name: a folder copied in as NTR000000 beside ntr000000 is the same class.
            in_b = {str(c).casefold(): c for c in classes_b}
            shared = [(a, in_b[str(a).casefold()]) for a in classes_a if str(a).casefold() in in_b]
            if not shared:
                continue
            files_a, files_b = (", ".join(p.name for p in paths) for paths in (paths_a, paths_b))
            a, b = shared[0]
            what = (
                f"class {a} is in the {split_a} split ({files_a}) and in the {split_b} split ({files_b})"
                if a == b
                else f"class {a} of the {split_a} split ({_class_path(paths_a, a)}) and class {b} of the {split_b} "
                f"split ({_class_path(paths_b, b)}) differ only by case"
            )
            raise ValueError(
                f"{root}: {what}, {len(shared)} shared classes in all; the splits of {spec.name} hold disjoint "
                f"classes, else the accuracy on held-out classes is measured on classes seen: a split's file was "
                f"copied over another's, or a class is listed in two splits; {spec.help()}"
            )


def _class_path(paths: list[Path], name: str) -> str:
    """Where a split keeps the class ``name``: its folder, or the split's files."""
    folder = paths[0] / name
    return str(folder) if folder.is_dir() else ", ".join(p.name for p in paths)


def _check_count(got: int, expected: int, spec: DataSpec, layout: Layout, root: Path, split: str) -> None:
    if got == expected:
        return
    paths = layout.files(root, split)
    # Two files (a CSV and its images/) are named as two, not joined into one path.
    where = str(paths[0]) if len(paths) == 1 else f"{root}: " + " and ".join(_name(p) for p in paths)
    holds = "holds" if len(paths) == 1 else "hold"
    odd = files.odd_class_folders(paths[0]) if layout.name == "folders" and got > expected else []
    extra = f"; what looks like no class: {', '.join(odd[:5])}" if odd else ""
    raise ValueError(
        f"{where} {holds} {got} classes, and the {split} split of {spec.name} has {expected} ({layout.name} "
        f"layout){extra}: the file is incomplete or of another data set (class_counts= accepts a subset made on "
        f"purpose); {spec.help()}"
    )


def _name(path: Path) -> str:
    return path.name + "/" if path.is_dir() else path.name


def _valid(p: Any, key: str, side: int) -> bool:
    if not isinstance(p, dict) or p.get("format") != _CACHE_FORMAT or p.get("key") != key:
        return False
    images, labels, classes = p.get("images"), p.get("labels"), p.get("classes")
    if not isinstance(images, Tensor) or not isinstance(labels, Tensor) or not isinstance(classes, list):
        return False
    if not isinstance(p.get("unchecked"), str):
        return False
    n = images.shape[0]
    return (
        images.dtype == torch.uint8
        and tuple(images.shape[1:]) == (3, side, side)
        and labels.dtype == torch.int64
        and tuple(labels.shape) == (n,)
        and n > 0
        and int(labels.min()) >= 0
        and int(labels.max()) < len(classes)
    )


def _save(folders: list[Path], name: str, payload: dict[str, Any], spec: DataSpec) -> Path | None:
    path = cache_files.save(folders, name, payload)
    if path is None:
        warnings.warn(
            f"could not write the decoded {spec.name} cache in any of {[str(f) for f in folders]}; every load "
            f"will decode the images again. Pass cache_dir= a writable folder or set ${cache_files.CACHE_ENV}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return path
