"""Omniglot: the real archives (through $OMNIGLOT_DIR), synthetic layouts, the cache, splits, errors."""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import maml
import tasks
from tasks._src import cache as cache_module

ARCHIVES = ("images_background_small1.zip", "images_background_small2.zip")
ALPHABETS = ["Balinese", "Early_Aramaic", "Greek", "Japanese_(katakana)", "Korean", "Latin", "Sanskrit", "Tagalog"]


# ---------------------------------------------------------------------- the real data set


@pytest.fixture(scope="module")
def omniglot_root() -> Path:
    return helpers.omniglot_root()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omniglot-cache")


@pytest.fixture(scope="module")
def omni(omniglot_root: Path, cache_dir: Path) -> tasks.Omniglot:
    return tasks.Omniglot(omniglot_root, rotations=False, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def rotated(omni: tasks.Omniglot, omniglot_root: Path, cache_dir: Path) -> tasks.Omniglot:
    return tasks.Omniglot(omniglot_root, cache_dir=cache_dir)  # rotations on by default


def test_both_archives_give_242_characters_of_20_images(omni: tasks.Omniglot, cache_dir: Path) -> None:
    assert not omni.from_cache and omni.cache_path is not None and omni.cache_path.parent == cache_dir
    assert len(omni.characters) == len(set(omni.characters)) == omni.num_classes == 242
    assert omni.images.shape == (4840, 28, 28) and omni.images.dtype == torch.uint8
    assert omni.labels.shape == (4840,) and omni.labels.dtype == torch.int64
    assert torch.equal(torch.bincount(omni.labels), torch.full((242,), 20))
    assert omni.alphabets == ALPHABETS
    assert omni.archives == ["images_background_small1", "images_background_small2"]
    for c in range(0, 242, 17):
        assert sorted(omni.drawers[omni.labels == c].tolist()) == list(range(1, 21))


def test_each_archive_alone_and_the_shared_alphabets(omniglot_root: Path, cache_dir: Path) -> None:
    small1, small2 = (tasks.Omniglot(omniglot_root / a, rotations=False, cache_dir=cache_dir) for a in ARCHIVES)
    assert (len(small1.characters), len(small1)) == (136, 2720)
    assert (len(small2.characters), len(small2)) == (156, 3120)
    shared = set(small1.characters) & set(small2.characters)
    assert {c.split("/")[0] for c in shared} == {"Greek", "Latin"} and len(shared) == 136 + 156 - 242
    # The same character decodes to the same images from either archive.
    in1, in2 = (part.characters.index("Greek/character05") for part in (small1, small2))
    torch.testing.assert_close(small1.images[small1.labels == in1], small2.images[small2.labels == in2])


def test_strokes_are_high_on_a_zero_background(omni: tasks.Omniglot) -> None:
    border = torch.cat([omni.images[:, 0], omni.images[:, -1], omni.images[:, :, 0], omni.images[:, :, -1]], 1)
    assert border.float().mean() < 5
    assert omni.images.max() == 255
    assert 0.05 < (omni.images > 127).float().mean() < 0.3  # strokes are a minority of the pixels


def test_rotations_make_four_classes_per_character_from_the_cache(
    omni: tasks.Omniglot, rotated: tasks.Omniglot
) -> None:
    assert rotated.from_cache and rotated.cache_path == omni.cache_path
    assert rotated.num_classes == 4 * 242 and rotated.images.shape == (4 * 4840, 28, 28)
    assert torch.equal(torch.bincount(rotated.labels), torch.full((968,), 20))
    assert rotated.classes[4 * 10 + 2] == f"{omni.characters[10]}/rot180"
    for label in (0, 5, 402, 967):
        character, k = divmod(label, 4)
        assert rotated.class_characters[label] == character and rotated.class_rotations[label] == 90 * k
        expected = torch.rot90(omni.images[omni.labels == character], k, dims=(1, 2))
        assert torch.equal(rotated.images[rotated.labels == label], expected)
        assert torch.equal(rotated.drawers[rotated.labels == label], omni.drawers[omni.labels == character])


def test_support_and_query_of_a_class_are_one_character_by_different_drawers(rotated: tasks.Omniglot) -> None:
    sampler = tasks.FewShotSampler(rotated.images, rotated.labels, ways=5, shots=1, query=15)
    batch, index = sampler.sample(32, generator=torch.Generator().manual_seed(0), return_indices=True)
    assert batch.support_x.shape == (32, 5, 1, 28, 28) and batch.query_x.shape == (32, 75, 1, 28, 28)
    assert batch.query_y.min() == 0 and batch.query_y.max() == 4
    torch.testing.assert_close(batch.query_x[:, :, 0], rotated.images[index.query].float() / 255)
    for t in range(32):
        for label in range(5):
            support = index.support[t][batch.support_y[t] == label]
            drawn = torch.cat([support, index.query[t][batch.query_y[t] == label]])
            assert rotated.labels[drawn].unique().tolist() == [int(index.classes[t, label])]
            assert rotated.image_characters[drawn].unique().numel() == 1
            assert rotated.drawers[drawn].unique().numel() == 16


def test_splits_are_disjoint_cover_everything_and_are_fixed_by_the_seed(omni: tasks.Omniglot) -> None:
    cases = (("character", (0.7, 0.15, 0.15)), ("alphabet", (0.5, 0.25, 0.25)), ("archive", (0.5, 0.0, 0.5)))
    for by, fractions in cases:
        parts = omni.split(by, fractions, seed=3)
        names = [set(p.characters) for p in parts]
        assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2]), by
        assert set().union(*names) == set(omni.characters), by
        assert sum(len(p) for p in parts) == len(omni)
        if by != "character":
            units = [set(p.alphabets) if by == "alphabet" else set(p.archives) for p in parts]
            assert not (units[0] & units[1] or units[0] & units[2] or units[1] & units[2]), by
        again = omni.split(by, fractions, seed=3)
        assert [p.characters for p in parts] == [p.characters for p in again]
    by_character = omni.split(seed=0)
    assert [len(p.characters) for p in by_character] == [170, 36, 36]
    assert by_character.train.characters != omni.split(seed=1).train.characters
    # A part renumbers its characters and keeps their images.
    test = by_character.test
    assert torch.equal(torch.bincount(test.labels), torch.full((36,), 20))
    original = omni.characters.index(test.characters[4])
    assert torch.equal(test.images[test.labels == 4], omni.images[omni.labels == original])


def test_split_rotations_default_to_the_train_part(omni: tasks.Omniglot, rotated: tasks.Omniglot) -> None:
    train, validation, test = rotated.split(seed=0)
    assert (train.rotations, validation.rotations, test.rotations) == (True, False, False)
    assert train.num_classes == 4 * len(train.characters) and test.num_classes == len(test.characters)
    assert [p.rotations for p in omni.split(seed=0)] == [False, False, False]
    assert [p.rotations for p in omni.split(seed=0, rotations=(True, True, False))] == [True, True, False]
    assert train.characters == omni.split(seed=0).train.characters


def test_a_meta_training_step_on_omniglot(rotated: tasks.Omniglot) -> None:
    torch.manual_seed(0)

    def block(c: int) -> list[nn.Module]:
        return [nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(1), *block(8), *block(8), *block(8), nn.Flatten(), nn.Linear(8, 5))
    learner = maml.MetaLearner(model, nn.functional.cross_entropy, inner_lr=0.4, steps=1)
    batch = rotated.sampler(ways=5, shots=1, query=3).sample(2, generator=torch.Generator().manual_seed(0))
    loss = learner.meta_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_more_ways_than_characters(omni: tasks.Omniglot) -> None:
    with pytest.raises(ValueError, match=r"ways=243 but the labels hold only 242 classes.*rotations=True"):
        omni.sampler(ways=243, shots=1, query=1)


def test_more_images_per_class_than_omniglot_has_drawers(omni: tasks.Omniglot) -> None:
    match = r"shots \+ query = 5 \+ 16 = 21 .*the largest has 20; Omniglot has 20 drawers"
    with pytest.raises(ValueError, match=match):
        omni.sampler(ways=5, shots=5, query=16)


def test_bad_split_arguments(omni: tasks.Omniglot) -> None:
    with pytest.raises(ValueError, match=r"by='drawer' is not supported; choose one of 'character', 'alphabet'"):
        omni.split("drawer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fractions=\(0.7, 0.2, 0.2\) must be >= 0 and sum to 1"):
        omni.split(fractions=(0.7, 0.2, 0.2))
    with pytest.raises(ValueError, match=r"only 2 archives .* too few to give the validation part any"):
        omni.split("archive")


# ---------------------------------------------------------------------- synthetic layouts


def write_split(folder: Path, characters: dict[str, int], drawers: int = 3, seed: int = 0) -> None:
    """Writes ``<folder>/<Alphabet>/characterNN/<id>_<drawer>.png``: 105x105 bilevel, black strokes on white."""
    rng = np.random.default_rng(seed)
    for alphabet, count in characters.items():
        for c in range(1, count + 1):
            out = folder / alphabet / f"character{c:02d}"
            out.mkdir(parents=True)
            for d in range(1, drawers + 1):
                white = rng.random((105, 105)) > 0.2
                Image.fromarray(white).save(out / f"{c:04d}_{d:02d}.png")


def zip_split(folder: Path, archive: Path) -> Path:
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted(folder.rglob("*")):
            z.write(path, f"{folder.name}/{path.relative_to(folder)}")
    return archive


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """``data/`` holding an extracted split ``alpha/`` and an archive ``beta.zip`` sharing alphabet B."""
    data = tmp_path / "data"
    write_split(data / "alpha", {"A": 2, "B": 1}, seed=1)
    write_split(tmp_path / "beta", {"B": 2, "C": 1}, seed=2)
    zip_split(tmp_path / "beta", data / "beta.zip")
    return data


def test_reads_split_folders_and_archives_and_reads_shared_characters_once(layout: Path, tmp_path: Path) -> None:
    both = tasks.Omniglot(layout, rotations=False, cache_dir=tmp_path / "cache")
    assert both.characters == ["A/character01", "A/character02", "B/character01", "B/character02", "C/character01"]
    assert both.character_archives == ["alpha", "alpha", "alpha", "beta", "beta"]
    assert both.drawers.tolist() == [1, 2, 3] * 5 and both.labels.tolist() == [c for c in range(5) for _ in range(3)]
    alpha = tasks.Omniglot(layout / "alpha", rotations=False, cache_dir=tmp_path / "cache")
    beta = tasks.Omniglot(layout / "beta.zip", rotations=False, cache_dir=tmp_path / "cache")
    assert torch.equal(both.images[:9], alpha.images)  # B/character01 comes from alpha, the first by name
    assert torch.equal(both.images[9:], beta.images[3:])


def test_a_zip_and_its_extracted_folder_decode_alike(layout: Path, tmp_path: Path) -> None:
    from_zip = tasks.Omniglot(layout / "beta.zip", rotations=False, cache=False)
    from_folder = tasks.Omniglot(tmp_path / "beta", rotations=False, cache=False)
    assert from_zip.characters == from_folder.characters and torch.equal(from_zip.images, from_folder.images)
    # An archive extracted beside itself is read once.
    (tmp_path / "beta").rename(layout / "beta")
    assert tasks.Omniglot(layout, rotations=False, cache=False).archives == ["alpha", "beta"]


def test_white_is_zero_and_black_is_one(tmp_path: Path) -> None:
    for name, value in (("white", True), ("black", False)):
        out = tmp_path / "split" / name / "character01"
        out.mkdir(parents=True)
        Image.fromarray(np.full((105, 105), value)).save(out / "0001_01.png")
    omni = tasks.Omniglot(tmp_path / "split", rotations=False, cache=False)
    assert omni.characters == ["black/character01", "white/character01"]
    assert torch.all(omni.images[0] == 255) and torch.all(omni.images[1] == 0)


def test_the_cache_round_trip_and_its_keys(layout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAML_CACHE_DIR", raising=False)  # when set, it wins (tests/tasks/test_cache_dir.py)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    cold = tasks.Omniglot(layout, rotations=False)
    assert not cold.from_cache and cold.cache_path is not None
    assert cold.cache_path.parent == layout / ".maml-cache"  # next to the data when it is writable
    warm = tasks.Omniglot(layout, rotations=False)
    assert warm.from_cache and torch.equal(warm.images, cold.images) and warm.characters == cold.characters
    # Other preprocessing, another key.
    assert not tasks.Omniglot(layout, rotations=False, image_size=14).from_cache
    # A changed archive is a miss.
    os.utime(layout / "beta.zip", ns=(1, 1))
    assert not tasks.Omniglot(layout, rotations=False).from_cache


def test_a_corrupt_cache_is_a_miss(layout: Path, tmp_path: Path) -> None:
    first = tasks.Omniglot(layout, rotations=False, cache_dir=tmp_path / "c")
    assert first.cache_path is not None
    first.cache_path.write_bytes(b"not a tensor file")
    again = tasks.Omniglot(layout, rotations=False, cache_dir=tmp_path / "c")
    assert not again.from_cache and torch.equal(again.images, first.images)
    assert tasks.Omniglot(layout, rotations=False, cache_dir=tmp_path / "c").from_cache  # rewritten
    assert not [p for p in (tmp_path / "c").iterdir() if p.suffix == ".tmp"]


def test_an_unwritable_data_folder_falls_back_to_the_user_cache(
    layout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (layout / ".maml-cache").write_text("a file where the cache folder would go")
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "user-cache"))
    omni = tasks.Omniglot(layout, rotations=False)
    assert omni.cache_path is not None and omni.cache_path.parent == tmp_path / "user-cache"
    assert tasks.Omniglot(layout, rotations=False).from_cache
    # Nowhere to write: it still loads, and says so.
    monkeypatch.setenv("MAML_CACHE_DIR", str(layout / ".maml-cache" / "below-a-file"))
    with pytest.warns(RuntimeWarning, match="could not write the decoded Omniglot cache"):
        assert tasks.Omniglot(layout, rotations=False, image_size=10).cache_path is None


def test_a_read_only_data_folder_is_left_alone_even_by_root(
    layout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "user-cache"))
    layout.chmod(0o555)  # like a shared, read-only data folder; root could still write, so the code must not
    try:
        omni = tasks.Omniglot(layout, rotations=False)
        assert omni.cache_path is not None and omni.cache_path.parent == tmp_path / "user-cache"
        assert not (layout / ".maml-cache").exists()
    finally:
        layout.chmod(0o755)


def test_cache_false_writes_nothing(layout: Path) -> None:
    omni = tasks.Omniglot(layout, rotations=False, cache=False)
    assert omni.cache_path is None and not (layout / ".maml-cache").exists()


# ---------------------------------------------------------------------- bad data paths


def test_a_path_that_does_not_exist(tmp_path: Path) -> None:
    match = r"does not exist\. Expected the Omniglot layout .*github\.com/brendenlake/omniglot"
    with pytest.raises(FileNotFoundError, match=match):
        tasks.Omniglot(tmp_path / "nowhere")


def test_a_folder_with_no_images(tmp_path: Path) -> None:
    (tmp_path / "empty" / "Alphabet" / "character01").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"found no Omniglot images under .*images_background\.zip"):
        tasks.Omniglot(tmp_path / "empty", cache=False)


def test_a_corrupt_archive(tmp_path: Path) -> None:
    (tmp_path / "images_background.zip").write_bytes(b"this is not a zip archive" * 100)
    with pytest.raises(ValueError, match=r"images_background\.zip' is not a zip archive.*brendenlake/omniglot"):
        tasks.Omniglot(tmp_path / "images_background.zip", cache=False)
    with pytest.raises(ValueError, match=r"cannot open the zip archive .*corrupt or truncated"):
        tasks.Omniglot(tmp_path, cache=False)  # found in a folder, it fails when opened


def test_a_truncated_archive(layout: Path, tmp_path: Path) -> None:
    blob = (layout / "beta.zip").read_bytes()
    (tmp_path / "cut.zip").write_bytes(blob[: len(blob) // 2] + blob[-200:])
    with pytest.raises(ValueError, match=r"cut\.zip.*(corrupt|truncated)"):
        tasks.Omniglot(tmp_path / "cut.zip", cache=False)


def test_an_empty_archive(tmp_path: Path) -> None:
    zipfile.ZipFile(tmp_path / "empty.zip", "w").close()
    with pytest.raises(ValueError, match=r"empty\.zip' holds no \.png image in the Omniglot layout"):
        tasks.Omniglot(tmp_path / "empty.zip", cache=False)


def test_a_corrupt_image_in_an_archive(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as z:
        z.writestr("bad/Alphabet/character01/0001_01.png", b"\x89PNG\r\n\x1a\n but then garbage")
    with pytest.raises(ValueError, match=r"cannot decode the image bad/Alphabet/character01/0001_01\.png"):
        tasks.Omniglot(tmp_path / "bad.zip", cache=False)


def test_non_positive_image_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"image_size=0 is out of range"):
        tasks.Omniglot(tmp_path, image_size=0)


@pytest.mark.parametrize("by", ["content", "ctime"])
@pytest.mark.parametrize("change", ["image-moved-to-another-character", "character-renamed", "image-replaced"])
def test_an_extracted_folders_cache_is_a_miss_whenever_its_labels_or_pixels_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, by: str
) -> None:
    """``mv`` and ``cp -p`` keep times: a key of (count, total size, newest time) served [20, 20, 20, 20]."""
    if by == "ctime":  # the key above the hashing limit: status-change times stand in for content
        monkeypatch.setattr(cache_module, "HASH_LIMIT", 0)
    split = tmp_path / "images_background"
    write_split(split, {"A": 2, "B": 2}, drawers=4)
    rng = np.random.default_rng(5)
    for path in sorted(split.glob("*/*/*.png")):  # every image the same size, so that one can replace another
        path.write_bytes(helpers.uncompressed_png(rng.random((105, 105)) > 0.2))
    cold = tasks.Omniglot(split, rotations=False, cache_dir=tmp_path / "cache")
    assert tasks.Omniglot(split, rotations=False, cache_dir=tmp_path / "cache").from_cache
    if by == "ctime":
        time.sleep(0.05)  # the kernel's file times tick every few milliseconds
    image = split / "A" / "character01" / "0001_01.png"
    if change == "image-moved-to-another-character":
        os.rename(image, split / "A" / "character02" / "0002_05.png")  # mv: times kept
    elif change == "character-renamed":
        os.rename(split / "B" / "character02", split / "B" / "character07")
    else:
        helpers.replace_keeping_size_and_time(image, helpers.uncompressed_png(rng.random((105, 105)) > 0.5))
    warm = tasks.Omniglot(split, rotations=False, cache_dir=tmp_path / "cache")
    fresh = tasks.Omniglot(split, rotations=False, cache=False)
    assert not warm.from_cache and warm.cache_path != cold.cache_path
    assert torch.equal(warm.images, fresh.images) and torch.equal(warm.labels, fresh.labels)
    assert warm.characters == fresh.characters
    sizes = torch.bincount(warm.labels).tolist()
    assert sizes == ([3, 5, 4, 4] if change == "image-moved-to-another-character" else [4, 4, 4, 4])
    assert ("B/character07" in warm.characters) == (change == "character-renamed")
    if change == "image-replaced":  # the first image's pixels, and nothing else
        assert not torch.equal(warm.images[0], cold.images[0]) and torch.equal(warm.images[1:], cold.images[1:])
