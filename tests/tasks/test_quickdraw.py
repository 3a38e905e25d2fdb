"""Quick Draw on 345 tiny class files the tests write: Meta-Dataset's split, memory maps, seeded sampling, refusals."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import drawings, write_quickdraw

import maml
import tasks
from tasks._src.quickdraw import CLASSES

PER_CLASS = 4
HELP = (
    "Quick Draw is not downloaded at run time: the numpy_bitmap files, one <class name>.npy per class, of "
    "github.com/googlecreativelab/quickdraw-dataset (gs://quickdraw_dataset/full/numpy_bitmap), in one folder or its "
    "quickdraw/ subfolder as learn2learn keeps them (docs/data.md lists each layout)."
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quickdraw(tmp_path_factory.mktemp("quickdraw"))


def test_the_split_is_learn2learns_meta_dataset_split() -> None:
    l2l = pytest.importorskip("learn2learn.vision.datasets.quickdraw")
    assert {k: len(v) for k, v in CLASSES.items()} == {"train": 241, "val": 52, "test": 52}
    assert list(CLASSES["train"]) == l2l.SPLITS["train"]
    assert list(CLASSES["val"]) == l2l.SPLITS["validation"]
    assert list(CLASSES["test"]) == l2l.SPLITS["test"]
    every = [name for names in CLASSES.values() for name in names]
    assert len(set(every)) == len(every) == 345  # no class in two splits
    assert tasks.QuickDraw.spec.counts == (241, 52, 52)


def test_the_splits_are_memory_maps_of_each_classs_file(root: Path) -> None:
    splits = tasks.QuickDraw.splits(root)
    assert isinstance(splits, tasks.ImageSplits)
    for part, split, count in zip(splits, ("train", "val", "test"), (241, 52, 52)):
        assert part.split == split and part.num_classes == count and part.classes == list(CLASSES[split])
        assert len(part) == count * PER_CLASS and part.image_size == 28 and part.layout == "numpy-bitmap"
        assert all(type(a) is np.memmap and a.shape == (PER_CLASS, 784) and a.dtype == np.uint8 for a in part.arrays)
        assert [Path(a.filename).name for a in part.arrays] == [f"{n}.npy" for n in CLASSES[split]]
        # Nothing else the set holds is an array of drawings: only the maps and the counts.
        held = [v for v in vars(part).values() if isinstance(v, (np.ndarray, torch.Tensor))]
        assert len(held) == 1 and torch.equal(held[0], torch.full((count,), PER_CLASS))
    assert tasks.QuickDraw(root, "validation").split == "val"


def test_learn2learns_quickdraw_subfolder_is_read(tmp_path: Path) -> None:
    write_quickdraw(tmp_path / "quickdraw")
    part = tasks.QuickDraw(tmp_path, "test")
    assert Path(part.arrays[0].filename).parent.name == "quickdraw"


def test_a_sample_holds_the_drawings_it_names(root: Path) -> None:
    part = tasks.QuickDraw(root, "train")
    ways, shots, query, T = 5, 1, 3, 6
    batch, indices = part.sampler(ways, shots, query).sample(T, gen(), return_indices=True)
    assert isinstance(batch, maml.TaskBatch)
    assert batch.support_x.shape == (T, ways * shots, 1, 28, 28) and batch.query_x.shape == (T, ways * query, 1, 28, 28)
    assert batch.support_x.dtype == torch.float32 and 0 <= batch.support_x.min() and batch.query_x.max() <= 1
    assert torch.equal(batch.support_y, torch.arange(ways).repeat_interleave(shots).expand(T, -1))
    assert torch.equal(batch.query_y, torch.arange(ways).repeat_interleave(query).expand(T, -1))
    assert indices.classes.shape == (T, ways) and all(len(set(row.tolist())) == ways for row in indices.classes)
    pixels = torch.cat([batch.support_x, batch.query_x], 1).reshape(T, ways * (shots + query), 784) * 255
    labels = torch.cat([batch.support_y, batch.query_y], 1)
    index = torch.cat([indices.support, indices.query], 1)
    for t in range(T):
        for p in range(index.shape[1]):
            c = int(indices.classes[t, labels[t, p]])
            row = int(index[t, p]) - c * PER_CLASS  # every class holds PER_CLASS drawings: class c starts at c * 4
            assert 0 <= row < PER_CLASS
            assert torch.equal(pixels[t, p].round().to(torch.uint8), torch.from_numpy(drawings(c, PER_CLASS)[row]))
        for j in range(ways):  # shots + query distinct drawings of each class: none in both sets
            rows = pixels[t, labels[t] == j, 0].tolist()
            assert len(set(rows)) == shots + query


def test_the_same_generator_gives_the_same_batch_and_the_classes_fewshotsampler_draws(root: Path) -> None:
    part = tasks.QuickDraw(root, "val")
    sampler = part.sampler(5, 1, 2)
    a, b, c = (sampler.sample(8, gen(seed)) for seed in (3, 3, 4))
    assert torch.equal(a.support_x, b.support_x) and torch.equal(a.query_x, b.query_x)
    assert not torch.equal(a.support_x, c.support_x)
    images = torch.from_numpy(np.concatenate([np.asarray(x) for x in part.arrays])).view(-1, 1, 28, 28)
    labels = torch.arange(part.num_classes).repeat_interleave(PER_CLASS)
    reference = tasks.FewShotSampler(images, labels, 5, 1, 2).sample_indices(8, gen(3))
    assert torch.equal(sampler.sample_indices(8, gen(3)).classes, reference.classes)


def test_the_drawings_of_a_class_are_a_uniform_subset_in_uniform_order() -> None:
    arrays = [drawings(0, 6), drawings(1, 6)]
    indices = tasks.QuickDrawSampler(arrays, ways=1, shots=1, query=2).sample_indices(3000, gen(1))
    rows = torch.cat([indices.support, indices.query], 1) % 6  # both classes hold 6 drawings
    assert all(len(set(r.tolist())) == 3 for r in rows)
    subsets = {s: 0 for s in itertools.combinations(range(6), 3)}
    for r in rows.tolist():
        subsets[tuple(sorted(r))] += 1
    assert min(subsets.values()) > 100 and max(subsets.values()) < 200  # 150 each expected
    support = torch.bincount(indices.support.flatten() % 6, minlength=6)
    assert support.min() > 420 and support.max() < 580  # 500 each: the support drawing is any of the class


def test_side_resizes_the_drawings_drawn(root: Path) -> None:
    part = tasks.QuickDraw(root, "test", side=56)
    batch = part.sampler(3, 1, 1).sample(2, gen())
    assert part.image_size == 56 and batch.support_x.shape == (2, 3, 1, 56, 56) and batch.query_x.shape[-1] == 56
    assert 0 <= batch.support_x.min() and batch.support_x.max() <= 1


def test_sampling_reads_only_the_rows_drawn(tmp_path: Path) -> None:
    """A 10,000-drawing class (7.8 MB): a task asks the map for its few rows, and only their pages come in."""
    write_quickdraw(tmp_path, big={"ant": 10_000})
    part = tasks.QuickDraw(tmp_path, "val")
    big = part.arrays[0]
    assert type(big) is np.memmap and big.shape == (10_000, 784)
    asked: list[np.ndarray] = []

    class Recorder:
        shape = big.shape

        def __getitem__(self, key: np.ndarray) -> np.ndarray:
            asked.append(np.asarray(key))
            return big[key]

    sampler = tasks.QuickDrawSampler(
        [Recorder(), *part.arrays[1:]], ways=52, shots=1, query=3, class_names=part.classes
    )
    batch, indices = sampler.sample(4, gen(), return_indices=True)
    assert len(asked) == 4 and all(key.shape == (4,) and key.dtype.kind == "i" for key in asked)
    want = torch.cat([indices.support, indices.query], 1)[indices.classes.eq(0).nonzero()[:, 0]]  # class 0's rows
    assert sorted(np.concatenate(asked).tolist()) == sorted(want[want < 10_000].tolist())
    # Loading the split and sampling from it allocate a few rows, never a class's 7.8 MB (numpy's memory is traced).
    tracemalloc.start()
    try:
        tasks.QuickDraw(tmp_path, "val").sampler(52, 1, 3).sample(1, gen(1))  # 208 drawings, 163 kB
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 4, peak


def test_a_class_too_small_or_too_few_classes_are_named(root: Path) -> None:
    part = tasks.QuickDraw(root, "test")
    with pytest.raises(ValueError) as info:
        part.sampler(5, 2, 3)
    assert str(info.value) == (
        "shots + query = 2 + 3 = 5 distinct drawings are needed per class, but class angel has 4, the smallest of 52 "
        "classes (of 52) with fewer; lower shots or query."
    )
    with pytest.raises(ValueError) as info:
        part.sampler(53, 1, 1)
    assert str(info.value) == "ways=53 but the split holds only 52 classes; lower ways to at most 52."


def test_a_missing_folder_or_class_file_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError) as info:
        tasks.QuickDraw(tmp_path / "nowhere")
    assert str(info.value) == f"Quick Draw folder {tmp_path / 'nowhere'} does not exist; {HELP}"
    monkeypatch.delenv("QUICKDRAW_DIR", raising=False)
    with pytest.raises(ValueError) as info:
        tasks.QuickDraw()
    assert str(info.value) == f"no Quick Draw folder: pass root= the folder or set $QUICKDRAW_DIR; {HELP}"
    folder = write_quickdraw(tmp_path / "data")
    (folder / "cat.npy").unlink()
    (folder / "swan.npy").unlink()
    with pytest.raises(ValueError) as info:
        tasks.QuickDraw(folder, "train")
    assert str(info.value) == (
        f"{folder} has no swan.npy: 2 of the 241 class files of the train split of Quick Draw are missing; {HELP}"
    )
    monkeypatch.setenv("QUICKDRAW_DIR", str(folder))
    assert tasks.QuickDraw(split="val").num_classes == 52  # the other splits still read
    with pytest.raises(ValueError, match="has no swan.npy"):
        tasks.QuickDraw.splits(folder)


def _truncated(path: Path) -> None:
    np.save(path, drawings(0, 10))
    path.write_bytes(path.read_bytes()[:1000])


BAD_FILES = {
    "truncated": (_truncated, "cannot map {path} as a .npy array (mmap length is greater than file size): the file is "
                  "not a numpy file or is truncated"),
    "not numpy": (lambda p: p.write_text("ant,anvil\n"), "cannot map {path} as a .npy array (Cannot load file "
                  "containing pickled data when allow_pickle=False): the file is not a numpy file or is truncated"),
    "empty": (lambda p: p.write_bytes(b""), "cannot map {path} as a .npy array (No data left in file): the file is not "
              "a numpy file or is truncated"),
    "images": (lambda p: np.save(p, np.zeros((3, 28, 28), np.uint8)), "{path} holds a uint8 array of shape (3, 28, 28), "
               "not (N, 784) uint8 (a 28 x 28 drawing a row, as the numpy_bitmap files hold)"),
    "floats": (lambda p: np.save(p, np.zeros((3, 784), np.float32)), "{path} holds a float32 array of shape (3, 784), "
               "not (N, 784) uint8 (a 28 x 28 drawing a row, as the numpy_bitmap files hold)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_class_file_is_one_line_naming_it(tmp_path: Path, case: str) -> None:
    damage, said = BAD_FILES[case]
    folder = write_quickdraw(tmp_path)
    path = folder / "ant.npy"
    damage(path)
    with pytest.raises(ValueError) as info:
        tasks.QuickDraw(folder, "val")
    assert str(info.value) == said.format(path=path) + f"; {HELP}"
    assert tasks.QuickDraw(folder, "train").num_classes == 241
