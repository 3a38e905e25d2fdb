"""The recipes' schedules (MAML++'s multi-step loss, derivative-order annealing, cosine meta-lr) and their runs.

The multi-step loss weights are checked against MAML++'s own formula
(``get_per_step_loss_importance_vector`` in ``HowToTrainYourMAMLPytorch``), rewritten here
independently in numpy with its epoch counter made continuous.
"""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest
import torch
from test_experiments import checkpoint
from test_run_faults import one_error, run_sine
from torch import nn

import maml
from experiments import recipes, sine
from experiments.recipes import Schedule


def mamlpp_weights(steps: int, epoch: float, msl_epochs: float) -> np.ndarray:
    weights = np.ones(steps) / steps
    decay = 1.0 / steps / msl_epochs
    floor = 0.03 / steps
    for i in range(steps - 1):
        weights[i] = np.maximum(weights[i] - epoch * decay, floor)
    weights[-1] = np.minimum(weights[-1] + epoch * (steps - 1) * decay, 1.0 - (steps - 1) * floor)
    return weights


@pytest.mark.parametrize("steps", [2, 5])
def test_multi_step_loss_weights_follow_mamlpp(steps):
    schedule = Schedule(iterations=1000, meta_lr=1e-3, msl_fraction=0.1, steps=steps)  # 100 annealed iterations
    for iteration in (0, 1, 37, 50, 99):
        got = schedule.step_weights(iteration)
        want = mamlpp_weights(steps, epoch=iteration / 100 * 10, msl_epochs=10)  # 10 "epochs" of 10 iterations
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-15)
    assert torch.equal(schedule.step_weights(0), torch.full((steps,), 1 / steps, dtype=torch.float64))
    assert schedule.step_weights(100) is None and schedule.step_weights(999) is None  # then the last step's loss only
    assert Schedule(1000, 1e-3, msl_fraction=0.1, steps=1).step_weights(0) is None


def test_cosine_meta_lr_and_derivative_order_annealing():
    schedule = Schedule(
        iterations=101,
        meta_lr=1e-3,
        meta_lr_schedule="cosine",
        min_meta_lr=1e-5,
        mode="second_order",
        first_order_fraction=0.5,
    )
    assert schedule.lr(0) == 1e-3 and math.isclose(schedule.lr(100), 1e-5, rel_tol=1e-12)
    assert math.isclose(schedule.lr(50), (1e-3 + 1e-5) / 2, rel_tol=1e-12)
    assert [schedule.mode_at(i) for i in (0, 50, 51, 100)] == [
        "first_order",
        "first_order",
        "second_order",
        "second_order",
    ]
    assert Schedule(10, 1e-3).lr(7) == 1e-3 and not Schedule(10, 1e-3).depends_on_length
    assert schedule.depends_on_length


def test_adapt_sets_name_the_head():
    model = sine.build_model(8)
    assert recipes.adapt_set(model, "all") is None
    head, body = recipes.adapt_set(model, "head"), recipes.adapt_set(model, "body")
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if head(n)] == ["4.weight", "4.bias"]
    assert [n for n in names if body(n)] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    deep = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    assert [n for n, _ in deep.named_parameters() if recipes.adapt_set(deep, "head")(n)] == ["1.1.weight", "1.1.bias"]


def test_learned_rates_take_their_own_meta_lr_through_the_schedule():
    learner = maml.MetaLearner(
        sine.build_model(8), torch.nn.functional.mse_loss, 1e-3, steps=2, learn_inner_lr="per_layer_per_step"
    )
    optimizer = recipes.meta_optimizer(learner, 1e-3, 1e-5)
    weights, rates = optimizer.param_groups
    assert weights["params"] == list(learner.model.parameters()) and weights["lr"] == 1e-3
    assert rates["params"] == list(learner.rate_parameters.values()) and rates["lr"] == 1e-5
    schedule = Schedule(iterations=101, meta_lr=1e-3, meta_lr_schedule="cosine", min_meta_lr=1e-5)
    schedule.apply(50, learner, optimizer)
    assert weights["lr"] == schedule.lr(50) and math.isclose(rates["lr"], schedule.lr(50) / 100, rel_tol=1e-12)
    assert [g["lr"] for g in recipes.meta_optimizer(learner, 1e-3).param_groups] == [1e-3, 1e-3]  # default: --meta-lr
    fixed = maml.MetaLearner(sine.build_model(8), torch.nn.functional.mse_loss, 1e-3)
    assert len(recipes.meta_optimizer(fixed, 1e-3, 1e-5).param_groups) == 1  # nothing to give it to


MAMLPP = ["--algorithm", "mamlpp", "--steps", "3", "--log-every", "2", "--val-every", "4"]


def test_a_mamlpp_run_resumes_bit_for_bit(capsys, tmp_path, monkeypatch):
    """Every schedule (multi-step loss, first order, cosine lr) is a function of the iteration: a stop changes nothing."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_sine(capsys, [*MAMLPP, "--iterations", "8", "--out", str(whole)])
    apply = Schedule.apply

    def interrupted(self, iteration, learner, optimizer):  # Ctrl-C during iteration 5 (of 8): in the second-order half
        if iteration == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return apply(self, iteration, learner, optimizer)

    monkeypatch.setattr(Schedule, "apply", interrupted)
    run_sine(capsys, [*MAMLPP, "--iterations", "8", "--out", str(cut)], code=130)
    assert checkpoint(cut)["iteration"] == 5
    monkeypatch.setattr(Schedule, "apply", apply)
    run_sine(capsys, [*MAMLPP, "--iterations", "8", "--out", str(cut), "--resume"])
    a, b = checkpoint(whole), checkpoint(cut)
    assert a["iteration"] == b["iteration"] == 8
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"] < 1e-3  # cosine
    for part in ("model", "inner_lrs"):
        for key, value in a["learner"][part].items():
            assert torch.equal(b["learner"][part][key], value), key


def test_a_length_scheduled_run_refuses_another_length_on_resume(capsys, tmp_path):
    out = tmp_path / "run"
    run_sine(capsys, [*MAMLPP, "--iterations", "4", "--out", str(out)])
    line = one_error(run_sine(capsys, [*MAMLPP, "--iterations", "6", "--out", str(out), "--resume"], code=2))
    assert line == (
        "error: --resume: --iterations 6 differs from the run's 4, and its schedule (meta_lr_schedule, "
        "first_order_fraction or msl_fraction, as --algorithm sets them) is a share of --iterations; "
        "resume with --iterations 4."
    )
