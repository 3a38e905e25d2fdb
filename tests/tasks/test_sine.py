"""Sine regression tasks: ranges, shapes, the true function, determinism, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import maml
import tasks


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_sample_is_a_task_batch_of_the_requested_shape() -> None:
    batch = tasks.Sine().sample(25, shots=10, query=7, generator=gen())
    assert isinstance(batch, maml.TaskBatch)
    assert batch.support_x.shape == batch.support_y.shape == (25, 10, 1)
    assert batch.query_x.shape == batch.query_y.shape == (25, 7, 1)
    assert all(t.dtype == torch.float32 for t in (batch.support_x, batch.support_y, batch.query_x, batch.query_y))


def test_the_paper_ranges_by_default() -> None:
    batch, truth = tasks.Sine().sample(2000, shots=5, query=5, generator=gen(), return_params=True)
    x = torch.cat([batch.support_x, batch.query_x], dim=1)
    assert truth.amplitude.shape == truth.phase.shape == (2000,)
    assert 0.1 <= truth.amplitude.min() and truth.amplitude.max() <= 5.0
    assert 0.0 <= truth.phase.min() and truth.phase.max() <= math.pi
    assert -5.0 <= x.min() and x.max() <= 5.0
    # Uniform draws fill their ranges: the extremes are near the ends.
    assert truth.amplitude.min() < 0.2 and truth.amplitude.max() > 4.9
    assert truth.phase.min() < 0.05 and truth.phase.max() > math.pi - 0.05
    assert x.min() < -4.99 and x.max() > 4.99


def test_targets_are_the_true_function() -> None:
    batch, truth = tasks.Sine().sample(8, shots=4, query=6, generator=gen(), return_params=True)
    for x, y in ((batch.support_x, batch.support_y), (batch.query_x, batch.query_y)):
        expected = truth.amplitude[:, None, None] * torch.sin(x.double() - truth.phase[:, None, None])
        torch.testing.assert_close(y, expected.float())
        torch.testing.assert_close(truth.true_y(x), y)


def test_true_y_on_a_shared_grid() -> None:
    _, truth = tasks.Sine().sample(3, generator=gen(), return_params=True)
    grid = torch.linspace(-5, 5, 11)
    curves = truth.true_y(grid)
    assert curves.shape == (3, 11)
    torch.testing.assert_close(curves[1], (truth.amplitude[1] * torch.sin(grid.double() - truth.phase[1])).float())
    with pytest.raises(ValueError, match="dimension 0 must be the 3 tasks"):
        truth.true_y(torch.zeros(4, 2, 1))


def test_same_seed_same_tasks_other_seed_other_tasks() -> None:
    sine = tasks.Sine()
    a, b, c = (sine.sample(5, generator=gen(s)) for s in (7, 7, 8))
    torch.testing.assert_close(a.support_x, b.support_x, rtol=0, atol=0)
    torch.testing.assert_close(a.query_y, b.query_y, rtol=0, atol=0)
    assert not torch.equal(a.support_x, c.support_x)


def test_the_same_seed_gives_these_tasks_on_any_machine() -> None:
    # Golden values: everything is drawn in float64 on a CPU generator, whose stream is fixed.
    batch, truth = tasks.Sine().sample(3, shots=2, query=1, generator=gen(1234), return_params=True)
    f64 = torch.float64
    torch.testing.assert_close(truth.amplitude, torch.tensor([1.2359874432, 1.4213553610, 4.0679272953], dtype=f64))
    torch.testing.assert_close(truth.phase, torch.tensor([0.2474125523, 0.6245611744, 0.1194355147], dtype=f64))
    support = [[-0.3359383941, -0.8562051058], [-2.6578722000, -2.3060028553], [2.3208873272, 1.1374368668]]
    torch.testing.assert_close(batch.support_x[:, :, 0], torch.tensor(support))
    torch.testing.assert_close(batch.query_x[:, :, 0], torch.tensor([[-1.0955054760], [4.1004662514], [-2.2644515038]]))


def test_dtype_changes_precision_not_the_draws() -> None:
    single = tasks.Sine().sample(4, generator=gen(3))
    double = tasks.Sine().sample(4, generator=gen(3), dtype=torch.float64)
    assert double.support_x.dtype == torch.float64
    torch.testing.assert_close(double.support_y.float(), single.support_y)


def test_custom_ranges() -> None:
    sine = tasks.Sine(amplitude=(1.0, 1.0), phase=(0.0, 0.0), x_range=(0.0, 1.0))
    batch = sine.sample(4, shots=3, query=3, generator=gen())
    assert 0 <= batch.support_x.min() and batch.support_x.max() <= 1
    torch.testing.assert_close(batch.support_y, torch.sin(batch.support_x))


def test_a_meta_training_step_on_sine_tasks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    learner = maml.MetaLearner(model, nn.functional.mse_loss, inner_lr=0.01, steps=1)
    loss = learner.meta_loss(tasks.Sine().sample(4, shots=10, query=10, generator=gen()))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arg", ["tasks", "shots", "query"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_sizes_are_refused(arg: str, value: int) -> None:
    sizes = {"tasks": 4, "shots": 5, "query": 5, arg: value}
    with pytest.raises(ValueError, match=rf"{arg}={value} is out of range; it must be an int >= 1"):
        tasks.Sine().sample(sizes["tasks"], shots=sizes["shots"], query=sizes["query"])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="shots must be an int"):
        tasks.Sine().sample(4, shots=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"amplitude=\(5.0, 0.1\) has low > high"):
        tasks.Sine(amplitude=(5.0, 0.1))
    with pytest.raises(TypeError, match="x_range must be a \\(low, high\\) pair"):
        tasks.Sine(x_range=5.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        tasks.Sine().sample(4, dtype=torch.int64)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        tasks.Sine().sample(4, generator=0)  # type: ignore[arg-type]
