"""Tasks from a real learn2learn TaskDataset over the real Omniglot images, and from plain iterables."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import omniglot_root
from torch import nn

import maml
import tasks


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> tasks.Omniglot:
    """The real archives from $OMNIGLOT_DIR (else the folder .ci/run defaults to); missing data fails."""
    root = omniglot_root()
    return tasks.Omniglot(root, rotations=False, cache_dir=tmp_path_factory.mktemp("omniglot-cache"))


def test_batches_from_a_real_learn2learn_task_dataset(omni: tasks.Omniglot) -> None:
    import learn2learn as l2l  # a peer installed by scripts/setup.sh; imported here as it takes seconds

    transforms = l2l.data.transforms
    keep = omni.labels < 60
    images, labels = omni.images[keep].unsqueeze(1).float() / 255, omni.labels[keep]
    dataset = l2l.data.MetaDataset(torch.utils.data.TensorDataset(images, labels))
    taskset = l2l.data.Taskset(  # TaskDataset under its current, non-deprecated name
        dataset,
        task_transforms=[
            transforms.NWays(dataset, n=5),
            transforms.KShots(dataset, k=1 + 15),
            transforms.LoadData(dataset),
            transforms.RemapLabels(dataset),
        ],
        num_tasks=-1,
    )
    random.seed(0)  # learn2learn draws with Python's random module
    batches = list(tasks.from_learn2learn(taskset, tasks_per_batch=4, shots=1, query=15, num_batches=2))
    assert len(batches) == 2
    # Which character each image is, recovered from its pixels.
    character_of = {bytes(img.numpy()): int(c) for img, c in zip(omni.images[keep], labels)}

    def characters(x: torch.Tensor) -> torch.Tensor:
        as_uint8 = (x[:, 0] * 255).round().to(torch.uint8)
        return torch.tensor([character_of[bytes(img.numpy())] for img in as_uint8])

    for batch in batches:
        assert isinstance(batch, maml.TaskBatch)
        assert batch.support_x.shape == (4, 5, 1, 28, 28) and batch.query_x.shape == (4, 75, 1, 28, 28)
        assert torch.equal(batch.support_y, torch.arange(5).expand(4, 5))
        assert torch.equal(batch.query_y, torch.arange(5).repeat_interleave(15).expand(4, 75))
        for t in range(4):
            support, query = characters(batch.support_x[t]), characters(batch.query_x[t])
            assert support.unique().numel() == 5
            assert torch.equal(query, support.repeat_interleave(15))  # a label is one character in both sets
            x = torch.cat([batch.support_x[t], batch.query_x[t]]).flatten(1)
            assert torch.unique(x, dim=0).shape[0] == 80  # no image in both sets
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 5))
    loss = maml.MetaLearner(model, nn.functional.cross_entropy, inner_lr=0.4).meta_loss(batches[0])
    loss.backward()
    assert torch.isfinite(loss)


def test_split_task_per_class_keeps_order_and_remaps_labels() -> None:
    x = torch.arange(9.0).reshape(9, 1)
    y = torch.tensor([7, 3, 7, 3, 9, 9, 7, 3, 9])
    sx, sy, qx, qy = tasks.split_task(x, y, shots=1, query=2)
    assert sx.flatten().tolist() == [1.0, 0.0, 4.0] and sy.tolist() == [0, 1, 2]
    assert qx.flatten().tolist() == [3.0, 7.0, 2.0, 6.0, 5.0, 8.0] and qy.tolist() == [0, 0, 1, 1, 2, 2]
    _, _, qx_rest, _ = tasks.split_task(x, y, shots=2)  # query=None: the rest of every class
    assert qx_rest.flatten().tolist() == [7.0, 6.0, 8.0]


def test_batches_of_regression_tasks_from_any_iterable() -> None:
    g = torch.Generator().manual_seed(0)
    source = tasks.Sine().sample(5, shots=6, query=4, generator=g)
    x = torch.cat([source.support_x, source.query_x], dim=1)
    y = torch.cat([source.support_y, source.query_y], dim=1)
    pairs = [(x[t], y[t]) for t in range(5)]
    out = list(tasks.batches(iter(pairs), tasks_per_batch=2, shots=6))
    assert [b.num_tasks for b in out] == [2, 2, 1]
    assert torch.equal(out[1].support_x, source.support_x[2:4]) and torch.equal(out[2].query_y, source.query_y[4:])
    assert [b.num_tasks for b in tasks.batches(pairs, 2, shots=6, query=4, drop_last=True)] == [2, 2]
    batch = tasks.collate(pairs, shots=3, query=2)
    assert batch.support_x.shape == (5, 3, 1) and batch.query_x.shape == (5, 2, 1)


def test_bad_tasks_are_refused() -> None:
    x, y = torch.zeros(6, 2), torch.tensor([0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"class 0 of the task has 2 examples but shots \+ query = 1 \+ 2 = 3.*KShots"):
        tasks.split_task(x, y, shots=1, query=2)
    with pytest.raises(ValueError, match=r"classes of the task have \[2, 4\] examples; with query=None"):
        tasks.split_task(x, y, shots=1)
    with pytest.raises(ValueError, match=r"x has 6 examples but y has 5"):
        tasks.split_task(x, y[:5], shots=1)
    with pytest.raises(ValueError, match=r"shots=0 is out of range"):
        tasks.split_task(x, y, shots=0)
    with pytest.raises(TypeError, match=r"task 1 is a Tensor, not an \(x, y\) pair.*LoadData"):
        tasks.collate([(x, y), x], shots=1, query=1)
    with pytest.raises(ValueError, match=r"support_x of task 0 has shape \(2, 2\) but task 1 has \(3, 2\)"):
        tasks.collate([(x[:4], y[:4]), (torch.zeros(6, 2), torch.tensor([0, 0, 1, 1, 2, 2]))], shots=1, query=1)
    with pytest.raises(ValueError, match=r"collate got no task"):
        tasks.collate([], shots=1)
    with pytest.raises(TypeError, match=r"taskset must be a learn2learn TaskDataset.*tasks\.batches"):
        tasks.from_learn2learn([(x, y)], tasks_per_batch=2, shots=1)
    with pytest.raises(ValueError, match=r"tasks_per_batch=0 is out of range"):
        tasks.batches([(x, y)], tasks_per_batch=0, shots=1)
