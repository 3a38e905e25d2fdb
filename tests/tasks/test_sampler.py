"""FewShotSampler on synthetic labelled tensors: task structure, determinism, errors."""

from __future__ import annotations

import pytest
import torch

import maml
import tasks


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def indexed_images(classes: int, per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float images whose single pixel is their own index, labels shuffled over the images."""
    n = classes * per_class
    images = torch.arange(n, dtype=torch.float64).reshape(n, 1, 1)
    labels = torch.arange(classes).repeat_interleave(per_class)[torch.randperm(n, generator=gen(99))]
    return images, labels


def ids(x: torch.Tensor) -> torch.Tensor:
    """The image indices encoded by :func:`indexed_images`, ``(T, n)``."""
    return x.reshape(*x.shape[:2], -1)[..., 0].round().long()


def test_batch_shapes_and_labels() -> None:
    images = torch.randint(0, 256, (200, 28, 28), dtype=torch.uint8)
    labels = torch.arange(10).repeat_interleave(20)
    batch = tasks.FewShotSampler(images, labels, ways=5, shots=1, query=15).sample(32, generator=gen())
    assert isinstance(batch, maml.TaskBatch)
    assert batch.support_x.shape == (32, 5, 1, 28, 28) and batch.query_x.shape == (32, 75, 1, 28, 28)
    assert batch.support_x.dtype == torch.float32 and batch.support_y.dtype == torch.int64
    assert torch.equal(batch.support_y, torch.arange(5).expand(32, 5))
    assert torch.equal(batch.query_y, torch.arange(5).repeat_interleave(15).expand(32, 75))
    assert 0.0 <= batch.query_x.min() and batch.query_x.max() <= 1.0


def test_each_task_has_distinct_classes_and_no_image_twice() -> None:
    images, labels = indexed_images(12, 9)
    sampler = tasks.FewShotSampler(images, labels, ways=4, shots=3, query=5)
    batch, index = sampler.sample(64, generator=gen(), return_indices=True)
    torch.testing.assert_close(ids(batch.support_x), index.support)
    torch.testing.assert_close(ids(batch.query_x), index.query)
    for t in range(64):
        assert index.classes[t].unique().numel() == 4
        drawn = torch.cat([index.support[t], index.query[t]])
        assert drawn.unique().numel() == drawn.numel() == 4 * 8
        # Every image carries its task label's class, in support and query alike.
        assert torch.equal(labels[index.support[t]], index.classes[t][batch.support_y[t]])
        assert torch.equal(labels[index.query[t]], index.classes[t][batch.query_y[t]])


def test_labels_are_a_random_permutation_of_the_classes() -> None:
    images, labels = indexed_images(3, 4)
    _, index = tasks.FewShotSampler(images, labels, ways=3, shots=1, query=1).sample(200, gen(), return_indices=True)
    orders = {tuple(row) for row in index.classes.tolist()}
    assert orders == {(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)}


def test_every_class_and_image_gets_drawn() -> None:
    images, labels = indexed_images(10, 6)
    _, index = tasks.FewShotSampler(images, labels, ways=2, shots=1, query=1).sample(500, gen(), return_indices=True)
    assert index.classes.unique().numel() == 10
    assert torch.cat([index.support, index.query], 1).unique().numel() == 60


def test_same_seed_same_tasks() -> None:
    images, labels = indexed_images(10, 6)
    sampler = tasks.FewShotSampler(images, labels, ways=5, shots=1, query=2)
    a, b, c = (sampler.sample(8, generator=gen(s)) for s in (1, 1, 2))
    assert torch.equal(a.support_x, b.support_x) and torch.equal(a.query_x, b.query_x)
    assert not torch.equal(a.query_x, c.query_x)
    # A fresh sampler over the same data draws the same tasks: nothing depends on hidden state.
    again = tasks.FewShotSampler(images, labels, ways=5, shots=1, query=2).sample(8, generator=gen(1))
    assert torch.equal(a.query_x, again.query_x)


def test_unequal_class_sizes_and_arbitrary_label_values() -> None:
    # Class 7 has 2 images, class -1 has 5, class 30 has 9: shots + query = 2 draws from each.
    labels = torch.tensor([7] * 2 + [-1] * 5 + [30] * 9)
    images = torch.arange(16, dtype=torch.float32).reshape(16, 1, 1, 1)
    sampler = tasks.FewShotSampler(images, labels, ways=2, shots=1, query=1)
    assert sampler.classes.tolist() == [-1, 7, 30] and sampler.num_classes == 3
    batch, index = sampler.sample(300, generator=gen(), return_indices=True)
    drawn = torch.cat([index.support, index.query], 1)
    assert set(labels[drawn].unique().tolist()) == {-1, 7, 30}
    assert all(row.unique().numel() == 4 for row in drawn)  # padding never drawn, no image twice
    assert torch.equal(labels[index.support], index.classes.gather(1, batch.support_y))
    assert set(drawn[labels[drawn] == 30].unique().tolist()) == set(range(7, 16))
    assert set(drawn[labels[drawn] == 7].unique().tolist()) == {0, 1}


def test_a_class_smaller_than_shots_plus_query_is_refused_not_left_out() -> None:
    """It was never drawn, silently: a run reported 64 classes and trained on fewer."""
    labels = torch.tensor([7] * 2 + [-1] * 5 + [30] * 9 + [4] * 3)
    images = torch.zeros(labels.numel(), 1, 2, 2)
    match = (
        r"^shots \+ query = 1 \+ 3 = 4 distinct images are needed per class, but class 7 has 2, the smallest of 2 classes "
        r"\(of 4\) with fewer; lower shots or query, or leave those classes out of the images and labels"
    )
    with pytest.raises(ValueError, match=match):
        tasks.FewShotSampler(images, labels, ways=2, shots=1, query=3)
    names = [f"n{c:08d}" for c in range(31)]  # a data set's class names, by label value
    with pytest.raises(ValueError, match=r"but class n00000007 \(label 7\) has 2, the smallest"):
        tasks.FewShotSampler(images, labels, ways=2, shots=1, query=3, class_names=names)


def test_channels_dtype_and_scaling() -> None:
    images = torch.full((20, 3, 4, 4), 255, dtype=torch.uint8)
    labels = torch.arange(4).repeat_interleave(5)
    batch = tasks.FewShotSampler(images, labels, ways=2, shots=2, query=3).sample(3, gen(), dtype=torch.float64)
    assert batch.support_x.shape == (3, 4, 3, 4, 4) and batch.support_x.dtype == torch.float64
    assert torch.all(batch.support_x == 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_uint8_images_scale_exactly_to_every_dtype(dtype: torch.dtype) -> None:
    images = torch.arange(256, dtype=torch.uint8).reshape(16, 4, 4)
    labels = torch.arange(4).repeat_interleave(4)
    sampler = tasks.FewShotSampler(images, labels, ways=2, shots=1, query=3)
    batch, index = sampler.sample(3, gen(), dtype=dtype, return_indices=True)
    assert batch.query_x.dtype == dtype
    assert torch.equal(batch.query_x[:, :, 0], images[index.query].to(dtype) / 255)


def test_a_meta_training_step_on_sampled_tasks() -> None:
    images = torch.randint(0, 256, (60, 8, 8), dtype=torch.uint8)
    labels = torch.arange(6).repeat_interleave(10)
    batch = tasks.FewShotSampler(images, labels, ways=3, shots=1, query=2).sample(4, gen())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    learner = maml.MetaLearner(model, torch.nn.functional.cross_entropy, inner_lr=0.4, steps=1)
    loss = learner.meta_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------- bad input


def data(classes: int = 6, per_class: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(classes * per_class, 8, 8, dtype=torch.uint8), torch.arange(classes).repeat_interleave(per_class)


def test_more_ways_than_classes() -> None:
    with pytest.raises(ValueError, match=r"ways=7 but the labels hold only 6 classes; lower ways to at most 6"):
        tasks.FewShotSampler(*data(), ways=7, shots=1, query=1)


def test_more_shots_and_query_than_images_per_class() -> None:
    match = r"shots \+ query = 5 \+ 6 = 11 distinct images.*the largest has 10.*lower shots or query"
    with pytest.raises(ValueError, match=match):
        tasks.FewShotSampler(*data(), ways=2, shots=5, query=6)


@pytest.mark.parametrize("arg", ["ways", "shots", "query"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes(arg: str, value: int) -> None:
    sizes = {"ways": 2, "shots": 1, "query": 1, arg: value}
    with pytest.raises(ValueError, match=rf"{arg}={value} is out of range; it must be an int >= 1"):
        tasks.FewShotSampler(*data(), **sizes)


def test_non_positive_task_count() -> None:
    sampler = tasks.FewShotSampler(*data(), ways=2, shots=1, query=1)
    with pytest.raises(ValueError, match=r"tasks=0 is out of range"):
        sampler.sample(0)


def test_mismatched_or_malformed_inputs() -> None:
    images, labels = data()
    with pytest.raises(ValueError, match=r"images has 60 images but labels has 59 labels"):
        tasks.FewShotSampler(images, labels[:-1], ways=2, shots=1, query=1)
    with pytest.raises(TypeError, match=r"labels must be an integer tensor of shape \(N,\)"):
        tasks.FewShotSampler(images, labels.float(), ways=2, shots=1, query=1)
    with pytest.raises(TypeError, match=r"images must be a tensor of shape \(N, H, W\) or \(N, C, H, W\)"):
        tasks.FewShotSampler(images.flatten(1), labels, ways=2, shots=1, query=1)
    with pytest.raises(TypeError, match=r"images has dtype torch.int32"):
        tasks.FewShotSampler(images.int(), labels, ways=2, shots=1, query=1)
