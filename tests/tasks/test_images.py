"""mini-ImageNet, tieredImageNet, CIFAR-FS and FC100 in every layout, on small files the tests write."""

from __future__ import annotations

import csv
import os
import pickle
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    SPLITS,
    folder_writer,
    random_images,
    replace_keeping_size_and_time,
    split_data,
    uncompressed_png,
    write_csv,
    write_ren_mini,
    write_ren_tiered,
)
from PIL import Image

import tasks
from tasks._src import cache as cache_module

SMALL = (6, 5, 5)  # classes per split of the small copies (class_counts= says so)


def metaopt_writer(names: dict[str, str], side: int) -> Callable[..., None]:
    def write(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
        for split in SPLITS:
            images, labels = split_data(counts, split, side, per_class)
            with open(root / names[split], "wb") as f:
                pickle.dump({"data": images, "labels": labels.tolist()}, f, protocol=2)

    return write


def write_metaopt_tiered(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
    for split in SPLITS:
        images, labels = split_data(counts, split, 84, per_class)
        np.savez(root / f"{split}_images.npz", images=images)
        with open(root / f"{split}_labels.pkl", "wb") as f:
            pickle.dump({"labels": labels.tolist()}, f)


MINI_METAOPT = {
    "train": "miniImageNet_category_split_train_phase_train.pickle",
    "val": "miniImageNet_category_split_val.pickle",
    "test": "miniImageNet_category_split_test.pickle",
}
# (data set class, layout name, writer, the file the refusals damage)
CASES = [
    (tasks.MiniImageNet, "ren-pickles", write_ren_mini, "mini-imagenet-cache-train.pkl"),
    (tasks.MiniImageNet, "metaoptnet-pickles", metaopt_writer(MINI_METAOPT, 84), MINI_METAOPT["train"]),
    (tasks.MiniImageNet, "ravi-csv", write_csv, "train.csv"),
    (tasks.MiniImageNet, "folders", folder_writer(84), "train"),
    (tasks.TieredImageNet, "ren-pickles", write_ren_tiered, "train_images_png.pkl"),
    (tasks.TieredImageNet, "metaoptnet-npz", write_metaopt_tiered, "train_images.npz"),
    (tasks.TieredImageNet, "folders", folder_writer(84), "train"),
    (
        tasks.CIFARFS,
        "metaoptnet-pickles",
        metaopt_writer({s: f"CIFAR_FS_{s}.pickle" for s in SPLITS}, 32),
        "CIFAR_FS_train.pickle",
    ),
    (tasks.CIFARFS, "folders", folder_writer(32), "train"),
    (
        tasks.FC100,
        "metaoptnet-pickles",
        metaopt_writer({s: f"FC100_{s}.pickle" for s in SPLITS}, 32),
        "FC100_train.pickle",
    ),
    (tasks.FC100, "folders", folder_writer(32), "train"),
]
IDS = [f"{c.spec.key}-{layout}" for c, layout, _, _ in CASES]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(("cls", "layout", "write", "damaged"), CASES, ids=IDS)
def test_each_layout_is_detected_read_cached_and_sampled(tmp_path: Path, cls, layout, write, damaged) -> None:
    root = tmp_path / "data"
    root.mkdir()
    write(root, SMALL)
    splits = cls.splits(root, class_counts=SMALL)
    side = cls.spec.side
    for part, count in zip(splits, SMALL):
        assert part.layout == layout and part.num_classes == count and not part.from_cache
        assert part.images.dtype == torch.uint8 and tuple(part.images.shape) == (2 * count, 3, side, side)
        assert sorted(set(part.labels.tolist())) == list(range(count))
        if layout not in ("ravi-csv",):  # JPEG is lossy; the other layouts keep the pixels exactly
            images, labels = split_data(SMALL, part.split, side, 2)
            order = np.argsort(labels, kind="stable")
            assert torch.equal(part.images, torch.from_numpy(images[order]).permute(0, 3, 1, 2))
    again = cls(root, "val", class_counts=SMALL)
    assert again.from_cache and again.cache_path == splits.validation.cache_path
    assert torch.equal(again.images, splits.validation.images) and again.classes == splits.validation.classes
    batch = splits.train.sampler(ways=3, shots=1, query=1).sample(4, torch.Generator().manual_seed(0))
    assert tuple(batch.support_x.shape) == (4, 3, 3, side, side) and batch.support_x.max() <= 1


@pytest.mark.parametrize(("cls", "layout", "write", "damaged"), CASES, ids=IDS)
def test_a_truncated_or_missing_file_is_refused_in_one_line_naming_it(tmp_path: Path, cls, layout, write, damaged):
    root = tmp_path / "data"
    root.mkdir()
    write(root, SMALL)
    path = root / damaged
    if path.is_dir():  # a folder layout: one class's image truncated
        image = sorted(path.glob("*/*.png"))[0]
        image.write_bytes(image.read_bytes()[:40])
        named = image.name
    elif path.suffix == ".csv":
        path.write_text("name;label\n")
        named = damaged
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        named = damaged
    with pytest.raises(ValueError) as info:
        cls(root, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and named in message and "docs/data.md" in message
    assert cls(root, "test", class_counts=SMALL).num_classes == SMALL[2]  # the other splits still read
    for missing in [root / damaged] if not path.is_dir() else []:
        missing.unlink()
        with pytest.raises(ValueError, match=f"not {damaged}.*the train split"):
            cls(root, "train", class_counts=SMALL)


def test_the_published_class_counts_are_checked(tmp_path: Path) -> None:
    """The full 64/16/20 split of one image per class passes; 16 classes where 64 belong are refused."""
    write_ren_mini(tmp_path, (64, 16, 20), per_class=1)
    splits = tasks.MiniImageNet.splits(tmp_path)
    assert [p.num_classes for p in splits] == [64, 16, 20]
    for name in SPLITS:
        (tmp_path / f"mini-imagenet-cache-{name}.pkl").unlink()
    write_ren_mini(tmp_path, (16, 16, 20), per_class=1)
    with pytest.raises(ValueError, match=r"mini-imagenet-cache-train.pkl holds 16 classes.*has 64 \(ren-pickles"):
        tasks.MiniImageNet(tmp_path, "train")
    metaopt_writer({s: f"FC100_{s}.pickle" for s in SPLITS}, 32)(tmp_path, (60, 20, 20), per_class=1)
    assert [p.num_classes for p in tasks.FC100.splits(tmp_path)] == [60, 20, 20]
    with pytest.raises(ValueError, match="holds 20 classes, and the val split of CIFAR-FS has 16"):
        _cifar_as_fc100(tmp_path)


def _cifar_as_fc100(root: Path) -> None:
    """FC100's files renamed as CIFAR-FS's: its 20 validation classes are not CIFAR-FS's 16."""
    for split in SPLITS:
        (root / f"FC100_{split}.pickle").rename(root / f"CIFAR_FS_{split}.pickle")
    tasks.CIFARFS(root, "val")


def test_no_layout_a_missing_folder_and_a_wrong_pickle_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tasks.TieredImageNet(tmp_path / "nowhere")
    (tmp_path / "readme.txt").write_text("hello")
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "none of the mini-ImageNet layouts" in message
    assert "mini-imagenet-cache-train.pkl" in message and "train.csv" in message and "docs/data.md" in message
    with open(tmp_path / "CIFAR_FS_train.pickle", "wb") as f:
        pickle.dump({"images": np.zeros((2, 32, 32, 3), np.uint8)}, f)
    with pytest.raises(ValueError, match=r"CIFAR_FS_train.pickle holds no 'data' \(it holds \['images'\]\)"):
        tasks.CIFARFS(tmp_path, class_counts=SMALL)
    with open(tmp_path / "FC100_train.pickle", "wb") as f:
        pickle.dump({"data": np.zeros((2, 84, 84, 3), np.uint8), "labels": [0, 1]}, f)
    with pytest.raises(ValueError, match=r"not \(N, 32, 32, 3\) uint8"):
        tasks.FC100(tmp_path, class_counts=SMALL)


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    class Exploit:
        def __reduce__(self):
            return (print, ("ran",))

    with open(tmp_path / "FC100_train.pickle", "wb") as f:
        pickle.dump({"data": Exploit()}, f)
    with pytest.raises(ValueError, match="asks for builtins.print"):
        tasks.FC100(tmp_path, class_counts=SMALL)


def test_the_root_comes_from_the_data_sets_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CIFARFS_DIR", raising=False)
    with pytest.raises(ValueError, match=r"pass root= the folder or set \$CIFARFS_DIR"):
        tasks.CIFARFS()
    folder_writer(32)(tmp_path, SMALL, per_class=1)
    monkeypatch.setenv("CIFARFS_DIR", str(tmp_path))
    assert tasks.CIFARFS(split="validation", class_counts=SMALL).num_classes == SMALL[1]


class _Huge:
    """Pickles as ``numpy.ndarray((2**40,))``: names the unpickler allows, building a terabyte."""

    def __reduce__(self):
        return (np.ndarray, ((2**40,),))


def test_a_pickle_claiming_more_than_it_holds_is_one_line_naming_it(tmp_path: Path) -> None:
    """12 bytes whose BINBYTES8 opcode claims 2**62 bytes: refused before anything is allocated."""
    path = tmp_path / "FC100_train.pickle"
    path.write_bytes(pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 2**62) + b"abc" + pickle.STOP)
    with pytest.raises(ValueError) as info:
        tasks.FC100(tmp_path, class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "asks for 4,611,686,018,427,387,904 more bytes" in message
    # Allowed names alone can still describe more than the machine holds: one line too, not numpy's traceback.
    path.write_bytes(pickle.dumps({"data": _Huge()}, protocol=2))
    with pytest.raises(ValueError, match=r"FC100_train.pickle: what it describes needs more memory") as info:
        tasks.FC100(tmp_path, class_counts=SMALL)
    assert "\n" not in str(info.value)


def _python2_list_of_str(blobs: list[bytes]) -> bytes:
    """The pickle Python 2 writes for a list of ``str`` (BINSTRING opcodes), which Python 3 reads as latin-1 text."""
    items = b"".join(pickle.BINSTRING + struct.pack("<i", len(b)) + b for b in blobs)
    return pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + pickle.MARK + items + pickle.APPENDS + pickle.STOP


@pytest.mark.parametrize("form", ["bytes", "bytes-protocol-2", "python-2-str"])
def test_tiered_pickles_holding_each_png_as_bytes_read_as_the_arrays_do(tmp_path: Path, form: str) -> None:
    """Ren's released files hold uint8 arrays; pickles written again hold ``bytes`` (the docstring's "PNG bytes")."""
    write_ren_tiered(tmp_path, SMALL)
    arrays = tasks.TieredImageNet.splits(tmp_path, class_counts=SMALL, cache=False)
    for split in SPLITS:
        path = tmp_path / f"{split}_images_png.pkl"
        with open(path, "rb") as f:
            blobs = [a.tobytes() for a in pickle.load(f)]
        if form == "python-2-str":
            path.write_bytes(_python2_list_of_str(blobs))
        else:
            path.write_bytes(pickle.dumps(blobs, protocol=2 if form == "bytes-protocol-2" else 4))
    again = tasks.TieredImageNet.splits(tmp_path, class_counts=SMALL, cache=False)
    for a, b in zip(arrays, again):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.classes == b.classes


def test_a_tiered_image_neither_bytes_nor_uint8_is_one_line_naming_the_file(tmp_path: Path) -> None:
    write_ren_tiered(tmp_path, SMALL)
    path = tmp_path / "train_images_png.pkl"
    with open(path, "rb") as f:
        blobs = pickle.load(f)
    for bad, said in ((blobs[3].astype(np.float64), "image 3 is an array of float64"), (b"not a png", "image 3")):
        path.write_bytes(pickle.dumps([*blobs[:3], bad, *blobs[4:]]))
        with pytest.raises(ValueError) as info:
            tasks.TieredImageNet(tmp_path, "train", class_counts=SMALL, cache=False)
        message = str(info.value)
        assert "\n" not in message and str(path) in message and said in message


def test_a_csv_row_listed_twice_is_one_line_naming_the_file_the_image_and_the_class(tmp_path: Path) -> None:
    write_csv(tmp_path, SMALL)
    path = tmp_path / "train.csv"
    rows = path.read_text().splitlines()
    path.write_text("\n".join([*rows, rows[1]]) + "\n")  # the first image again, as a copy-paste leaves it
    name, label = rows[1].split(",")
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert (
        "\n" not in message and f"{path} lists {name} twice, in rows 2 and {len(rows) + 1} (class {label})" in message
    )


def _ren_class_dict_case(case: str, class_dict: dict[str, list[int]], images: int) -> str:
    """Damages the class_dict of Ren's pickle as ``case`` says; the message expected."""
    first, second = sorted(class_dict)[:2]
    if case == "in-two-classes":
        class_dict[second] = [*class_dict[second], class_dict[first][0]]
        return f"image {class_dict[first][0]} is in class_dict['{first}'] and in class_dict['{second}']"
    if case == "twice-in-a-class":
        class_dict[second] = [*class_dict[second], class_dict[second][0]]
        return f"class_dict['{second}'] lists image {class_dict[second][0]} twice"
    if case == "float-indices":
        class_dict[second] = [i + 0.6 for i in class_dict[second]]
        return f"class_dict['{second}'] holds float64 values such as {class_dict[second][0]}"
    mask = [i in class_dict[second] for i in range(images)]  # "boolean-mask"
    class_dict[second] = mask
    return f"class_dict['{second}'] is a boolean mask of {images} entries"


@pytest.mark.parametrize("case", ["in-two-classes", "twice-in-a-class", "float-indices", "boolean-mask"])
def test_ren_class_dict_indices_are_each_image_once_and_integers(tmp_path: Path, case: str) -> None:
    """Read as they were, the later class took a shared image, 3.6 was image 3 and a mask of 12 was images 0 and 1."""
    write_ren_mini(tmp_path, SMALL)
    path = tmp_path / "mini-imagenet-cache-train.pkl"
    with open(path, "rb") as f:
        payload = pickle.load(f)
    said = _ren_class_dict_case(case, payload["class_dict"], len(payload["image_data"]))
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{path}: " in message and said in message, message


def proc_images(root: Path) -> None:
    """What cbfinn/maml's ``data/miniImagenet/proc_images.py`` does to a folder of Ravi's CSVs and ``images/``.

    Every image is resized to 84x84 with Lanczos and saved over itself (JPEG again, by its name), then moved
    (``mv``, so keeping its times) from ``images/`` into ``<split>/<label>/``; the CSVs and an empty ``images/``
    stay.
    """
    for image_file in (root / "images").glob("*"):
        with Image.open(image_file) as im:
            im.resize((84, 84), resample=Image.LANCZOS).save(image_file)
    for split in SPLITS:
        (root / split).mkdir()
        with open(root / f"{split}.csv") as f:
            for name, label in list(csv.reader(f))[1:]:
                (root / split / label).mkdir(exist_ok=True)
                os.rename(root / "images" / name, root / split / label / name)


@pytest.mark.parametrize("images", ["left-empty", "removed"])
def test_cbfinns_proc_images_output_is_read_as_the_folders_layout(tmp_path: Path, images: str) -> None:
    """The folder the MAML repository trains on: CSVs beside an empty (or, after a copying script, no) ``images/``."""
    write_csv(tmp_path, SMALL)
    proc_images(tmp_path)
    assert not list((tmp_path / "images").iterdir()) and (tmp_path / "train.csv").is_file()
    if images == "removed":
        (tmp_path / "images").rmdir()
    splits = tasks.MiniImageNet.splits(tmp_path, class_counts=SMALL, cache=False)
    for split, part, count in zip(SPLITS, splits, SMALL):
        assert part.layout == "folders" and part.num_classes == count and len(part) == 2 * count
        _, labels = split_data(SMALL, split, 84, 2)
        assert part.classes == [f"n{c:08d}" for c in np.unique(labels)]
        # The pixels are the resized files' own: moved, not decoded again.
        first = sorted((tmp_path / split / part.classes[0]).iterdir())[0]
        with Image.open(first) as im:
            assert torch.equal(part.images[0], torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1))


def test_csvs_beside_an_empty_images_folder_and_no_class_folders_say_what_was_found(tmp_path: Path) -> None:
    write_csv(tmp_path, SMALL)
    for image in (tmp_path / "images").iterdir():
        image.unlink()
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert (
        "\n" not in message
        and f"holds train.csv of the ravi-csv layout, but {tmp_path / 'images'} holds no image" in message
    )
    assert "proc_images.py moves the images into train/, val/ and test/" in message and "docs/data.md" in message


def _copy_val_over_test(root: Path) -> None:
    shutil.copy(root / "FC100_val.pickle", root / "FC100_test.pickle")


def _val_class_in_test_csv(root: Path) -> None:
    val = (root / "val.csv").read_text().splitlines()[1:]
    with open(root / "test.csv", "a") as f:
        f.writelines(row + "\n" for row in val if row.endswith(",n00000006"))


def _val_class_copied_into_test(root: Path) -> None:
    shutil.copytree(root / "val" / "n00000006", root / "test" / "n00000006")


@pytest.mark.parametrize(
    ("cls", "write", "leak", "counts", "files"),
    [
        (tasks.FC100, metaopt_writer({s: f"FC100_{s}.pickle" for s in SPLITS}, 32), _copy_val_over_test, SMALL,
         ("FC100_val.pickle", "FC100_test.pickle")),
        (tasks.MiniImageNet, write_csv, _val_class_in_test_csv, (6, 5, 6), ("val.csv, images", "test.csv, images")),
        (tasks.CIFARFS, folder_writer(32), _val_class_copied_into_test, (6, 5, 6), ("val", "test")),
    ],
    ids=["fc100-val-copied-over-test", "mini-csv-val-class-in-test", "cifarfs-val-class-folder-in-test"],
)  # fmt: skip
def test_a_class_in_two_splits_is_refused_in_one_line_naming_both(tmp_path: Path, cls, write, leak, counts, files):
    """``cp FC100_val.pickle FC100_test.pickle`` reported the validation classes as held-out test accuracy."""
    write(tmp_path, SMALL)
    leak(tmp_path)
    with pytest.raises(ValueError) as info:
        cls.splits(tmp_path, class_counts=counts)
    message = str(info.value)
    first = "6" if cls is tasks.FC100 else "n00000006"  # MetaOptNet's labels number the classes of all splits
    said = f"class {first} is in the val split ({files[0]}) and in the test split ({files[1]})"
    assert "\n" not in message and said in message and "disjoint" in message, message


CACHE_CHANGES = ["image-moved-to-another-class", "class-folder-renamed", "image-replaced-same-size-and-time"]


@pytest.mark.parametrize("by", ["content", "ctime"])
@pytest.mark.parametrize("change", CACHE_CHANGES)
def test_a_folders_cache_is_a_miss_whenever_its_labels_or_pixels_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, by: str
) -> None:
    """``mv`` and ``cp -p`` keep times: a key of (count, total size, newest time) served the old labels and pixels."""
    if by == "ctime":  # the key of folders above the hashing limit: status-change times stand in for content
        monkeypatch.setattr(cache_module, "HASH_LIMIT", 0)
    root = tmp_path / "data"
    folder_writer(32)(root, SMALL, per_class=4)
    train = root / "train"
    images = sorted(train.glob("*/*.png"))
    for i, path in enumerate(images):  # every image the same size, so that one can replace another
        path.write_bytes(uncompressed_png(random_images(1, 32, seed=100 + i)[0]))
    cold = tasks.CIFARFS(root, "train", class_counts=SMALL)
    assert not cold.from_cache and tasks.CIFARFS(root, "train", class_counts=SMALL).from_cache
    if by == "ctime":
        time.sleep(0.05)  # the kernel's file times tick every few milliseconds
    first, second = sorted(p for p in train.iterdir())[:2]
    if change == "image-moved-to-another-class":
        os.rename(images[0], second / "moved.png")  # mv: times kept
    elif change == "class-folder-renamed":
        os.rename(first, train / "n00000099")
    else:
        replace_keeping_size_and_time(images[0], uncompressed_png(random_images(1, 32, seed=7)[0]))
    warm = tasks.CIFARFS(root, "train", class_counts=SMALL)
    fresh = tasks.CIFARFS(root, "train", class_counts=SMALL, cache=False)
    assert not warm.from_cache and warm.cache_path != cold.cache_path
    assert torch.equal(warm.images, fresh.images) and torch.equal(warm.labels, fresh.labels)
    assert warm.classes == fresh.classes
    sizes = torch.bincount(warm.labels).tolist()
    assert sizes == {"image-moved-to-another-class": [3, 5, 4, 4, 4, 4]}.get(change, [4] * 6)
    assert (warm.classes[-1] == "n00000099") == (change == "class-folder-renamed")
    if change == "image-replaced-same-size-and-time":  # the first image's pixels, and nothing else
        assert not torch.equal(warm.images[0], cold.images[0]) and torch.equal(warm.images[1:], cold.images[1:])


def test_a_split_with_a_class_too_small_for_a_task_names_it(tmp_path: Path) -> None:
    """A class of 2 images at 1 shot and 15 query was never drawn; the results still said 6 classes."""
    folder_writer(32)(tmp_path, SMALL, per_class=16)
    small = sorted((tmp_path / "train" / "n00000003").iterdir())
    for path in small[2:]:
        path.unlink()
    train = tasks.CIFARFS(tmp_path, "train", class_counts=SMALL)
    assert train.sampler(5, 1, 1).num_classes == 6
    with pytest.raises(ValueError) as info:
        train.sampler(5, 1, 15)
    message = str(info.value)
    assert "\n" not in message and "class n00000003 (label 3) has 2, the smallest of 1 classes (of 6)" in message


def test_a_csv_with_a_byte_order_mark_is_read_as_without(tmp_path: Path) -> None:
    """Spreadsheets save CSV as UTF-8 with a byte-order mark; it was read into the header and refused."""
    write_csv(tmp_path, SMALL)
    plain = tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL, cache=False)
    path = tmp_path / "train.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    marked = tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL, cache=False)
    assert torch.equal(marked.images, plain.images) and marked.classes == plain.classes


def test_a_csv_cut_short_names_the_row(tmp_path: Path) -> None:
    """A copy that stopped mid-row was "not a 'filename,label' table with that header"."""
    write_csv(tmp_path, SMALL)
    path = tmp_path / "train.csv"
    text = path.read_text()
    cut = text.rstrip("\n").rsplit(",", 1)[0][:-3]  # the last row's file name, cut before its label
    path.write_text(cut)
    rows = len(cut.splitlines())
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{path}: row {rows} is " in message and "the file is cut short" in message
    path.write_text("name,class\n" + text.split("\n", 1)[1])
    with pytest.raises(ValueError, match=r"train.csv begins with 'name,class', not the header 'filename,label'"):
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)


def test_float_tiered_labels_say_so(tmp_path: Path) -> None:
    """Float label_specific was "holds 12 labels for the 12 images", the count it had right."""
    write_ren_tiered(tmp_path, SMALL)
    path = tmp_path / "train_labels.pkl"
    with open(path, "rb") as f:
        payload = pickle.load(f)
    payload["label_specific"] = payload["label_specific"].astype(np.float64)
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    with pytest.raises(ValueError) as info:
        tasks.TieredImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{path}: label_specific holds float64 values such as 0.0" in message


def _text(name: bytes) -> bytes:
    return pickle.BINUNICODE + struct.pack("<I", len(name)) + name


def _nested_labels_pickle(images: np.ndarray, depth: int) -> bytes:
    """MetaOptNet's pickle whose labels are a list nested ``depth`` deep (written by opcodes: pickle.dumps recurses)."""
    nested = pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)
    body = pickle.dumps(images, protocol=2)[2:-1]  # without its PROTO and STOP; it uses memo slots we do not
    return (
        pickle.PROTO + b"\x02" + pickle.EMPTY_DICT
        + _text(b"labels") + nested + pickle.SETITEM
        + _text(b"data") + body + pickle.SETITEM + pickle.STOP
    )  # fmt: skip


def test_labels_nested_too_deep_are_one_line_naming_the_file(tmp_path: Path) -> None:
    """numpy's "exceed the maximum number of dimension of 32" named no file."""
    path = tmp_path / "FC100_train.pickle"
    path.write_bytes(_nested_labels_pickle(np.zeros((2, 32, 32, 3), np.uint8), 200_000))
    with pytest.raises(ValueError) as info:
        tasks.FC100(tmp_path, class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{path}: the labels: not a flat list of numbers" in message


@pytest.mark.parametrize(
    ("cls", "side", "other"), [(tasks.CIFARFS, 84, 32), (tasks.FC100, 84, 32), (tasks.MiniImageNet, 32, 84)]
)
def test_class_folders_of_another_data_sets_image_size_are_refused(tmp_path: Path, cls, side: int, other: int) -> None:
    """mini-ImageNet's folders (84 px) trained as CIFAR-FS shrunk to 32 px: both have 64/16/20 classes."""
    folder_writer(side)(tmp_path, SMALL)
    with pytest.raises(ValueError) as info:
        cls(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    first = tmp_path / "train" / "n00000000" / "0.png"
    assert "\n" not in message and f"{first} is {side}x{side} pixels, not {other}x{other}" in message, message
    assert not list((tmp_path / "cache").glob("*"))


def _test_file_removed(root: Path) -> None:
    (root / "FC100_test.pickle").unlink()


def _test_class_folder_removed(root: Path) -> None:
    shutil.rmtree(root / "test" / "n00000015")


FC100_PICKLES = metaopt_writer({s: f"FC100_{s}.pickle" for s in SPLITS}, 32)


@pytest.mark.parametrize(
    ("cls", "write", "damage", "counts", "said", "decodes"),
    [
        (tasks.FC100, FC100_PICKLES, _copy_val_over_test, SMALL, "is in the val split", True),
        (tasks.FC100, FC100_PICKLES, _test_file_removed, SMALL, r"but not FC100_test.pickle \(the test split\)", False),
        (tasks.MiniImageNet, write_csv, _val_class_in_test_csv, (6, 5, 6), "is in the val split", False),
        (tasks.CIFARFS, folder_writer(32), _val_class_copied_into_test, (6, 5, 6), "is in the val split", False),
        (tasks.CIFARFS, folder_writer(32), _test_class_folder_removed, SMALL, "holds 4 classes", False),
    ],
    ids=["fc100-val-copied-over-test", "fc100-test-missing", "mini-csv-val-class-in-test",
         "cifarfs-val-class-folder-in-test", "cifarfs-test-class-missing"],
)  # fmt: skip
def test_a_refused_folder_leaves_no_cache(tmp_path: Path, monkeypatch, cls, write, damage, counts, said, decodes):
    """The splits decoded before the refused one kept their caches (1.27 GB for mini-ImageNet's train split)."""
    write(tmp_path, SMALL)
    damage(tmp_path)
    if not decodes:  # refused from the file names, folder names and CSV labels, before any image is decoded
        from tasks._src import image_files

        monkeypatch.setattr(image_files, "decode_all", lambda *a, **k: pytest.fail("decoded a split"))
        monkeypatch.setattr(image_files, "read_pickle", lambda *a, **k: pytest.fail("read a pickle"))
    with pytest.raises(ValueError, match=said):
        cls.splits(tmp_path, class_counts=counts)
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else True
