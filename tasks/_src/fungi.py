"""The FGVCx 2018 fungi challenge's images (FGVC Fungi) in Meta-Dataset's split of its 1,394 categories.

Read from ``fungi_train_val.tgz`` (``images/<category folder>/<file>.JPG``) and
``train_val_annotations.tgz`` (``train.json``, ``val.json``) extracted into one folder. The two
COCO-style files are read together, as Meta-Dataset does: their ``images`` and ``annotations``
(``image_id`` -> ``category_id``) give each image its category, and a class is a category, named
``<id, 4 digits>.<name>`` as Meta-Dataset names it (two categories share a name). Each split
holds the categories Meta-Dataset (Triantafillou et al. 2020) puts in it, as learn2learn's
``FGVCFungi`` ships them: 994 / 200 / 200. Images of any size are resized to 84 x 84.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import image_files as files
from .image_files import Decoded

NUM_CATEGORIES = 1394  # the 2018 challenge's categories, ids 0-1393


def _ids(text: str) -> frozenset[int]:
    return frozenset(int(i) for i in text.split())


# Meta-Dataset's split by category id (learn2learn's fgvc_fungi.SPLITS, whose class '0226.Cortinarius
# malicorius' is category 226): the validation and test categories; the train split holds the other 994.
_VAL = _ids("""
    0 4 6 15 22 28 32 36 45 58 61 64 71 73 80 87 91 95 101 102 104 110 117 121 126 134 138 142 148 149
    152 159 162 163 209 217 224 227 229 231 236 258 265 273 276 286 294 296 313 315 325 327 328 329 332
    341 353 354 355 357 366 369 370 371 374 378 389 396 401 409 410 414 417 418 425 430 435 463 464 466
    470 494 496 520 533 534 537 552 555 561 565 567 583 592 602 605 607 622 624 641 649 653 658 659 667
    684 694 698 702 705 706 712 715 718 730 731 741 743 755 780 788 800 802 815 827 845 848 862 865 866
    873 880 884 888 892 901 905 910 932 948 949 968 970 973 977 991 994 996 1006 1008 1014 1016 1019
    1026 1027 1028 1036 1043 1057 1075 1092 1097 1106 1110 1123 1126 1134 1137 1143 1145 1150 1151 1153
    1173 1199 1203 1214 1224 1228 1230 1233 1237 1240 1242 1247 1255 1257 1261 1278 1279 1294 1320 1321
    1328 1341 1350 1354 1363 1375 1379
""")
_TEST = _ids("""
    8 9 19 38 44 53 55 62 63 69 70 78 93 96 99 103 105 118 129 132 141 151 153 156 165 175 176 179 184
    190 205 220 223 232 234 247 277 279 289 291 316 321 326 356 359 381 382 390 393 395 397 408 413 431
    433 444 453 457 460 462 472 479 482 484 491 492 498 501 502 505 517 535 536 539 541 574 580 584 587
    596 600 604 609 616 618 620 627 637 651 661 674 677 680 688 695 703 713 722 724 726 727 729 742 760
    764 765 784 787 790 792 799 803 805 807 812 817 820 826 834 838 849 853 857 871 885 893 904 907 909
    914 915 917 935 937 938 940 947 955 960 963 966 971 976 987 989 997 999 1012 1018 1024 1030 1031
    1032 1033 1034 1062 1076 1077 1084 1086 1094 1096 1098 1104 1105 1107 1111 1115 1117 1120 1129 1133
    1157 1165 1169 1194 1231 1234 1238 1249 1250 1253 1262 1264 1265 1273 1280 1299 1305 1314 1318 1344
    1348 1352 1362 1366 1373 1376 1382 1388
""")
FUNGI_SPLITS: dict[str, frozenset[int]] = {
    "train": frozenset(range(NUM_CATEGORIES)) - _VAL - _TEST,
    "val": _VAL,
    "test": _TEST,
}
LABEL_FILES = ("train.json", "val.json")
_NEEDS = (
    "FGVC Fungi reads the COCO-style train.json and val.json of train_val_annotations.tgz ('images' with 'id' and "
    "'file_name', 'annotations' with 'image_id' and 'category_id', 'categories' with 'id' and 'name')"
)


class Annotations(NamedTuple):
    """train.json and val.json read together: each image's file, category and where it is listed."""

    images: list[tuple[str, int, Path]]  # (file_name, category id, the JSON listing it)
    names: dict[int, str]  # category id -> name


def _json(path: Path, help: str) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{files.unreadable(path, exc)}; {help}") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): it is truncated or another "
            f"file; {_NEEDS}; {help}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not JSON text ({exc.reason}): it is another file; {_NEEDS}; {help}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} holds a JSON {type(payload).__name__}, not an object; {_NEEDS}; {help}")
    return payload


def _entries(payload: dict[str, Any], key: str, path: Path, help: str) -> list[dict[str, Any]]:
    value = payload.get(key)
    if not isinstance(value, list):
        what = (
            f"{path}: its '{key}' is a {type(value).__name__}, not a list"
            if key in payload
            else f"{path} has no '{key}'"
        )
        raise ValueError(f"{what}; {_NEEDS}; {help}")
    return value


def _field(entries: list[Any], i: int, key: str, name: str, kind: type, path: Path, help: str) -> Any:
    entry = entries[i]
    value = entry.get(name) if isinstance(entry, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        shown = json.dumps(entry)[:80]
        raise ValueError(
            f"{path}: {key}[{i}] has no {'integer' if kind is int else 'string'} '{name}' (it is {shown}); "
            f"{_NEEDS}; {help}"
        )
    return value


def read_annotations(root: Path, help: str) -> Annotations:
    """``root``'s train.json and val.json, checked, read again only when either file changed."""
    stamps = []
    for name in LABEL_FILES:
        try:
            st = (root / name).stat()
        except OSError as exc:
            raise ValueError(f"{files.unreadable(root / name, exc)}; {help}") from None
        stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return _annotations(root, tuple(stamps), help)


@functools.lru_cache(maxsize=4)
def _annotations(root: Path, stamps: tuple[Any, ...], help: str) -> Annotations:
    names: dict[int, tuple[str, Path]] = {}
    listed: dict[int, tuple[str, Path, int]] = {}  # image id -> (file_name, JSON, index)
    by_file: dict[str, tuple[Path, int]] = {}
    category: dict[int, tuple[int, Path, int]] = {}  # image id -> (category id, JSON, index of its annotation)
    payloads = [(root / name, _json(root / name, help)) for name in LABEL_FILES]
    for path, payload in payloads:
        entries = _entries(payload, "categories", path, help)
        for i in range(len(entries)):
            cid = _field(entries, i, "categories", "id", int, path, help)
            name = _field(entries, i, "categories", "name", str, path, help)
            if not 0 <= cid < NUM_CATEGORIES:
                raise ValueError(
                    f"{path}: categories[{i}] has the id {cid}, outside the 0-{NUM_CATEGORIES - 1} of the 2018 "
                    f"challenge's {NUM_CATEGORIES:,} categories, which Meta-Dataset splits; {help}"
                )
            first = names.setdefault(cid, (name, path))
            if first[0] != name:
                raise ValueError(
                    f"{path}: categories[{i}] names category {cid} {name!r}, and {first[1]} names it {first[0]!r}: "
                    f"train.json and val.json hold one list of categories; {help}"
                )
        entries = _entries(payload, "images", path, help)
        for i in range(len(entries)):
            iid = _field(entries, i, "images", "id", int, path, help)
            file_name = _field(entries, i, "images", "file_name", str, path, help)
            if iid in listed:
                _, other, j = listed[iid]
                raise ValueError(
                    f"{path}: images[{i}] has the id {iid} of images[{j}] of {other.name}: an image is listed once; "
                    f"{help}"
                )
            if file_name in by_file:
                other, j = by_file[file_name]
                raise ValueError(
                    f"{path}: images[{i}] names {file_name}, as images[{j}] of {other.name} does: an image is listed "
                    f"once; {help}"
                )
            listed[iid], by_file[file_name] = (file_name, path, i), (path, i)
    for path, payload in payloads:
        entries = _entries(payload, "annotations", path, help)
        for i in range(len(entries)):
            iid = _field(entries, i, "annotations", "image_id", int, path, help)
            cid = _field(entries, i, "annotations", "category_id", int, path, help)
            if iid not in listed:
                raise ValueError(
                    f"{path}: annotations[{i}] has the image_id {iid}, which no entry of 'images' in train.json or "
                    f"val.json has; {help}"
                )
            if cid not in names:
                raise ValueError(
                    f"{path}: annotations[{i}] has the category_id {cid}, which no entry of 'categories' has; {help}"
                )
            if iid in category:
                _, other, j = category[iid]
                raise ValueError(
                    f"{path}: annotations[{i}] labels image {iid} again (annotations[{j}] of {other.name} labels it): "
                    f"an image has one category; {help}"
                )
            category[iid] = (cid, path, i)
    unlabelled = [iid for iid in listed if iid not in category]
    if unlabelled:
        file_name, path, i = listed[unlabelled[0]]
        raise ValueError(
            f"{path}: images[{i}] ({file_name}) has no annotation, so no category ({len(unlabelled)} such images); "
            f"{help}"
        )
    images = [(file_name, category[iid][0], path) for iid, (file_name, path, _) in listed.items()]
    return Annotations(images, {cid: name for cid, (name, _) in names.items()})


def _split_images(root: Path, split: str, help: str) -> tuple[list[tuple[Path, int]], list[int], Annotations]:
    """The split's ``(image file, class)`` in class order, its category ids, and the annotations."""
    notes = read_annotations(root, help)
    wanted = FUNGI_SPLITS[split]
    rows = sorted(
        ((file_name, cid, path) for file_name, cid, path in notes.images if cid in wanted), key=lambda r: r[1]
    )
    missing = [(file_name, path) for file_name, _, path in rows if not (root / file_name).is_file()]
    if missing:
        file_name, path = missing[0]
        raise ValueError(
            f"{path} lists {len(missing)} images of the {split} split missing from {root} (first: {file_name}): "
            f"fungi_train_val.tgz is extracted beside train.json and val.json; {help}"
        )
    categories = sorted({cid for _, cid, _ in rows})
    label = {cid: c for c, cid in enumerate(categories)}
    return [(root / file_name, label[cid]) for file_name, cid, _ in rows], categories, notes


def _class_names(categories: list[int], notes: Annotations) -> list[str]:
    return [f"{cid:04d}.{notes.names[cid]}" for cid in categories]  # Meta-Dataset's label of a category


def read(root: Path, split: str, side: int, help: str) -> Decoded:
    rows, categories, notes = _split_images(root, split, help)
    files.one_file_each([p for p, _ in rows], help)
    images = files.decode_all([(str(p), p.read_bytes) for p, _ in rows], side, help)
    return Decoded(images, np.array([c for _, c in rows], dtype=np.int64), _class_names(categories, notes))


def names(root: Path, split: str, help: str) -> list[str]:
    _, categories, notes = _split_images(root, split, help)
    return _class_names(categories, notes)


def inputs(root: Path, split: str) -> list[Path]:
    # The label files and the split's images; a malformed file or a missing image is the reader's error to report.
    labels = [root / name for name in LABEL_FILES]
    try:
        notes = read_annotations(root, "")
    except ValueError:
        return labels
    wanted = FUNGI_SPLITS[split]
    return [*labels, *(p for f, cid, _ in notes.images if cid in wanted if os.path.isfile(p := root / f))]
