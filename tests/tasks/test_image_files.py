"""What researchers' copies of the image data sets hold besides clean 8-bit files: 16-bit images, broken links,
macOS's zip folders, a full disk, labels without names, classes that differ by case, hard links."""

from __future__ import annotations

import io
import os
import pickle
import resource
import shutil
import signal
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SPLITS, folder_writer, random_images, write_csv, write_ren_mini, write_ren_tiered
from PIL import Image

import tasks
from tasks._src import cache as cache_module

SMALL = (6, 5, 5)  # classes per split of the small copies (class_counts= says so)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))


def _wide(gray: np.ndarray, mode: str) -> bytes:
    """``gray`` (8-bit) as a 16-bit image of the same look: each value ``v`` stored as ``v * 257``."""
    wide = gray.astype(np.uint16) * 257
    out = io.BytesIO()
    if mode == "I;16":  # a 16-bit grayscale PNG, which this Pillow opens as I;16
        Image.fromarray(wide).save(out, format="PNG")
    else:  # Pillow before 10.3 opened the same PNG as mode I (32-bit); this Pillow writes no such PNG, and reads
        # a TIFF of mode I whatever its name says, so one stands in for it
        Image.fromarray(wide.astype(np.int32)).save(out, format="TIFF")
    with Image.open(io.BytesIO(out.getvalue())) as im:
        assert im.mode == mode
    return out.getvalue()


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_a_16_bit_image_reads_as_its_8_bit_original_not_white(tmp_path: Path, mode: str) -> None:
    """convert("RGB") clipped 16-bit values at 255: an image of mean 39.3 was cached with mean 255.0."""
    folder_writer(84)(tmp_path, SMALL)
    gray = random_images(1, 84, seed=5)[0, :, :, 0] // 4  # dark, as the image (mean about 32)
    path = tmp_path / "train" / "n00000000" / "0.png"
    path.write_bytes(_wide(gray, mode))
    train = tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    first = train.images[0]
    assert torch.equal(first, torch.from_numpy(gray).expand(3, 84, 84)), float(first.float().mean())


def test_a_floating_point_image_is_refused_naming_it(tmp_path: Path) -> None:
    folder_writer(84)(tmp_path, SMALL)
    path = tmp_path / "train" / "n00000000" / "0.png"
    out = io.BytesIO()
    Image.fromarray(np.full((84, 84), 0.5, np.float32)).save(out, format="TIFF")
    path.write_bytes(out.getvalue())
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{path} is a floating-point image (PIL mode F)" in message, message


@pytest.fixture
def file_size_limit() -> Iterator[Callable[[int], None]]:
    """Sets the largest file this process may write (a disk that fills mid-write, without a small mount)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG) instead of killing us
    yield lambda size: resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def test_a_disk_that_fills_while_the_cache_is_written_warns_and_leaves_no_partial_file(
    tmp_path: Path, file_size_limit: Callable[[int], None]
) -> None:
    """torch.save's "RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos" was a traceback, and
    its .pt.<random>.tmp stayed behind, keeping the disk full."""
    folder_writer(84)(tmp_path / "data", SMALL)
    file_size_limit(64 * 1024)  # the train split's cache is about 260 kB
    with pytest.warns(RuntimeWarning, match="could not write the decoded mini-ImageNet cache in any of"):
        train = tasks.MiniImageNet(tmp_path / "data", "train", class_counts=SMALL)
    assert not train.from_cache and train.cache_path is None and train.num_classes == SMALL[0]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


@pytest.mark.parametrize("layout", ["folders", "ravi-csv"])
def test_a_broken_link_among_the_images_is_named_as_one(tmp_path: Path, layout: str) -> None:
    """The cache key's stat() was "[Errno 2] No such file or directory: '.../20.png'", a traceback."""
    if layout == "folders":
        folder_writer(84)(tmp_path, SMALL)
        link = tmp_path / "train" / "n00000000" / "20.png"
    else:
        write_csv(tmp_path, SMALL)
        link = tmp_path / "images" / sorted(p.name for p in (tmp_path / "images").iterdir())[0]
        link.unlink()
    link.symlink_to(tmp_path / "elsewhere" / "20.png")
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and "docs/data.md" in message, message
    if layout == "folders":
        assert f"{link} is a broken link: it points to {tmp_path / 'elsewhere' / '20.png'}" in message, message
    else:
        assert f"(first: {link.name}, a broken link to {tmp_path / 'elsewhere' / '20.png'})" in message, message


def _macos_zip_folder(split: Path) -> str:
    (split / "__MACOSX" / "n00000000").mkdir(parents=True)
    (split / "__MACOSX" / "n00000000" / "._0.png").write_bytes(b"\x00\x05\x16\x07")  # an AppleDouble file
    return ""


def _link_loop(split: Path) -> str:
    (split / "zz").symlink_to("..")
    return "zz (a link to .., a folder above it)"


def _empty_folder(split: Path) -> str:
    (split / "n00000099").mkdir()
    return "n00000099 (no image)"


def _odd_name(split: Path) -> str:
    shutil.copytree(split / "n00000000", split / "scratch")
    return "scratch (named unlike the others, such as n00000000)"


@pytest.mark.parametrize("extra", [_macos_zip_folder, _link_loop, _empty_folder, _odd_name])
def test_a_folder_that_is_no_class_is_named_or_skipped(tmp_path: Path, extra: Callable[[Path], str]) -> None:
    """A macOS zip's train/__MACOSX/ or a link train/zz -> .. was "class 65" in "train holds 65 classes"."""
    folder_writer(32)(tmp_path, SMALL)
    said = extra(tmp_path / "train")
    if not said:  # skipped, as .DS_Store is
        assert tasks.CIFARFS.splits(tmp_path, class_counts=SMALL).train.num_classes == SMALL[0]
        return
    with pytest.raises(ValueError) as info:
        tasks.CIFARFS.splits(tmp_path, class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"{tmp_path / 'train'} holds 7 classes, and the train split" in message, message
    assert f"; what looks like no class: {said}:" in message, message
    with pytest.raises(ValueError) as info:  # one split: decoded before its classes are counted
        tasks.CIFARFS(tmp_path, class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and said.split(" (")[0] in message, message


def test_a_csv_split_and_its_images_are_named_as_two_files(tmp_path: Path) -> None:
    """ "val.csv, images holds 15 classes" joined two names into one path."""
    write_csv(tmp_path, SMALL)
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "val")
    message = str(info.value)
    assert f"{tmp_path}: val.csv and images/ hold 5 classes, and the val split of mini-ImageNet has 16" in message


def _ren_test_class_renamed(root: Path) -> tuple[type[tasks.FewShotImages], str, str]:
    """Ren's mini-ImageNet whose test pickle holds the train split's class n00000000, spelt N00000000."""
    write_ren_mini(root, SMALL)
    train, test = (pickle.loads((root / f"mini-imagenet-cache-{s}.pkl").read_bytes()) for s in ("train", "test"))
    test["image_data"] = np.concatenate([test["image_data"], train["image_data"][:2]])
    test["class_dict"]["N00000000"] = [len(test["image_data"]) - 2, len(test["image_data"]) - 1]
    (root / "mini-imagenet-cache-test.pkl").write_bytes(pickle.dumps(test))
    return tasks.MiniImageNet, "mini-imagenet-cache-train.pkl", "mini-imagenet-cache-test.pkl"


def _folder_copied_in_other_case(root: Path) -> tuple[type[tasks.FewShotImages], str, str]:
    folder_writer(32)(root, SMALL)
    shutil.copytree(root / "train" / "n00000000", root / "test" / "N00000000")
    return tasks.CIFARFS, str(root / "train" / "n00000000"), str(root / "test" / "N00000000")


@pytest.mark.parametrize("write", [_folder_copied_in_other_case, _ren_test_class_renamed], ids=["folders", "ren"])
def test_classes_differing_only_by_case_between_splits_are_refused(tmp_path: Path, write) -> None:
    """ntr000000 in train and NTR000000 in test, the same images, passed the disjointness check."""
    cls, train, test = write(tmp_path)
    with pytest.raises(ValueError) as info:
        cls.splits(tmp_path, class_counts=(6, 5, 6))
    message = str(info.value)
    said = f"class n00000000 of the train split ({train}) and class N00000000 of the test split ({test}) differ only"
    assert "\n" not in message and said in message, message


@pytest.mark.parametrize("where", ["two-classes", "two-splits", "one-class"])
def test_one_image_hard_linked_twice_is_refused_naming_both_paths(tmp_path: Path, where: str) -> None:
    """The same image hard-linked into two classes was read twice, as an image of each."""
    folder_writer(32)(tmp_path, SMALL)
    image = tmp_path / "train" / "n00000000" / "0.png"
    folder = {"two-classes": "train/n00000001", "two-splits": "test/n00000011", "one-class": "train/n00000000"}[where]
    link = tmp_path / folder / "99.png"
    os.link(image, link)
    loads = [lambda: tasks.CIFARFS.splits(tmp_path, class_counts=SMALL)]
    if where != "two-splits":
        loads.append(lambda: tasks.CIFARFS(tmp_path, "train", class_counts=SMALL))
    for load in loads:
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and f"{image} and {link} are one file (hard links" in message, message


def _png_header(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` 8-bit RGB pixels in its header, and holding none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))


@pytest.mark.parametrize("case", ["not-an-image", "400-megapixels"])
def test_an_image_pil_refuses_is_one_line_with_its_reason_and_no_object_repr(tmp_path: Path, case: str) -> None:
    """Messages printed "<_io.BytesIO object at 0x...>", and the decompression-bomb refusal ended "corrupt or
    truncated"."""
    folder_writer(84)(tmp_path, SMALL)
    path = tmp_path / "train" / "n00000000" / "0.png"
    path.write_bytes(b"<html>not found</html>" if case == "not-an-image" else _png_header(20_000, 20_000))
    with pytest.raises(ValueError) as info:
        tasks.MiniImageNet(tmp_path, "train", class_counts=SMALL)
    message = str(info.value)
    assert "\n" not in message and f"cannot decode the image {path}" in message and "BytesIO" not in message, message
    if case == "not-an-image":
        assert "(cannot identify image file): the file is corrupt or truncated" in message, message
    else:
        assert "(400000000 pixels) exceeds limit" in message and "corrupt" not in message, message
        assert "resize it (or remove it)" in message, message


def test_tiered_labels_without_their_names_are_read_and_say_what_was_not_checked(tmp_path: Path) -> None:
    """Without label_specific_str, Ren's label_specific (from 0 in each split) was refused as "class 0 is in the
    train split ... a split's file was copied over another's"."""
    write_ren_tiered(tmp_path, SMALL)
    named = tasks.TieredImageNet.splits(tmp_path, class_counts=SMALL, cache=False)
    for split in SPLITS:
        path = tmp_path / f"{split}_labels.pkl"
        payload = pickle.loads(path.read_bytes())
        path.write_bytes(pickle.dumps({"label_specific": payload["label_specific"]}))
    for attempt in ("cold", "warm"):  # the warm load, from the cache, says so too
        with pytest.warns(RuntimeWarning) as caught:
            splits = tasks.TieredImageNet.splits(tmp_path, class_counts=SMALL)
        lines = [str(w.message) for w in caught]
        assert len(lines) == 3 and all("\n" not in line for line in lines), lines
        assert lines[0] == (
            f"{tmp_path / 'train_labels.pkl'} holds no label_specific_str (the classes' WordNet ids), and its "
            f"label_specific numbers restart at 0 in each split: its classes are named by those numbers, and whether "
            f"the train split shares a class with another was not checked."
        )
        assert all(p.from_cache == (attempt == "warm") for p in splits)
        for part, before in zip(splits, named):
            assert part.classes == [str(i) for i in range(part.num_classes)] and part.unchecked
            assert torch.equal(part.images, before.images) and torch.equal(part.labels, before.labels)
    assert not named.train.unchecked


def test_a_warm_load_reads_only_the_files_changed_and_a_moved_folder_keeps_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every warm start hashed every image (7-15 s at mini-ImageNet's 60,000 JPEGs), and a folder moved whole was
    decoded again, its old cache left behind."""
    root = tmp_path / "data"
    folder_writer(32)(root, SMALL, per_class=3)
    cold = tasks.CIFARFS(root, "train", class_counts=SMALL)
    read: list[str] = []
    real_open = open

    def counted(path, *args, **kwargs):
        read.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(cache_module, "open", counted, raising=False)
    warm = tasks.CIFARFS(root, "train", class_counts=SMALL)
    assert warm.from_cache and warm.cache_path == cold.cache_path and read == []
    image = sorted((root / "train" / "n00000002").iterdir())[0]
    image.chmod(0o600)  # its status-change time moves: hashed again, and its content decides
    again = tasks.CIFARFS(root, "train", class_counts=SMALL)
    assert again.from_cache and again.cache_path == cold.cache_path and read == [image.name]
    moved = tmp_path / "moved"
    root.rename(moved)
    there = tasks.CIFARFS(moved, "train", class_counts=SMALL)
    assert there.from_cache and there.cache_path == cold.cache_path and read == [image.name]
    assert torch.equal(there.images, cold.images) and there.classes == cold.classes
