"""The layouts mini-ImageNet, tieredImageNet, CIFAR-FS and FC100 are held in, and which one a folder holds.

A layout is a set of files per split (``train``, ``val``, ``test``) and a reader of one split's
files. :func:`detect` picks the layout by the files present; a layout whose files are only
partly there is an error naming the missing file, never a silent fall-back to another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import fungi, textures
from . import image_files as files
from .image_files import Decoded

SPLITS = ("train", "val", "test")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way a data set is held: its name, the files of a split and their reader."""

    name: str  # e.g. "ren-pickles"
    origin: str  # who publishes (or uses) it
    files: Callable[[Path, str], list[Path]]  # (root, split) -> the files (or folders) read for that split
    read: Callable[[Path, str, int, str], Decoded]  # (root, split, side, help) -> images, labels, classes
    # (root) -> why the layout's files are there without their data, else None: the CSVs of a folder that
    # cbfinn/maml's proc_images.py has emptied, when another layout may hold the images.
    hollow: Callable[[Path], str | None] = lambda root: None
    # (root, split) -> every file the reader reads, for the cache key (default: ``files``, all files).
    inputs: Callable[[Path, str], list[Path]] | None = None
    # (root, split, help) -> the split's class names, where they are known without decoding (folder names,
    # a CSV's labels): the splits are checked before any is decoded. None: known by decoding only.
    names: Callable[[Path, str, str], list[str]] | None = None

    def read_files(self, root: Path, split: str) -> list[Path]:
        """Every file :attr:`read` reads for ``split``: the images of a folder, not the folder."""
        return self.inputs(root, split) if self.inputs is not None else self.files(root, split)

    def describe(self, root: Path) -> str:
        """The files of this layout, for an error message: ``train.csv, val.csv, test.csv and images/``."""
        names = [p.name + ("/" if p.suffix == "" else "") for s in SPLITS for p in self.files(root, s)]
        unique = list(dict.fromkeys(names))
        return f"{self.name} ({self.origin}: {', '.join(unique)})"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A data set: its name, image side, classes per split, variable, layouts and where it comes from."""

    name: str  # as papers write it, e.g. "mini-ImageNet"
    key: str  # --dataset value and cache-file prefix
    side: int  # image side in pixels
    counts: tuple[int, int, int]  # classes in train, val, test
    env: str  # the environment variable naming its folder
    source: str  # where researchers get the files
    layouts: tuple[Layout, ...]  # in the order they are looked for
    channels: int = 3  # of each image as read: 3 (RGB), or 1 where the set is grayscale

    def help(self) -> str:
        return f"{self.name} is not downloaded at run time: {self.source} (docs/data.md lists each layout)."


# ---------------------------------------------------------------------- readers


def _read_folders(root: Path, split: str, side: int, help: str) -> Decoded:
    return files.read_folders(root / split, side, help)


def _read_cifar_folders(root: Path, split: str, side: int, help: str) -> Decoded:
    return files.read_folders(root / split, side, help, exact=True)  # CIFAR's images are 32x32 in every source


def _read_csv(root: Path, split: str, side: int, help: str) -> Decoded:
    return files.read_csv_split(root / f"{split}.csv", root / "images", side, help)


def _csv_inputs(root: Path, split: str) -> list[Path]:
    # The images the split's CSV lists, not all of images/ (the other splits' too). A malformed CSV or
    # a missing image is the reader's error to report, with the data set's help.
    try:
        rows = files.csv_rows(root / f"{split}.csv", "")
    except ValueError:
        return [root / f"{split}.csv"]
    listed = (root / "images" / name for name, _ in rows)
    return [root / f"{split}.csv", *(p for p in listed if p.is_file())]


def _csv_without_images(root: Path) -> str | None:
    """Why the CSV layout's ``images/`` holds no image, else ``None``.

    cbfinn/maml's ``proc_images.py`` moves every image from ``images/`` into ``train|val|test/<wnid>/``
    and leaves the CSVs and an empty ``images/``; a copy-based conversion may remove ``images/``.
    """
    images = root / "images"
    if not images.is_dir():
        return f"{images} does not exist"
    if any(p.suffix.lower() in files.IMAGE_SUFFIXES for p in images.iterdir()):
        return None
    return f"{images} holds no image"


def _checked(images: np.ndarray, raw_labels: object, path: Path, help: str) -> np.ndarray:
    labels = files.as_array(raw_labels, f"{path}: the labels", help).reshape(-1)
    if labels.shape[0] != images.shape[0] or labels.dtype.kind not in "iu":
        raise ValueError(
            f"{path} holds {images.shape[0]} images and {labels.shape[0]} labels of dtype {labels.dtype}: one "
            f"integer label per image is needed; {help}"
        )
    return labels


def _read_metaoptnet(path_of: Callable[[Path, str], Path]) -> Callable[[Path, str, int, str], Decoded]:
    """MetaOptNet's pickles: ``{"data": (N, S, S, 3) uint8, "labels": N ints}`` (maybe ``catname2label``)."""

    def read(root: Path, split: str, side: int, help: str) -> Decoded:
        path = path_of(root, split)
        payload = files.read_pickle(path, help)
        images = files.as_images(files.field(payload, ["data"], path, help), side, path, help)
        raw = _checked(images, files.field(payload, ["labels"], path, help), path, help)
        names = payload.get("catname2label") if isinstance(payload, dict) else None
        by_label = {v: str(k) for k, v in names.items()} if isinstance(names, dict) else None
        labels, classes = files.relabel(raw, by_label)
        return Decoded(images, labels, classes)

    return read


def _read_ren_mini(root: Path, split: str, side: int, help: str) -> Decoded:
    """Ren et al.'s ``mini-imagenet-cache-<split>.pkl``: ``image_data`` and ``class_dict`` (name -> indices)."""
    path = root / f"mini-imagenet-cache-{split}.pkl"
    payload = files.read_pickle(path, help)
    images = files.as_images(files.field(payload, ["image_data"], path, help), side, path, help)
    class_dict = files.field(payload, ["class_dict"], path, help)
    if not isinstance(class_dict, dict):
        raise ValueError(f"{path}: class_dict is a {type(class_dict).__name__}, not a dict of class -> indices; {help}")
    labels = np.full(images.shape[0], -1, dtype=np.int64)
    classes = sorted(class_dict, key=str)
    for c, name in enumerate(classes):
        index = _indices(class_dict[name], f"{path}: class_dict[{name!r}]", help)
        if index.size and (index.min() < 0 or index.max() >= images.shape[0]):
            raise ValueError(f"{path}: class_dict[{name!r}] indexes past its {images.shape[0]} images; {help}")
        # An image listed twice could be the support and the query image of one task; in two classes,
        # the later class took it without a word.
        values, counts = np.unique(index, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"{path}: class_dict[{name!r}] lists image {int(values[counts > 1][0])} twice; an image is listed "
                f"once; {help}"
            )
        taken = labels[index] >= 0
        if taken.any():
            i = int(index[taken][0])
            raise ValueError(
                f"{path}: image {i} is in class_dict[{classes[labels[i]]!r}] and in class_dict[{name!r}]; an image "
                f"belongs to one class; {help}"
            )
        labels[index] = c
    keep = labels >= 0  # an image in no class is not in the split
    return Decoded(images[keep], labels[keep], [str(c) for c in classes])


def _indices(value: object, where: str, help: str) -> np.ndarray:
    """``value`` as a 1-D int64 array of image indices; a boolean mask or non-integer numbers are refused.

    Casting would read a mask of 12 images as the indices 0 and 1, and 3.6 as image 3.
    """
    array = files.as_array(value, where, help)
    if array.dtype == np.bool_:
        raise ValueError(f"{where} is a boolean mask of {array.size} entries, not a list of image indices; {help}")
    if array.size and array.dtype.kind not in "iu":
        odd = next((v for v in array.reshape(-1).tolist() if not isinstance(v, int) or isinstance(v, bool)), None)
        raise ValueError(f"{where} holds {array.dtype} values such as {odd!r}, not integer image indices; {help}")
    return array.astype(np.int64).reshape(-1)


def _read_ren_tiered(root: Path, split: str, side: int, help: str) -> Decoded:
    """Ren et al.'s ``<split>_images_png.pkl`` (a PNG file per image, as arrays or bytes) and ``<split>_labels.pkl``."""
    image_path, label_path = root / f"{split}_images_png.pkl", root / f"{split}_labels.pkl"
    blobs = files.read_pickle(image_path, help)
    if not isinstance(blobs, (list, tuple, np.ndarray)):
        raise ValueError(f"{image_path} holds a {type(blobs).__name__}, not a list of PNG-encoded images; {help}")
    payload = files.read_pickle(label_path, help)
    raw = files.field(payload, ["label_specific", "labels"], label_path, help)
    raw = files.as_array(raw, f"{label_path}: label_specific", help).reshape(-1)
    if raw.shape[0] != len(blobs):
        raise ValueError(
            f"{label_path} holds {raw.shape[0]} labels for the {len(blobs)} images of {image_path}; {help}"
        )
    if raw.size and raw.dtype.kind not in "iu":  # 3.0 or 3.6 as class 3 would be a guess
        raise ValueError(
            f"{label_path}: label_specific holds {raw.dtype} values such as {raw[0].item()!r}, not integer class "
            f"labels (one per image, as Ren's files hold); {help}"
        )
    names = payload.get("label_specific_str") if isinstance(payload, dict) else None
    # Each image's bytes are taken when it is decoded, not all at once: tieredImageNet's train split
    # holds 11 GB of PNG files.
    images = files.decode_all(
        [(f"{i} of {image_path}", _png(blob, i, image_path, help)) for i, blob in enumerate(blobs)], side, help
    )
    by_label = {i: str(n) for i, n in enumerate(names)} if isinstance(names, (list, tuple)) else None
    labels, classes = files.relabel(raw, by_label)
    if by_label is not None:
        return Decoded(images, labels, classes)
    # Ren's label_specific restarts at 0 in each split: class 0 of train and class 0 of val are two classes,
    # which only the names tell apart. Without them the split is read, and the check it escapes is said.
    return Decoded(
        images,
        labels,
        classes,
        f"{label_path} holds no label_specific_str (the classes' WordNet ids), and its label_specific numbers "
        f"restart at 0 in each split: its classes are named by those numbers, and whether the {split} split "
        f"shares a class with another was not checked",
    )


def _png(blob: object, index: int, path: Path, help: str) -> Callable[[], bytes]:
    """The reader of one image of Ren's tieredImageNet pickle: the bytes of its encoded file.

    Ren's released pickles hold each PNG as a uint8 array (``cv2.imencode``'s output); pickles
    written again from Python hold it as ``bytes``, and Python 2 ones as a ``str``, which is read
    as latin-1 and so encodes back to the same bytes.
    """
    if isinstance(blob, (bytes, bytearray)):
        return lambda: bytes(blob)
    if isinstance(blob, str):
        return lambda: blob.encode("latin-1")
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8:
        return blob.tobytes
    if (
        isinstance(blob, np.ndarray)
        and blob.dtype.kind in "iu"
        and (blob.size == 0 or 0 <= blob.min() <= blob.max() < 256)
    ):
        return blob.astype(np.uint8).tobytes  # byte values held in a wider integer type
    what = f"an array of {blob.dtype}" if isinstance(blob, np.ndarray) else f"a {type(blob).__name__}"
    raise ValueError(
        f"{path}: image {index} is {what}, not an encoded image (PNG bytes, or an array of their byte values); {help}"
    )


def _read_metaoptnet_tiered(root: Path, split: str, side: int, help: str) -> Decoded:
    """MetaOptNet's ``<split>_images.npz`` (``images``) and ``<split>_labels.pkl`` (``labels``)."""
    image_path, label_path = root / f"{split}_images.npz", root / f"{split}_labels.pkl"
    images = files.as_images(files.read_npz(image_path, "images", help), side, image_path, help)
    payload = files.read_pickle(label_path, help)
    raw = _checked(images, files.field(payload, ["labels", "label_specific"], label_path, help), label_path, help)
    labels, classes = files.relabel(raw)
    return Decoded(images, labels, classes)


# ---------------------------------------------------------------------- layouts

_METAOPT_MINI = {
    "train": "miniImageNet_category_split_train_phase_train.pickle",
    "val": "miniImageNet_category_split_val.pickle",
    "test": "miniImageNet_category_split_test.pickle",
}


def _folders(read: Callable[[Path, str, int, str], Decoded]) -> Layout:
    return Layout(
        "folders",
        "cbfinn/maml's proc_images.py, MAML++",
        lambda r, s: [r / s],
        read,
        inputs=lambda r, s: [p for _, p in files.folder_images(r / s)],
        names=lambda r, s, help: [p.name for p in files.class_folders(r / s)],
    )


FOLDERS = _folders(_read_folders)
CIFAR_FOLDERS = _folders(_read_cifar_folders)  # of 32x32 images only


def _pickles(prefix: str) -> Layout:
    return Layout(
        "metaoptnet-pickles",
        "MetaOptNet, few-shot-meta-baseline",
        lambda r, s: [r / f"{prefix}_{s}.pickle"],
        _read_metaoptnet(lambda r, s: r / f"{prefix}_{s}.pickle"),
    )


MINI_IMAGENET = DataSpec(
    "mini-ImageNet",
    "miniimagenet",
    84,
    (64, 16, 20),
    "MINIIMAGENET_DIR",
    "Ravi and Larochelle's split CSVs are in github.com/twitter/meta-learning-lstm (data/miniImagenet) beside the "
    "images/ of Vinyals et al.; Ren et al.'s mini-imagenet-cache-*.pkl are the files learn2learn reads; MetaOptNet's "
    "miniImageNet_category_split_*.pickle are linked from github.com/kjunelee/MetaOptNet",
    (
        Layout(
            "ren-pickles", "Ren et al., learn2learn", lambda r, s: [r / f"mini-imagenet-cache-{s}.pkl"], _read_ren_mini
        ),
        Layout(
            "metaoptnet-pickles",
            "MetaOptNet, few-shot-meta-baseline",
            lambda r, s: [r / _METAOPT_MINI[s]],
            _read_metaoptnet(lambda r, s: r / _METAOPT_MINI[s]),
        ),
        Layout(
            "ravi-csv",
            "Ravi and Larochelle, LibFewShot, FEAT",
            lambda r, s: [r / f"{s}.csv", r / "images"],
            _read_csv,
            _csv_without_images,
            _csv_inputs,
            lambda r, s, help: sorted({label for _, label in files.csv_rows(r / f"{s}.csv", help)}),
        ),
        FOLDERS,
    ),
)
TIERED_IMAGENET = DataSpec(
    "tieredImageNet",
    "tieredimagenet",
    84,
    (351, 97, 160),
    "TIEREDIMAGENET_DIR",
    "Ren et al.'s <split>_images_png.pkl and <split>_labels.pkl are linked from "
    "github.com/renmengye/few-shot-ssl-public; MetaOptNet's <split>_images.npz and <split>_labels.pkl from "
    "github.com/kjunelee/MetaOptNet",
    (
        Layout(
            "ren-pickles",
            "Ren et al.",
            lambda r, s: [r / f"{s}_images_png.pkl", r / f"{s}_labels.pkl"],
            _read_ren_tiered,
        ),
        Layout(
            "metaoptnet-npz",
            "MetaOptNet, RFS",
            lambda r, s: [r / f"{s}_images.npz", r / f"{s}_labels.pkl"],
            _read_metaoptnet_tiered,
        ),
        FOLDERS,
    ),
)
CIFAR_FS = DataSpec(
    "CIFAR-FS",
    "cifarfs",
    32,
    (64, 16, 20),
    "CIFARFS_DIR",
    "Bertinetto et al.'s split of CIFAR-100; MetaOptNet's CIFAR_FS_<split>.pickle are linked from "
    "github.com/kjunelee/MetaOptNet",
    (_pickles("CIFAR_FS"), CIFAR_FOLDERS),
)
FC100 = DataSpec(
    "FC100",
    "fc100",
    32,
    (60, 20, 20),
    "FC100_DIR",
    "Oreshkin et al.'s superclass split of CIFAR-100; MetaOptNet's FC100_<split>.pickle are linked from "
    "github.com/kjunelee/MetaOptNet",
    (_pickles("FC100"), CIFAR_FOLDERS),
)
# Describable Textures and FGVC Fungi: their split lists and readers are in textures.py and fungi.py.
DTD_LAYOUT = Layout(
    "dtd-r1.0.1",
    "dtd-r1.0.1.tar.gz extracted; the folder dtd/ or the one holding it",
    lambda r, s: [textures.images_folder(r)],
    textures.read,
    inputs=textures.inputs,
    names=lambda r, s, help: [f.name for f in textures.class_folders(r, s, help)],
)
DTD = DataSpec(
    "Describable Textures",
    "dtd",
    84,
    tuple(len(textures.TEXTURE_SPLITS[s]) for s in ("train", "val", "test")),  # type: ignore[arg-type]
    "DTD_DIR",
    "Cimpoi et al.'s dtd-r1.0.1.tar.gz (dtd/images/<class>/*.jpg) is at www.robots.ox.ac.uk/~vgg/data/dtd/; the "
    "classes of each split are Meta-Dataset's",
    (DTD_LAYOUT,),
)
FUNGI_LAYOUT = Layout(
    "fgvcx-2018",
    "fungi_train_val.tgz and train_val_annotations.tgz extracted into one folder",
    lambda r, s: [r / "images", *(r / name for name in fungi.LABEL_FILES)],
    fungi.read,
    inputs=fungi.inputs,
    names=fungi.names,
)
FUNGI = DataSpec(
    "FGVC Fungi",
    "fungi",
    84,
    (len(fungi.FUNGI_SPLITS["train"]), len(fungi.FUNGI_SPLITS["val"]), len(fungi.FUNGI_SPLITS["test"])),
    "FUNGI_DIR",
    "the FGVCx 2018 fungi challenge's fungi_train_val.tgz (images/) and train_val_annotations.tgz (train.json, "
    "val.json), extracted into one folder, are linked from github.com/visipedia/fgvcx_fungi_comp; the categories of "
    "each split are Meta-Dataset's",
    (FUNGI_LAYOUT,),
)

DATASETS: dict[str, DataSpec] = {d.key: d for d in (MINI_IMAGENET, TIERED_IMAGENET, CIFAR_FS, FC100, DTD, FUNGI)}
# Then cub, aircraft, flowers and quickdraw, which their modules (tasks/_src/cub.py, aircraft.py, flowers.py,
# quickdraw.py) add as tasks imports them.


def _present(layout: Layout, root: Path) -> list[Path]:
    # By each split's first file, the one only this layout has (Ren's and MetaOptNet's tieredImageNet
    # share <split>_labels.pkl, and differ by their images' file).
    found = [p for p in (layout.files(root, s)[0] for s in SPLITS) if p.exists()]
    if layout.name == "folders":  # a split folder counts when it holds class folders
        found = [p for p in found if p.is_dir() and files.class_folders(p)]
    return found


def _read_by(layout: Layout, root: Path, split: str, missing: Path) -> str:
    """Which splits read ``missing``: ``the train split``, or ``read for every split`` (FGVC Fungi's JSONs)."""
    every = all(missing in layout.files(root, s) for s in SPLITS)
    return "read for every split" if every else f"the {split} split"


def detect(spec: DataSpec, root: Path, split: str) -> Layout:
    """The layout ``root`` holds ``split`` of ``spec`` in.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: one line: no layout's files are there, or a layout's files are there for some
            splits and not for ``split`` (naming the missing file).
    """
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is a file, not the folder holding the data"
        raise FileNotFoundError(f"{spec.name} folder {root} {what}; {spec.help()}")
    hollow: tuple[Layout, Path, str] | None = None
    for layout in spec.layouts:
        present = _present(layout, root)
        if not present:
            continue
        why = layout.hollow(root)
        if why is not None:
            # The images may have been moved into another layout's files (proc_images.py's class folders).
            hollow = hollow or (layout, present[0], why)
            continue
        missing = [p for p in layout.files(root, split) if not p.exists()]
        if missing:
            raise ValueError(
                f"{root} holds {present[0].name} of the {layout.name} layout but not {missing[0].name} "
                f"({_read_by(layout, root, split, missing[0])}); {spec.help()}"
            )
        return layout
    if hollow is not None:
        layout, found, why = hollow
        others = ", ".join(other.name for other in spec.layouts if other is not layout)
        raise ValueError(
            f"{root} holds {found.name} of the {layout.name} layout, but {why}, and the files of no other layout "
            f"({others}) are there: cbfinn/maml's proc_images.py moves the images into train/, val/ and test/, a "
            f"folder per class, which are read as the folders layout; put the images back or point at the folder "
            f"holding them. {spec.help()}"
        )
    expected = "; ".join(layout.describe(root) for layout in spec.layouts)
    raise ValueError(f"{root} holds none of the {spec.name} layouts, expected one of: {expected}. {spec.help()}")
