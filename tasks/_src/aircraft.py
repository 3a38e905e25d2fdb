"""FGVC-Aircraft (Maji et al. 2013) in Meta-Dataset's split: 70/15/15 of its 100 variants, read from the extracted archive.

``fgvc-aircraft-2013b.tar.gz`` extracts to ``fgvc-aircraft-2013b/data/`` holding ``images/<id>.jpg`` and
``images_variant_{train,val,test}.txt`` (``<id> <variant, maybe with spaces>``; the archive's own split of
the images, whose union is read: Meta-Dataset splits by variant). The root is ``fgvc-aircraft-2013b`` or
the folder holding it. Each image loses the copyright banner along its bottom (20 pixels, as the
data set's authors say), or is cropped to its box in ``images_box.txt`` (``<id> <xmin> <ymin> <xmax>
<ymax>``, pixels counted from 1, both ends in the box).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from . import image_files as files
from .fine_grained import Crop, FineGrainedImages, box_crop, decode_all, lines, numbers
from .image_data import IMAGE_DATASETS
from .image_files import Decoded
from .image_layouts import DATASETS, DataSpec, Layout

FOLDER = "fgvc-aircraft-2013b"
BANNER = 20  # the copyright banner's height in pixels, at the bottom of every image
VARIANT_FILES = tuple(f"images_variant_{s}.txt" for s in ("train", "val", "test"))

# Meta-Dataset's variant split (Triantafillou et al. 2020), as learn2learn ships it (fgvc_aircraft.py), in its order.
CLASS_SPLITS: dict[str, tuple[str, ...]] = {
    "train": (
        "A340-300",
        "A318",
        "Falcon 2000",
        "F-16A/B",
        "F/A-18",
        "C-130",
        "MD-80",
        "BAE 146-200",
        "777-200",
        "747-400",
        "Cessna 172",
        "An-12",
        "A330-300",
        "A321",
        "Fokker 100",
        "Fokker 50",
        "DHC-1",
        "Fokker 70",
        "A340-200",
        "DC-6",
        "747-200",
        "Il-76",
        "747-300",
        "Model B200",
        "Saab 340",
        "Cessna 560",
        "Dornier 328",
        "E-195",
        "ERJ 135",
        "747-100",
        "737-600",
        "C-47",
        "DR-400",
        "ATR-72",
        "A330-200",
        "727-200",
        "737-700",
        "PA-28",
        "ERJ 145",
        "737-300",
        "767-300",
        "737-500",
        "737-200",
        "DHC-6",
        "Falcon 900",
        "DC-3",
        "Eurofighter Typhoon",
        "Challenger 600",
        "Hawk T1",
        "A380",
        "777-300",
        "E-190",
        "DHC-8-100",
        "Cessna 525",
        "Metroliner",
        "EMB-120",
        "Tu-134",
        "Embraer Legacy 600",
        "Gulfstream IV",
        "Tu-154",
        "MD-87",
        "A300B4",
        "A340-600",
        "A340-500",
        "MD-11",
        "707-320",
        "Cessna 208",
        "Global Express",
        "A319",
        "DH-82",
    ),
    "val": (
        "737-900",
        "757-300",
        "767-200",
        "A310",
        "A320",
        "BAE 146-300",
        "CRJ-900",
        "DC-10",
        "DC-8",
        "DC-9-30",
        "DHC-8-300",
        "Gulfstream V",
        "SR-20",
        "Tornado",
        "Yak-42",
    ),
    "test": (
        "737-400",
        "737-800",
        "757-200",
        "767-400",
        "ATR-42",
        "BAE-125",
        "Beechcraft 1900",
        "Boeing 717",
        "CRJ-200",
        "CRJ-700",
        "E-170",
        "L-1011",
        "MD-90",
        "Saab 2000",
        "Spitfire",
    ),
}
ALL_VARIANTS = frozenset(v for names in CLASS_SPLITS.values() for v in names)


def _data(root: Path) -> Path:
    """``root/data``, or ``root/fgvc-aircraft-2013b/data`` when ``root`` holds the extracted folder."""
    if not (root / "data").exists() and (root / FOLDER).is_dir():
        return root / FOLDER / "data"
    return root / "data"


def _files(boxes: bool) -> Any:
    def files_of(root: Path, split: str) -> list[Path]:
        data = _data(root)
        return [
            data / "images",
            *(data / name for name in VARIANT_FILES),
            *([data / "images_box.txt"] if boxes else []),
        ]

    return files_of


def _variants(root: Path, help: str) -> dict[str, str]:
    """Every image id with its variant, from the three variant files (an id listed twice is refused)."""
    data = _data(root)
    seen: dict[str, tuple[str, int]] = {}
    variant_of: dict[str, str] = {}
    for name in VARIANT_FILES:
        path = data / name
        for number, (image_id, variant) in lines(path, 2, help, "'<image id> <variant>'"):
            variant = variant.strip()
            if image_id in seen:
                first, line = seen[image_id]
                raise ValueError(
                    f"{path}: line {number} lists the image {image_id}, which {first} lists on line {line}; an image "
                    f"is listed once; {help}"
                )
            if variant not in ALL_VARIANTS:
                raise ValueError(
                    f"{path}: line {number} names the variant {variant!r}, none of FGVC-Aircraft's 100; {help}"
                )
            seen[image_id] = (name, number)
            variant_of[image_id] = variant
    return variant_of


def _listed(root: Path, split: str, help: str) -> list[tuple[str, Path, int]]:
    """``(image id, file, class index)`` of the split's images."""
    images = _data(root) / "images"
    classes = {v: i for i, v in enumerate(CLASS_SPLITS[split])}
    out = [(i, images / f"{i}.jpg", classes[v]) for i, v in _variants(root, help).items() if v in classes]
    empty = sorted(set(classes.values()) - {c for _, _, c in out})
    if empty:
        raise ValueError(
            f"{images.parent}: {', '.join(VARIANT_FILES)} list no image of the variant "
            f"{CLASS_SPLITS[split][empty[0]]!r} ({len(empty)} of the {split} split's {len(classes)} without one); "
            f"{help}"
        )
    missing = [p for _, p, _ in out if not p.is_file()]
    if missing:
        raise ValueError(
            f"{images} holds no {missing[0].name} ({len(missing)} of the {split} split's images missing), listed in "
            f"{', '.join(VARIANT_FILES)}; {help}"
        )
    return out


def _names(root: Path, split: str, help: str) -> list[str]:
    _listed(root, split, help)
    return list(CLASS_SPLITS[split])


def banner_crop(where: str, help: str) -> Crop:
    def crop(width: int, height: int) -> tuple[int, int, int, int]:
        if height <= BANNER:
            raise files._Refused(
                f"{where} is {width}x{height} pixels: the {BANNER}-pixel copyright banner at its bottom leaves "
                f"nothing; {help}"
            )
        return 0, 0, width, height - BANNER

    return crop


def _boxes(path: Path, help: str) -> dict[str, tuple[float, float, float, float]]:
    what = "'<image id> <xmin> <ymin> <xmax> <ymax>'"
    boxes = {}
    for number, fields in lines(path, 5, help, what):
        xmin, ymin, xmax, ymax = numbers(path, number, fields[1:], help, what)
        boxes[fields[0]] = (xmin - 1, ymin - 1, xmax, ymax)  # from 1, both ends in: to a half-open box from 0
    return boxes


def _reader(boxes: bool) -> Any:
    def read(root: Path, split: str, side: int, help: str) -> Decoded:
        listed = _listed(root, split, help)
        files.one_file_each([p for _, p, _ in listed], help)
        if boxes:
            path = _data(root) / "images_box.txt"
            table = _boxes(path, help)
            absent = [image_id for image_id, _, _ in listed if image_id not in table]
            if absent:
                raise ValueError(f"{path} holds no box of the image {absent[0]}; {help}")
            crops = [box_crop(table[i], f"{path} for {p}", help) for i, p, _ in listed]
        else:
            crops = [banner_crop(str(p), help) for _, p, _ in listed]
        images = decode_all([(p, crop) for (_, p, _), crop in zip(listed, crops)], side, help)
        labels = np.array([c for _, _, c in listed], dtype=np.int64)
        return Decoded(images, labels, list(CLASS_SPLITS[split]))

    return read


def _inputs(boxes: bool) -> Any:
    def inputs(root: Path, split: str) -> list[Path]:
        data = _data(root)
        texts = [*(data / name for name in VARIANT_FILES), *([data / "images_box.txt"] if boxes else [])]
        try:
            listed = _listed(root, split, "")
        except ValueError:  # the reader reports it, with the data set's help
            return texts
        return [*texts, *(p for _, p, _ in listed)]

    return inputs


def layout(boxes: bool = False) -> Layout:
    """The extracted archive, banner or box crops (the option is in the layout's name, and so in the cache key)."""
    return Layout(
        "extracted" + ("+bounding-boxes" if boxes else ""),
        "Oxford VGG's fgvc-aircraft-2013b.tar.gz",
        _files(boxes),
        _reader(boxes),
        inputs=_inputs(boxes),
        names=_names,
    )


AIRCRAFT = DataSpec(
    "FGVC-Aircraft",
    "aircraft",
    84,
    (70, 15, 15),
    "AIRCRAFT_DIR",
    "extract fgvc-aircraft-2013b.tar.gz from https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/ and pass the "
    "fgvc-aircraft-2013b folder (holding data/images/ and data/images_variant_*.txt) or the folder holding it",
    (layout(),),
)


class Aircraft(FineGrainedImages):
    """FGVC-Aircraft (Maji et al. 2013) in Meta-Dataset's split: 70/15/15 aircraft variants, 84x84 RGB.

    Args:
        root, split, class_counts, cache_dir, cache: as :class:`tasks.FewShotImages`; ``root`` is the
            extracted ``fgvc-aircraft-2013b`` folder (holding ``data/``) or the folder holding it.
        bounding_box_crop: crop each image to its box in ``data/images_box.txt`` instead of cutting the
            20-pixel copyright banner off its bottom.
    """

    spec = AIRCRAFT
    _archive = ("fgvc-aircraft-2013b.tar.gz", "tar xzf fgvc-aircraft-2013b.tar.gz")

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        split: str = "train",
        *,
        bounding_box_crop: bool = False,
        **kwargs: Any,
    ) -> None:
        self._load(root, split, dataclasses.replace(AIRCRAFT, layouts=(layout(bounding_box_crop),)), kwargs)


# Registered after the sets of image_layouts and image_data (--dataset aircraft).
DATASETS[AIRCRAFT.key] = AIRCRAFT
IMAGE_DATASETS[AIRCRAFT.key] = Aircraft
