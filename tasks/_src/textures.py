"""The Describable Textures data set (DTD; Cimpoi et al. 2014) in Meta-Dataset's split of its 47 classes.

Read from ``dtd-r1.0.1.tar.gz`` extracted: ``dtd/images/<class>/<file>.jpg``, 120 images a class of
300 to 640 pixels a side, resized to 84 x 84. The classes of each split are Meta-Dataset's
(Triantafillou et al. 2020), as learn2learn's ``DescribableTextures`` ships them: 33 / 7 / 7.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import image_files as files
from .image_files import Decoded

# Meta-Dataset's split of DTD's 47 classes (learn2learn's describable_textures.SPLITS), sorted by name.
TEXTURE_SPLITS: dict[str, tuple[str, ...]] = {
    "train": (
        "blotchy", "braided", "bubbly", "chequered", "cobwebbed", "cracked", "crystalline", "dotted", "fibrous",
        "flecked", "freckled", "frilly", "grooved", "honeycombed", "interlaced", "lacelike", "marbled", "matted",
        "meshed", "perforated", "pitted", "pleated", "polka-dotted", "potholed", "smeared", "stained", "striped",
        "studded", "swirly", "veined", "waffled", "wrinkled", "zigzagged",
    ),
    "val": ("gauzy", "grid", "lined", "paisley", "porous", "scaly", "spiralled"),
    "test": ("banded", "bumpy", "crosshatched", "knitted", "sprinkled", "stratified", "woven"),
}  # fmt: skip


def images_folder(root: Path) -> Path:
    """``root/images``, or ``root/dtd/images`` when ``root`` is the folder the archive was extracted in."""
    inner = root / "dtd" / "images"
    return inner if not (root / "images").is_dir() and inner.is_dir() else root / "images"


def class_folders(root: Path, split: str, help: str) -> list[Path]:
    """The folders of the split's classes, sorted by name; a folder missing or without images is one line."""
    images, wanted = images_folder(root), TEXTURE_SPLITS[split]
    missing = [c for c in wanted if not (images / c).is_dir()]
    if missing:
        raise ValueError(
            f"{images} has no class folder {missing[0]}/ ({len(missing)} of the {len(wanted)} classes of the {split} "
            f"split missing): Meta-Dataset's {split} split of Describable Textures reads images/<class>/ for each of "
            f"its classes; the archive is partly extracted or another data set's; {help}"
        )
    folders = [images / c for c in wanted]
    empty = [f for f in folders if not files.image_files(f)]
    if empty:
        raise ValueError(
            f"{empty[0]} holds no image (.jpg), and the {split} split of Describable Textures reads the images of "
            f"each of its {len(wanted)} classes; {help}"
        )
    return folders


def read(root: Path, split: str, side: int, help: str) -> Decoded:
    folders = class_folders(root, split, help)
    paths = [(c, p) for c, folder in enumerate(folders) for p in files.image_files(folder)]
    files.one_file_each([p for _, p in paths], help)
    images = files.decode_all([(str(p), p.read_bytes) for _, p in paths], side, help)
    return Decoded(images, np.array([c for c, _ in paths], dtype=np.int64), [f.name for f in folders])


def inputs(root: Path, split: str) -> list[Path]:
    # The images of the split's classes that are there; a missing class is the reader's error to report.
    images = images_folder(root)
    return [p for c in TEXTURE_SPLITS[split] if (images / c).is_dir() for p in files.image_files(images / c)]
