"""CUB-200-2011, FGVC-Aircraft and VGG Flowers 102 in Meta-Dataset's splits, on small copies the tests write
in each set's real layout (every class, an image or two each, of varied sizes and modes)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import jpeg, write_cub
from PIL import Image

import tasks
from tasks._src import aircraft as aircraft_module
from tasks._src import cub as cub_module
from tasks._src import fine_grained
from tasks._src import flowers as flowers_module

l2l_cub = pytest.importorskip("learn2learn.vision.datasets.cu_birds200")
l2l_aircraft = pytest.importorskip("learn2learn.vision.datasets.fgvc_aircraft")
l2l_flowers = pytest.importorskip("learn2learn.vision.datasets.vgg_flowers")
scipy_io = pytest.importorskip("scipy.io")

OURS = ("train", "val", "test")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))


def help_of(cls) -> str:
    return cls.spec.help()


# ---------------------------------------------------------------------- the copies


def write_aircraft(root: Path) -> Path:
    """``root/fgvc-aircraft-2013b/data/``: images/<id>.jpg (each with its banner), images_variant_*.txt, images_box.txt."""
    data = root / "fgvc-aircraft-2013b" / "data"
    (data / "images").mkdir(parents=True)
    variants = [v for split in OURS for v in aircraft_module.CLASS_SPLITS[split]]
    rows = {name: [] for name in ("train", "val", "test")}
    for i, variant in enumerate(variants):
        for k in range(3 if i % 10 == 0 else 2):
            image_id = f"{1000000 + 10 * i + k:07d}"
            (data / "images" / f"{image_id}.jpg").write_bytes(jpeg(i + k, size=(60 + i % 9, 50 + i % 7)))
            rows[("train", "val", "test")[(i + k) % 3]].append(f"{image_id} {variant}\n")
    for name, lines in rows.items():
        (data / f"images_variant_{name}.txt").write_text("".join(lines))
    (data / "images_variant_trainval.txt").write_text("".join(rows["train"] + rows["val"]))
    boxes = [f"{line.split()[0]} 3 4 30 25\n" for lines in rows.values() for line in lines]
    (data / "images_box.txt").write_text("".join(boxes))
    return root / "fgvc-aircraft-2013b"


FLOWER_LABELS = [c for c in range(1, 103) for _ in range(3 if c % 25 == 0 else 2)]  # image i's class: [i - 1]


def first_flower(c: int) -> str:
    return f"image_{FLOWER_LABELS.index(c) + 1:05d}.jpg"


def write_flowers(root: Path) -> Path:
    """``root/jpg/image_00001.jpg`` ... and ``root/imagelabels.mat`` (``labels``, 1 x N, classes 1..102)."""
    (root / "jpg").mkdir(parents=True)
    labels = FLOWER_LABELS
    for i in range(1, len(labels) + 1):
        (root / "jpg" / f"image_{i:05d}.jpg").write_bytes(jpeg(i))
    scipy_io.savemat(str(root / "imagelabels.mat"), {"labels": np.array([labels], dtype=np.uint8)})
    return root


# ---------------------------------------------------------------------- the splits are Meta-Dataset's


def test_the_class_splits_are_learn2learns_meta_dataset_lists() -> None:
    theirs = {
        "cub": (l2l_cub.SPLITS, ("train", "validation", "test")),
        "aircraft": (l2l_aircraft.SPLITS, ("train", "valid", "test")),
        "flowers": (l2l_flowers.SPLITS, ("train", "validation", "test")),
    }
    for module, key in ((cub_module, "cub"), (aircraft_module, "aircraft"), (flowers_module, "flowers")):
        lists, names = theirs[key]
        assert [list(module.CLASS_SPLITS[s]) for s in OURS] == [list(lists[n]) for n in names]
        counts = tuple(len(module.CLASS_SPLITS[s]) for s in OURS)
        assert counts == tasks.IMAGE_LAYOUTS[key].counts
        every = [c for s in OURS for c in module.CLASS_SPLITS[s]]
        assert len(every) == len(set(every))  # no class in two splits
    assert tasks.IMAGE_LAYOUTS["cub"].counts == (140, 30, 30)
    assert tasks.IMAGE_LAYOUTS["aircraft"].counts == (70, 15, 15)
    assert tasks.IMAGE_LAYOUTS["flowers"].counts == (71, 15, 16)
    assert {s: list(v) for s, v in cub_module.IMAGENET_DUPLICATES.items()} == {
        ours: l2l_cub.IMAGENET_DUPLICATES[theirs] for ours, theirs in zip(OURS, ("train", "validation", "test"))
    }
    assert len(cub_module.IMAGENET_DUPLICATES_ALL) == 43
    assert {"aircraft", "cub", "flowers"} <= set(tasks.IMAGE_DATASETS)
    assert tasks.IMAGE_DATASETS["cub"] is tasks.CUB200 and tasks.IMAGE_LAYOUTS["cub"].side == 84


# ---------------------------------------------------------------------- read, cached, sampled


@pytest.mark.parametrize(
    ("cls", "write", "counts", "root_of"),
    [
        (tasks.CUB200, write_cub, (281, 61, 61), lambda base: base.parent),  # the folder holding CUB_200_2011
        (tasks.CUB200, write_cub, (281, 61, 61), lambda base: base),  # CUB_200_2011 itself
        (tasks.Aircraft, write_aircraft, (147, 32, 31), lambda base: base),
        (tasks.Aircraft, write_aircraft, (147, 32, 31), lambda base: base.parent),
        (tasks.Flowers102, write_flowers, (146, 30, 32), lambda base: base),
    ],
    ids=["cub-parent", "cub-folder", "aircraft-folder", "aircraft-parent", "flowers"],
)
def test_each_set_is_read_cached_and_sampled(tmp_path: Path, monkeypatch, cls, write, counts, root_of) -> None:
    root = root_of(write(tmp_path / "data"))
    splits = cls.splits(root)
    for part, images, classes in zip(splits, counts, cls.spec.counts):
        assert part.layout == "extracted" and part.num_classes == classes and not part.from_cache
        assert part.images.dtype == torch.uint8 and tuple(part.images.shape) == (images, 3, 84, 84)
        assert sorted(set(part.labels.tolist())) == list(range(classes))
    # The second load maps the cache and opens no image.
    monkeypatch.setattr(fine_grained, "decode_all", lambda *a, **k: pytest.fail("decoded a split"))
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("opened an image"))
    again = cls.splits(root)
    for part, first in zip(again, splits):
        assert part.from_cache and part.cache_path == first.cache_path
        assert torch.equal(part.images, first.images) and part.classes == first.classes
    for part in again:
        batch = part.sampler(ways=5, shots=1, query=1).sample(3, torch.Generator().manual_seed(0))
        assert tuple(batch.support_x.shape) == (3, 5, 3, 84, 84) and tuple(batch.query_x.shape) == (3, 5, 3, 84, 84)
        assert batch.support_x.dtype == torch.float32


def test_a_grayscale_image_comes_out_rgb_and_the_classes_are_named(tmp_path: Path) -> None:
    root = write_flowers(tmp_path)
    (root / "jpg" / first_flower(5)).write_bytes(jpeg(5, mode="L"))  # the first of class 5, of the test split
    second = f"image_{FLOWER_LABELS.index(5) + 2:05d}.jpg"
    (root / "jpg" / second).write_bytes(jpeg(6, mode="RGB"))
    test = tasks.Flowers102(root, "test")
    assert test.classes == [str(c) for c in flowers_module.CLASS_SPLITS["test"]]
    gray = test.images[test.labels == test.classes.index("5")]
    assert gray.shape == (2, 3, 84, 84) and torch.equal(gray[0, 0], gray[0, 1]) and torch.equal(gray[0, 1], gray[0, 2])
    assert not torch.equal(gray[1, 0], gray[1, 1])  # the other, an RGB one
    cub = tasks.CUB200(write_cub(tmp_path / "cub"), "val")
    assert cub.classes == list(cub_module.CLASS_SPLITS["val"]) and cub.image_size == 84


# ---------------------------------------------------------------------- options


def test_cubs_imagenet_duplicates_are_left_out_unless_asked_for(tmp_path: Path) -> None:
    train_class, val_class = cub_module.CLASS_SPLITS["train"][3], cub_module.CLASS_SPLITS["val"][2]
    dups = {
        train_class: list(cub_module.IMAGENET_DUPLICATES["train"][:2]),
        val_class: ["Dark_Eyed_Junco_0057_68650.jpg"],
    }
    base = write_cub(tmp_path, dups)
    left_out = tasks.CUB200.splits(base)
    kept = tasks.CUB200.splits(base, include_imagenet_duplicates=True)
    assert [len(p) for p in left_out] == [281, 61, 61] and [len(p) for p in kept] == [283, 62, 61]
    assert kept.train.layout == "extracted+imagenet-duplicates" and not kept.train.from_cache
    assert (kept.train.labels == kept.train.classes.index(train_class)).sum() == 4
    assert (left_out.train.labels == left_out.train.classes.index(train_class)).sum() == 2
    assert (
        tasks.CUB200(base, "train").from_cache
        and tasks.CUB200(base, "train", include_imagenet_duplicates=True).from_cache
    )


def test_bounding_box_crops_read_their_own_cache(tmp_path: Path) -> None:
    base = write_cub(tmp_path / "cub")
    whole = tasks.CUB200(base, "test")
    cropped = tasks.CUB200(base, "test", bounding_box_crop=True)
    assert cropped.layout == "extracted+bounding-boxes" and not cropped.from_cache
    assert cropped.cache_path != whole.cache_path and not torch.equal(cropped.images, whole.images)
    # The box (2, 3) + (20, 15) is the image's pixels [3:18, 2:22], resized.
    first = base / "images" / cub_module.CLASS_SPLITS["test"][0]
    with Image.open(sorted(first.iterdir())[0]) as im:
        expected = im.convert("RGB").crop((2, 3, 22, 18)).resize((84, 84), Image.Resampling.LANCZOS)
    assert torch.equal(cropped.images[0], torch.from_numpy(np.array(expected)).permute(2, 0, 1))

    data = write_aircraft(tmp_path / "air") / "data"
    banner = tasks.Aircraft(data.parent, "val")
    boxed = tasks.Aircraft(data.parent, "val", bounding_box_crop=True)
    assert boxed.layout == "extracted+bounding-boxes" and boxed.cache_path != banner.cache_path
    first_id = (data / "images_variant_train.txt").read_text().split()[0]
    variant = (data / "images_variant_train.txt").read_text().splitlines()[0].split(" ", 1)[1]
    split = next(s for s in OURS if variant in aircraft_module.CLASS_SPLITS[s])
    part = tasks.Aircraft(data.parent, split)
    with Image.open(data / "images" / f"{first_id}.jpg") as im:
        w, h = im.size
        expected = im.convert("RGB").crop((0, 0, w, h - 20)).resize((84, 84), Image.Resampling.LANCZOS)
    index = int(torch.nonzero(part.labels == part.classes.index(variant))[0])
    assert torch.equal(part.images[index], torch.from_numpy(np.array(expected)).permute(2, 0, 1))


# ---------------------------------------------------------------------- refusals, each one line


def test_a_missing_folder_or_the_archive_itself_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        tasks.CUB200(missing)
    assert str(info.value) == f"CUB-200-2011 folder {missing} does not exist; {help_of(tasks.CUB200)}"
    assert help_of(tasks.CUB200) == (
        "CUB-200-2011 is not downloaded at run time: extract CUB_200_2011.tgz from "
        "https://www.vision.caltech.edu/datasets/cub_200_2011/ and pass the CUB_200_2011 folder (holding images/ and "
        "images.txt) or the folder holding it (docs/data.md lists each layout)."
    )
    for cls, archive, command in [
        (tasks.CUB200, "CUB_200_2011.tgz", "tar xzf CUB_200_2011.tgz"),
        (tasks.Aircraft, "fgvc-aircraft-2013b.tar.gz", "tar xzf fgvc-aircraft-2013b.tar.gz"),
        (tasks.Flowers102, "102flowers.tgz", "tar xzf 102flowers.tgz"),
    ]:
        path = tmp_path / archive
        path.write_bytes(b"\x1f\x8b\x08\x00 not really")
        expected = (
            f"{path} is an archive ({archive}); {cls.spec.name} is read from the folder it extracts to: run {command} "
            f"and pass that folder; {help_of(cls)}"
        )
        with pytest.raises(ValueError, match=re.escape(expected)):
            cls(path, "train")
        with pytest.raises(ValueError, match=re.escape(expected)):
            cls.splits(path)


def test_a_wrong_layout_is_one_line_naming_what_is_expected(tmp_path: Path) -> None:
    base = write_cub(tmp_path)
    (base / "images").rename(base / "pictures")
    with pytest.raises(ValueError) as info:
        tasks.CUB200(base, "train")
    assert str(info.value) == (
        f"{base} holds none of the CUB-200-2011 layouts, expected one of: extracted (Caltech's CUB_200_2011.tgz: "
        f"images/, images.txt). {help_of(tasks.CUB200)}"
    )
    (base / "pictures").rename(base / "images")
    listing = (base / "images.txt").read_text()
    (base / "images.txt").unlink()
    with pytest.raises(ValueError, match=re.escape(
        f"{base} holds images of the extracted layout but not images.txt (read for every split); {help_of(tasks.CUB200)}"
    )):  # fmt: skip
        tasks.CUB200(base, "train")
    (base / "images.txt").write_text(listing)
    (base / "bounding_boxes.txt").unlink()
    with pytest.raises(ValueError, match=re.escape(
        f"{base} holds images of the extracted+bounding-boxes layout but not bounding_boxes.txt (read for every split)"
    )):  # fmt: skip
        tasks.CUB200(base, "train", bounding_box_crop=True)


def test_a_cub_class_folder_missing_from_a_split_is_named(tmp_path: Path, monkeypatch) -> None:
    base = write_cub(tmp_path)
    gone = cub_module.CLASS_SPLITS["val"][4]
    for file in (base / "images" / gone).iterdir():
        file.unlink()
    (base / "images" / gone).rmdir()
    expected = (
        f"{base / 'images'} holds no folder {gone} (1 of the 30 classes of the val split missing): Meta-Dataset's "
        f"split of CUB-200-2011 needs all 200 class folders, as CUB_200_2011.tgz extracts them; {help_of(tasks.CUB200)}"
    )
    monkeypatch.setattr(fine_grained, "decode_all", lambda *a, **k: pytest.fail("decoded a split"))
    with pytest.raises(ValueError) as info:
        tasks.CUB200.splits(base)  # before any split is decoded
    assert str(info.value) == expected
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.pt"))


def test_cub_images_txt_listing_an_image_twice_or_a_missing_one_is_named(tmp_path: Path) -> None:
    base = write_cub(tmp_path)
    index = base / "images.txt"
    rows = index.read_text().splitlines()
    index.write_text("\n".join([*rows, f"{len(rows) + 1} {rows[0].split()[1]}"]) + "\n")
    with pytest.raises(ValueError) as info:
        tasks.CUB200(base, "train")
    assert str(info.value) == (
        f"{index} lists the image {rows[0].split()[1]} twice, on lines 1 and {len(rows) + 1}; an image is listed "
        f"once; {help_of(tasks.CUB200)}"
    )
    index.write_text("\n".join(rows) + "\n")
    name = rows[0].split()[1]
    (base / "images" / name).unlink()
    with pytest.raises(ValueError, match=re.escape(
        f"{index} lists images of the train split missing from {base / 'images'} (1 in all; first: {name}); "
    )):  # fmt: skip
        tasks.CUB200(base, "train")


def test_an_aircraft_image_listed_twice_a_missing_variant_file_and_a_missing_image_are_named(tmp_path: Path) -> None:
    root = write_aircraft(tmp_path)
    data = root / "data"
    help = help_of(tasks.Aircraft)
    test_file = data / "images_variant_test.txt"
    first = (data / "images_variant_train.txt").read_text().splitlines()[0]
    original = test_file.read_text()
    test_file.write_text(original + first + "\n")
    line = len(original.splitlines()) + 1
    with pytest.raises(ValueError) as info:
        tasks.Aircraft(root, "train")
    assert str(info.value) == (
        f"{test_file}: line {line} lists the image {first.split()[0]}, which images_variant_train.txt lists on line 1; "
        f"an image is listed once; {help}"
    )
    test_file.unlink()
    with pytest.raises(ValueError) as info:
        tasks.Aircraft(root, "val")
    assert str(info.value) == (
        f"{root} holds images of the extracted layout but not images_variant_test.txt (read for every split); {help}"
    )
    test_file.write_text(original)
    image = data / "images" / f"{first.split()[0]}.jpg"
    image.unlink()
    split = next(s for s in OURS if first.split(" ", 1)[1] in aircraft_module.CLASS_SPLITS[s])
    with pytest.raises(ValueError) as info:
        tasks.Aircraft(root, split)
    assert str(info.value) == (
        f"{data / 'images'} holds no {image.name} (1 of the {split} split's images missing), listed in "
        f"images_variant_train.txt, images_variant_val.txt, images_variant_test.txt; {help}"
    )


def test_a_corrupt_jpeg_is_one_line_naming_it(tmp_path: Path) -> None:
    root = write_flowers(tmp_path)
    image = root / "jpg" / first_flower(5)  # the test split
    image.write_bytes(image.read_bytes()[:30])
    with pytest.raises(ValueError) as info:
        tasks.Flowers102(root, "test")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot decode the image {image} (")
    assert message.endswith(f"): the file is corrupt or truncated; {help_of(tasks.Flowers102)}")
    assert tasks.Flowers102(root, "val").num_classes == 15  # the other splits still read


def test_flowers_label_file_missing_unreadable_or_without_scipy_is_one_line(tmp_path: Path, monkeypatch) -> None:
    root = write_flowers(tmp_path)
    help = help_of(tasks.Flowers102)
    labels = root / "imagelabels.mat"
    content = labels.read_bytes()
    labels.unlink()
    with pytest.raises(ValueError) as info:
        tasks.Flowers102(root, "train")
    assert (
        str(info.value)
        == f"{root} holds jpg of the extracted layout but not imagelabels.mat (read for every split); {help}"
    )
    labels.write_bytes(b"MATLAB 5.0 MAT-file, cut short")
    with pytest.raises(ValueError) as info:
        tasks.Flowers102(root, "train")
    message = str(info.value)
    assert message.startswith(f"cannot read {labels} (") and "\n" not in message
    assert message.endswith(f"): it is truncated or not a MATLAB v5 file; {help}")
    labels.write_bytes(content)
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # import scipy.io raises ImportError
    with pytest.raises(ValueError) as info:
        tasks.Flowers102(root, "train")
    assert str(info.value) == (
        f"reading {labels} (a MATLAB v5 file) needs scipy, which is not installed: pip install scipy; {help}"
    )
    monkeypatch.delitem(sys.modules, "scipy.io")
    scipy_io.savemat(str(labels), {"classes": np.ones((1, 3))})
    with pytest.raises(ValueError, match=re.escape(f"{labels} holds no 'labels' (it holds ['classes']); {help}")):
        tasks.Flowers102(root, "train")


def test_a_hard_linked_image_is_refused_naming_both(tmp_path: Path) -> None:
    root = write_flowers(tmp_path)
    a, b = root / "jpg" / first_flower(1), root / "jpg" / first_flower(2)  # classes 1 and 2: the train split
    b.unlink()
    b.hardlink_to(a)
    with pytest.raises(ValueError, match=re.escape(f"{a} and {b} are one file (hard links, or links to one image)")):
        tasks.Flowers102(root, "train")
