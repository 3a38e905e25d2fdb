"""Describable Textures and FGVC Fungi in their archives' layouts, on small JPEGs the tests write."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from learn2learn.vision.datasets import describable_textures as l2l_dtd
from learn2learn.vision.datasets import fgvc_fungi as l2l_fungi
from PIL import Image

import tasks
from tasks._src import cache as cache_module
from tasks._src import image_files

L2L_SPLIT = {"train": "train", "val": "validation", "test": "test"}
DTD_HELP = tasks.DescribableTextures.spec.help()
FUNGI_HELP = tasks.FGVCFungi.spec.help()
NEEDS = (
    "FGVC Fungi reads the COCO-style train.json and val.json of train_val_annotations.tgz ('images' with 'id' and "
    "'file_name', 'annotations' with 'image_id' and 'category_id', 'categories' with 'id' and 'name')"
)


def _jpeg(size: tuple[int, int], mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="JPEG", quality=80)
    return out.getvalue()


# Varied sizes (each at least 84 one way, as the readers need) and modes; GRAY is one of grayscale (mode L).
GRAY = _jpeg((90, 84), "L", 0)
BLOBS = [_jpeg((84, 84), "RGB", 1), _jpeg((120, 84), "RGB", 2), _jpeg((84, 40), "CMYK", 3), GRAY]


def write_dtd(base: Path) -> Path:
    """``dtd-r1.0.1.tar.gz`` extracted in ``base``: ``dtd/images/<class>/*.jpg``, two images a class."""
    images = base / "dtd" / "images"
    for c, name in enumerate(sorted(sum(l2l_dtd.SPLITS.values(), []))):
        (images / name).mkdir(parents=True)
        for i in range(2):
            blob = GRAY if name == "banded" and i == 0 else BLOBS[(c + i) % 3]
            (images / name / f"{name}_{i:04d}.jpg").write_bytes(blob)
    (images / "banded" / ".directory").write_text("[Dolphin]\n")  # as the archive holds; not an image
    return base / "dtd"


def _fungi_categories() -> list[tuple[int, str]]:
    return sorted((int(label[:4]), label[5:]) for labels in l2l_fungi.SPLITS.values() for label in labels)


def write_fungi(root: Path) -> None:
    """``images/`` of ``fungi_train_val.tgz`` and train.json, val.json: two images a category, one in each."""
    categories = [{"id": cid, "name": name, "supercategory": "Fungi"} for cid, name in _fungi_categories()]
    files = {"train.json": {"images": [], "annotations": []}, "val.json": {"images": [], "annotations": []}}
    iid = 0
    for cid, name in _fungi_categories():
        folder = root / "images" / f"{cid + 10000}_{name}"
        folder.mkdir(parents=True)
        for i in range(2):
            blob = GRAY if cid == 8 and i == 0 else BLOBS[(cid + i) % 3]
            (folder / f"I{iid:05d}.JPG").write_bytes(blob)
            part = files["val.json" if i == 1 else "train.json"]
            part["images"].append({"id": iid, "file_name": f"images/{folder.name}/I{iid:05d}.JPG", "license": 0})
            part["annotations"].append({"id": iid, "image_id": iid, "category_id": cid})
            iid += 1
    for name, part in files.items():
        (root / name).write_text(json.dumps({**part, "categories": categories, "info": {}}))


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def fungi_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fungi")
    write_fungi(root)
    return root


@pytest.fixture
def fungi(tmp_path: Path, fungi_original: Path) -> Path:
    root = tmp_path / "fungi"
    shutil.copytree(fungi_original, root)
    return root


def _no_image_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails a decode, and lists the files the cache's fingerprint opens (as test_image_files.py does)."""
    read: list[str] = []
    real_open = open

    def counted(path, *args, **kwargs):
        read.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(cache_module, "open", counted, raising=False)
    monkeypatch.setattr(image_files, "decode_all", lambda *a, **k: pytest.fail("decoded an image"))
    return read


def _check_splits(splits: tasks.ImageSplits, expected: dict[str, list[str]]) -> None:
    seen: set[str] = set()
    for part in splits:
        assert part.classes == sorted(expected[part.split]), part.split
        assert not seen & set(part.classes)
        seen |= set(part.classes)
        assert part.images.dtype == torch.uint8 and tuple(part.images.shape[1:]) == (3, 84, 84)
        assert sorted(set(part.labels.tolist())) == list(range(part.num_classes)) and not part.from_cache
        batch = part.sampler(ways=5, shots=1, query=1).sample(2, torch.Generator().manual_seed(0))
        assert tuple(batch.support_x.shape) == (2, 5, 3, 84, 84) and batch.support_x.max() <= 1


def test_dtd_splits_are_meta_datasets_load_sample_and_come_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtd = write_dtd(tmp_path / "data")
    expected = {s: l2l_dtd.SPLITS[L2L_SPLIT[s]] for s in L2L_SPLIT}
    assert [len(expected[s]) for s in L2L_SPLIT] == [33, 7, 7] == list(tasks.DescribableTextures.spec.counts)
    splits = tasks.DescribableTextures.splits(dtd.parent)  # the folder holding dtd/
    _check_splits(splits, expected)
    assert [len(p) for p in splits] == [2 * 33, 2 * 7, 2 * 7]
    gray = splits.test.images[0]  # banded's first image, of mode L: RGB, its three channels equal
    assert splits.test.classes[0] == "banded" and torch.equal(gray[0], gray[1]) and torch.equal(gray[0], gray[2])
    assert splits.train.layout == "dtd-r1.0.1" and tasks.IMAGE_DATASETS["dtd"] is tasks.DescribableTextures
    inner = tasks.DescribableTextures(dtd, "val", cache=False)  # dtd/ itself, as the parent
    assert torch.equal(inner.images, splits.validation.images) and inner.classes == splits.validation.classes
    read = _no_image_read(monkeypatch)
    warm = tasks.DescribableTextures.splits(dtd.parent)
    assert all(p.from_cache for p in warm) and read == []
    for a, b in zip(warm, splits):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.classes == b.classes


def test_fungi_splits_are_meta_datasets_load_sample_and_come_from_the_cache(
    fungi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = {s: l2l_fungi.SPLITS[L2L_SPLIT[s]] for s in L2L_SPLIT}
    assert [len(expected[s]) for s in L2L_SPLIT] == [994, 200, 200] == list(tasks.FGVCFungi.spec.counts)
    splits = tasks.FGVCFungi.splits(fungi)
    _check_splits(splits, expected)
    assert [len(p) for p in splits] == [2 * 994, 2 * 200, 2 * 200]
    gray = splits.test.images[0]  # category 8's first image, of mode L
    assert splits.test.classes[0] == next(c for c in expected["test"] if c.startswith("0008."))
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[0], gray[2])
    assert splits.train.layout == "fgvcx-2018" and tasks.IMAGE_DATASETS["fungi"] is tasks.FGVCFungi
    read = _no_image_read(monkeypatch)
    warm = tasks.FGVCFungi.splits(fungi)
    assert all(p.from_cache for p in warm) and read == []
    for a, b in zip(warm, splits):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.classes == b.classes


def _raises(error: type[Exception], call, *args, **kwargs) -> str:
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_dtd_bad_inputs_are_one_line_each(tmp_path: Path) -> None:
    DTD = tasks.DescribableTextures
    nowhere = tmp_path / "nowhere"
    assert (
        _raises(FileNotFoundError, DTD, nowhere) == f"Describable Textures folder {nowhere} does not exist; {DTD_HELP}"
    )
    (tmp_path / "empty").mkdir()
    assert _raises(ValueError, DTD, tmp_path / "empty") == (
        f"{tmp_path / 'empty'} holds none of the Describable Textures layouts, expected one of: dtd-r1.0.1 "
        f"(dtd-r1.0.1.tar.gz extracted; the folder dtd/ or the one holding it: images/). {DTD_HELP}"
    )
    dtd = write_dtd(tmp_path / "data")
    images = dtd / "images"
    shutil.rmtree(images / "woven")
    for call in (lambda: DTD(dtd, "test", cache=False), lambda: DTD.splits(dtd.parent)):
        assert _raises(ValueError, call) == (
            f"{images} has no class folder woven/ (1 of the 7 classes of the test split missing): Meta-Dataset's test "
            f"split of Describable Textures reads images/<class>/ for each of its classes; the archive is partly "
            f"extracted or another data set's; {DTD_HELP}"
        )
    (images / "woven").mkdir()
    assert _raises(ValueError, DTD, dtd, "test", cache=False) == (
        f"{images / 'woven'} holds no image (.jpg), and the test split of Describable Textures reads the images of "
        f"each of its 7 classes; {DTD_HELP}"
    )
    (images / "woven" / "woven_0000.jpg").write_bytes(BLOBS[0])
    first = images / "banded" / "banded_0000.jpg"
    os.link(first, images / "bumpy" / "copy.jpg")
    assert _raises(ValueError, DTD, dtd, "test", cache=False) == (
        f"{first} and {images / 'bumpy' / 'copy.jpg'} are one file (hard links, or links to one image): it would be "
        f"read twice, as two images of two classes; keep one of them; {DTD_HELP}"
    )
    (images / "bumpy" / "copy.jpg").unlink()
    broken = images / "knitted" / "knitted_0000.jpg"
    broken.write_bytes(BLOBS[1][:200])
    assert _raises(ValueError, DTD, dtd, "test", cache=False).startswith(f"cannot decode the image {broken} (")
    broken.write_bytes(b"not a jpeg")
    assert _raises(ValueError, DTD, dtd, "test", cache=False) == (
        f"cannot decode the image {broken} (cannot identify image file): the file is corrupt or truncated; {DTD_HELP}"
    )
    assert not list((tmp_path / "cache").glob("*.pt"))


def _edit(path: Path, change) -> None:
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def test_fungi_bad_folders_and_label_files_are_one_line_each(tmp_path: Path, fungi: Path) -> None:
    Fungi = tasks.FGVCFungi
    nowhere = tmp_path / "nowhere"
    assert _raises(FileNotFoundError, Fungi, nowhere) == f"FGVC Fungi folder {nowhere} does not exist; {FUNGI_HELP}"
    (fungi / "images").rename(fungi / "pictures")
    assert _raises(ValueError, Fungi, fungi) == (
        f"{fungi} holds none of the FGVC Fungi layouts, expected one of: fgvcx-2018 (fungi_train_val.tgz and "
        f"train_val_annotations.tgz extracted into one folder: images/, train.json, val.json). {FUNGI_HELP}"
    )
    (fungi / "pictures").rename(fungi / "images")
    for name in ("train.json", "val.json"):
        (fungi / name).rename(fungi / "kept.json")
        assert _raises(ValueError, Fungi, fungi, "test") == (
            f"{fungi} holds images of the fgvcx-2018 layout but not {name} (read for every split); {FUNGI_HELP}"
        )
        (fungi / "kept.json").rename(fungi / name)
    val = fungi / "val.json"
    text = val.read_text()
    val.write_text(text[:20])
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{val} is not JSON (Expecting ',' delimiter at line 1, column 21): it is truncated or another "
        f"file; {NEEDS}; {FUNGI_HELP}"
    )
    val.write_bytes(b"\xff\xfe\x00garbage")
    assert _raises(ValueError, Fungi, fungi, "test", cache=False).startswith(f"{val} is not JSON")
    val.write_text(text)
    train = fungi / "train.json"
    _edit(train, lambda p: p.pop("annotations"))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train} has no 'annotations'; {NEEDS}; {FUNGI_HELP}"
    )
    _edit(train, lambda p: p.update(annotations={"0": 1}))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train}: its 'annotations' is a dict, not a list; {NEEDS}; {FUNGI_HELP}"
    )
    _edit(train, lambda p: p.update(annotations=[{"id": 0, "image_id": 0, "category_id": "0"}]))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train}: annotations[0] has no integer 'category_id' (it is "
        f'{{"id": 0, "image_id": 0, "category_id": "0"}}); {NEEDS}; {FUNGI_HELP}'
    )


def test_fungi_duplicate_unlabelled_missing_and_corrupt_images_are_one_line_each(fungi: Path) -> None:
    Fungi = tasks.FGVCFungi
    train, val = fungi / "train.json", fungi / "val.json"
    original = {p: p.read_text() for p in (train, val)}
    first = json.loads(original[train])["images"][0]
    _edit(val, lambda p: p["images"].append({**first, "id": 99999}))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{val}: images[{len(json.loads(original[val])['images'])}] names {first['file_name']}, as images[0] of "
        f"train.json does: an image is listed once; {FUNGI_HELP}"
    )
    _edit(val, lambda p: p["images"].__setitem__(-1, {**first, "file_name": "images/other.JPG"}))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{val}: images[{len(json.loads(original[val])['images'])}] has the id 0 of images[0] of train.json: an image "
        f"is listed once; {FUNGI_HELP}"
    )
    val.write_text(original[val])
    _edit(train, lambda p: p["annotations"].append(dict(p["annotations"][0])))
    n = len(json.loads(original[train])["annotations"])
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train}: annotations[{n}] labels image 0 again (annotations[0] of train.json labels it): an image has one "
        f"category; {FUNGI_HELP}"
    )
    _edit(train, lambda p: p["annotations"].pop())
    _edit(train, lambda p: p["annotations"].pop(0))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train}: images[0] ({first['file_name']}) has no annotation, so no category (1 such images); {FUNGI_HELP}"
    )
    train.write_text(original[train])
    _edit(train, lambda p: p["annotations"][0].update(category_id=5000))
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train}: annotations[0] has the category_id 5000, which no entry of 'categories' has; {FUNGI_HELP}"
    )
    train.write_text(original[train])
    test_image = next(i for i in json.loads(original[train])["images"] if "/10008_" in i["file_name"])["file_name"]
    (fungi / test_image).unlink()
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{train} lists 1 images of the test split missing from {fungi} (first: {test_image}): fungi_train_val.tgz is "
        f"extracted beside train.json and val.json; {FUNGI_HELP}"
    )
    (fungi / test_image).write_bytes(b"not a jpeg")
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"cannot decode the image {fungi / test_image} (cannot identify image file): the file is corrupt or "
        f"truncated; {FUNGI_HELP}"
    )
    (fungi / test_image).write_bytes(BLOBS[0])
    other = next(i for i in json.loads(original[train])["images"] if "/10009_" in i["file_name"])["file_name"]
    (fungi / other).unlink()
    os.link(fungi / test_image, fungi / other)
    assert _raises(ValueError, Fungi, fungi, "test", cache=False) == (
        f"{fungi / test_image} and {fungi / other} are one file (hard links, or links to one image): it would be read "
        f"twice, as two images of two classes; keep one of them; {FUNGI_HELP}"
    )
