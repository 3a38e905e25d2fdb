"""VGG Flowers 102 (Nilsback and Zisserman 2008) in Meta-Dataset's split: 71/15/16 of its 102 classes.

``102flowers.tgz`` extracts to ``jpg/image_00001.jpg`` ... ``jpg/image_08189.jpg``; ``imagelabels.mat``
(downloaded beside it) holds ``labels``, the class (1..102) of each image in that order, as a MATLAB v5
file, read with ``scipy.io.loadmat`` (imported when a split is read). The root is the folder holding both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from . import image_files as files
from .fine_grained import FineGrainedImages, decode_all
from .image_data import IMAGE_DATASETS
from .image_files import Decoded
from .image_layouts import DATASETS, DataSpec, Layout

LABELS = "imagelabels.mat"

# Meta-Dataset's class split (Triantafillou et al. 2020), as learn2learn ships it (vgg_flowers.py), in its order:
# the classes numbered as imagelabels.mat numbers them.
CLASS_SPLITS: dict[str, tuple[int, ...]] = {
    "train": (
        90,
        38,
        80,
        30,
        29,
        12,
        43,
        27,
        4,
        64,
        31,
        99,
        8,
        67,
        95,
        77,
        78,
        61,
        88,
        74,
        55,
        32,
        21,
        13,
        79,
        70,
        51,
        69,
        14,
        60,
        11,
        39,
        63,
        37,
        36,
        28,
        48,
        7,
        93,
        2,
        18,
        24,
        6,
        3,
        44,
        76,
        75,
        72,
        52,
        84,
        73,
        34,
        54,
        66,
        59,
        50,
        91,
        68,
        100,
        71,
        81,
        101,
        92,
        22,
        33,
        87,
        1,
        49,
        20,
        25,
        58,
    ),
    "val": (10, 16, 17, 23, 26, 47, 53, 56, 57, 62, 82, 83, 86, 97, 102),
    "test": (5, 9, 15, 19, 35, 40, 41, 42, 45, 46, 65, 85, 89, 94, 96, 98),
}


def labels_of(path: Path, help: str) -> np.ndarray:
    """The class (1..102) of each image, from ``imagelabels.mat``; a file scipy cannot read is one line."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise ValueError(
            f"reading {path} (a MATLAB v5 file) needs scipy, which is not installed: pip install scipy; {help}"
        ) from None
    try:
        content = loadmat(str(path))
    except Exception as exc:  # noqa: BLE001 - scipy reports a damaged file as ValueError, TypeError, MatReadError, ...
        raise ValueError(
            f"cannot read {path} ({exc or type(exc).__name__}): it is truncated or not a MATLAB v5 file; {help}"
        ) from None
    if "labels" not in content:
        have = sorted(k for k in content if not k.startswith("__"))
        raise ValueError(f"{path} holds no 'labels' (it holds {have}); {help}")
    labels = np.asarray(content["labels"]).reshape(-1)
    if labels.dtype.kind not in "iuf" or labels.size == 0 or (labels != np.round(labels)).any():
        raise ValueError(f"{path}: labels are {labels.dtype} {labels[:3].tolist()}, not classes 1..102; {help}")
    labels = labels.astype(np.int64)
    if labels.min() < 1 or labels.max() > 102:
        raise ValueError(
            f"{path}: labels run from {labels.min()} to {labels.max()}, not within 1..102 (Flowers 102's classes); "
            f"{help}"
        )
    return labels


def _listed(root: Path, split: str, help: str) -> list[tuple[Path, int]]:
    """``(image file, class index)`` of the split's images: image ``i`` (from 1) is ``jpg/image_<i:05d>.jpg``."""
    classes = {c: i for i, c in enumerate(CLASS_SPLITS[split])}
    labels = labels_of(root / LABELS, help)
    out = [(root / "jpg" / f"image_{i:05d}.jpg", classes[int(c)]) for i, c in enumerate(labels, 1) if c in classes]
    empty = sorted(set(classes.values()) - {c for _, c in out})
    if empty:
        raise ValueError(
            f"{root / LABELS} labels no image with the class {CLASS_SPLITS[split][empty[0]]} of the {split} split; "
            f"{help}"
        )
    missing = [p for p, _ in out if not p.is_file()]
    if missing:
        raise ValueError(
            f"{root / 'jpg'} holds no {missing[0].name} ({len(missing)} images of the {split} split missing), "
            f"labelled in {LABELS}; {help}"
        )
    return out


def _read(root: Path, split: str, side: int, help: str) -> Decoded:
    listed = _listed(root, split, help)
    files.one_file_each([p for p, _ in listed], help)
    images = decode_all([(p, None) for p, _ in listed], side, help)
    labels = np.array([c for _, c in listed], dtype=np.int64)
    return Decoded(images, labels, [str(c) for c in CLASS_SPLITS[split]])


def _inputs(root: Path, split: str) -> list[Path]:
    try:
        listed = _listed(root, split, "")
    except ValueError:  # the reader reports it, with the data set's help
        return [root / LABELS]
    return [root / LABELS, *(p for p, _ in listed)]


LAYOUT = Layout(
    "extracted",
    "Oxford VGG's 102flowers.tgz and imagelabels.mat",
    lambda r, s: [r / "jpg", r / LABELS],
    _read,
    inputs=_inputs,
    names=lambda r, s, help: [str(c) for c in CLASS_SPLITS[s]],
)

FLOWERS = DataSpec(
    "VGG Flowers 102",
    "flowers",
    84,
    (71, 15, 16),
    "FLOWERS_DIR",
    "extract 102flowers.tgz from https://www.robots.ox.ac.uk/~vgg/data/flowers/102/ beside imagelabels.mat from the "
    "same page and pass the folder holding jpg/ and imagelabels.mat",
    (LAYOUT,),
)


class Flowers102(FineGrainedImages):
    """VGG Flowers 102 (Nilsback and Zisserman 2008) in Meta-Dataset's split: 71/15/16 classes, 84x84 RGB.

    Args: as :class:`tasks.FewShotImages`; ``root`` holds ``jpg/`` (102flowers.tgz extracted) and
    ``imagelabels.mat``. Reading the labels needs scipy (``pip install scipy``).
    """

    spec = FLOWERS
    _archive = ("102flowers.tgz", "tar xzf 102flowers.tgz")

    def __init__(self, root: Any = None, split: str = "train", **kwargs: Any) -> None:
        self._load(root, split, FLOWERS, kwargs)


# Registered after the sets of image_layouts and image_data (--dataset flowers).
DATASETS[FLOWERS.key] = FLOWERS
IMAGE_DATASETS[FLOWERS.key] = Flowers102
