"""What the experiment scripts say when a run diverges: which loop (inner or outer), the rate to lower and
what the checkpoint keeps; and the sine test table for diverged values.

Each message is pinned by what it must say, not its wording: one line that leads with the loop (or the flag
and its value), the meta-iteration, the rate to lower and the checkpoint, and exit code 1 (a divergence is no
usage error). The runs are in-process and tiny, with wandb disabled.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_SINE, exits, says
from torch import nn

import maml
from experiments import sine
from experiments.harness.failures import Diverged, DivergenceWatch


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


# ---------------------------------------------------------------------------- divergence: inner or outer


def test_an_infinite_or_nan_rate_is_refused_at_parse_time(capsys, tmp_path):
    out = tmp_path / "run"
    for flag, value, fixes in (
        ("--meta-lr", "inf", ("> 0", "e.g. 0.001")),
        ("--inner-lr", "nan", ("> 0", "e.g. 0.001")),
        ("--meta-lr", "1e39", ("> 0", "float32", "e.g. 0.001")),
    ):
        err = exits(capsys, sine.run, [flag, value, "--out", str(out), *TINY_SINE], 2)
        says(err, f"{flag} {float(value):g}", *fixes)
    assert not out.exists()


def test_outer_divergence_names_the_meta_iteration_and_the_meta_lr(capsys, tmp_path):
    # Adam's first step moves every weight by about the rate: 1e30 makes the next forward pass NaN.
    out = tmp_path / "run"
    argv = ["--meta-lr", "1e30", "--iterations", "5", "--checkpoint-every", "1", "--out", str(out), *TINY_SINE]
    err = exits(capsys, sine.run, argv, 1)
    says(
        err,
        "the outer loop",
        "meta-iteration 2",
        "lower --meta-lr 1e+30",
        str(out / "checkpoint.pt"),
        "meta-iteration 1",
    )
    # The iteration that diverged was not checkpointed: the checkpoint holds the finite weights before it.
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["iteration"] == 1 and all(bool(torch.isfinite(v).all()) for v in state["learner"]["model"].values())
    assert not (out / "results.json").exists()


def tiny_learner(
    steps: int, inner_lr: float
) -> tuple[nn.Module, maml.MetaLearner, torch.optim.Optimizer, maml.TaskBatch]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=inner_lr, steps=steps)
    g = torch.Generator().manual_seed(0)
    return (
        model,
        learner,
        torch.optim.Adam(learner.parameters(), lr=0.001),
        maml.TaskBatch(*(torch.randn(3, 5, 1, generator=g) for _ in range(4))),
    )


def meta_step(
    watch: DivergenceWatch, learner: maml.MetaLearner, optimizer: torch.optim.Optimizer, batch: maml.TaskBatch
) -> None:
    """A training iteration as the trainer runs it, with the watch's checks."""
    optimizer.zero_grad()
    try:
        out = learner.run(batch)
    except FloatingPointError:  # the engine's check
        raise watch.diverged(batch) from None
    watch.record(out)
    out.loss.backward()
    optimizer.step()
    watch.check_step(optimizer)


@pytest.mark.parametrize("steps", [1, 2], ids=["query-loss", "support-loss"])
def test_meta_parameters_that_ran_away_blame_the_outer_loop_though_an_inner_loss_overflows(tmp_path, steps):
    # Meta-parameters 1e5 times too large (what too high a --meta-lr does over many iterations) have a
    # finite loss of their own, and one inner step on it overflows: the outer loop is the cause.
    model, learner, optimizer, batch = tiny_learner(steps, inner_lr=0.01)
    watch = DivergenceWatch(learner, 0, 0.001, 0.01)
    meta_step(watch, learner, optimizer, batch)  # a good iteration: the own loss the run started from
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e5)
    with pytest.raises(Diverged) as diverged:  # steps=2: the engine's check; steps=1: the step after
        meta_step(watch, learner, optimizer, batch)
    loss = "query" if steps == 1 else "support"
    says(
        f"error: {diverged.value}",
        "the outer loop",
        "meta-iteration 2",
        "0.8196",
        "8.822e+18",
        f"{loss} loss",
        "lower --meta-lr 0.001",
    )
    assert watch.iteration == 1


def test_the_same_overflow_from_meta_parameters_that_did_not_run_away_blames_the_inner_lr(tmp_path):
    _, learner, optimizer, batch = tiny_learner(3, inner_lr=1e4)
    watch = DivergenceWatch(learner, 4, 0.001, 1e4)
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    says(
        f"error: {diverged.value}",
        "the inner loop",
        "meta-iteration 5",
        "2 inner steps",
        "0.8193",
        "lower --inner-lr 10000",
    )


def test_inner_divergence_names_the_inner_lr(capsys, tmp_path):
    out = tmp_path / "run"
    err = exits(
        capsys, sine.run, ["--inner-lr", "100", "--steps", "3", "--iterations", "5", "--out", str(out), *TINY_SINE], 1
    )
    says(err, "the inner loop", "lower --inner-lr 100", "no checkpoint")
    assert re.search(r"meta-iteration [1-5]\b", err), err


class Blowup(torch.optim.Optimizer):
    """SGD whose step leaves the first weight infinite (a finite gradient), or, with ``nan_grad``, is given a NaN gradient."""

    nan_grad = False

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        first = group["params"][0]
        if self.nan_grad:
            first.grad.fill_(math.nan)
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])
        first.fill_(math.inf)


@pytest.mark.parametrize("nan_grad", [False, True], ids=["finite-gradient", "nan-gradient"])
def test_an_optimizer_step_that_makes_a_weight_nan_is_caught_before_the_checkpoint(tmp_path, nan_grad):
    model = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.01)
    optimizer = Blowup(learner.parameters(), lr=0.1)
    optimizer.nan_grad = nan_grad
    watch = DivergenceWatch(learner, 7, 0.1, 0.01)
    batch = maml.TaskBatch(*(torch.randn(2, 5, 1, generator=torch.Generator().manual_seed(i)) for i in range(4)))
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    if nan_grad:  # finite losses, a NaN meta-gradient, meta-parameters that have not run away: the inner loop
        says(f"error: {diverged.value}", "the inner loop", "meta-iteration 8", "lower --inner-lr 0.01")
    else:
        says(
            f"error: {diverged.value}",
            "the outer loop",
            "meta-iteration 8",
            "--meta-lr 0.1",
            "0.weight",
            "lower --meta-lr",
        )
    assert watch.iteration == 7  # the trainer checkpoints after the step: it never gets there


# ---------------------------------------------------------------------------- the sine test table


def test_the_sine_table_keeps_its_columns_for_diverged_values():
    cfg = sine.SineConfig(eval_tasks=600, eval_shots=(5, 10), eval_steps=(1, 10))
    values = {
        (5, 1): (0.2974, 0.0312),
        (5, 10): (3411432.206, 2087494.9668689),
        (10, 1): (math.nan, math.nan),
        (10, 10): (1.5e-5, math.inf),
    }
    results = {
        f"{k}shot_{s}step": {"mse": m, "ci95": c, "shots": k, "steps": s, "diverged_tasks": int(m > 1e6)}
        for (k, s), (m, c) in values.items()
    }
    assert sine._table(results, cfg) == "\n".join(
        [
            "test MSE on 600 tasks (mean +- 95% CI)",
            "K                    1 step               10 steps",
            "5        0.297 +-     0.031  3.41e+06 +-  2.09e+06",
            "10         nan +-       nan   1.5e-05 +-       inf",
            "tasks whose inner loop diverged (infinite or NaN loss): K=5 10 steps: 1",
        ]
    )


# ---------------------------------------------------------------------------- Reptile's divergence: the inner loop's


@pytest.mark.parametrize(
    "meta_lr, own, lead, fix",
    [
        (0.01, "8.817e+18", "the inner loop", "lower --inner-lr 0.01 or --steps 2"),
        (50.0, "1.459e+18", "the outer loop", "lower --meta-lr 50 to at most 1"),
    ],
    ids=["interpolating", "overshooting"],
)
def test_reptile_meta_parameters_that_ran_away_blame_what_moved_them(
    meta_lr: float, own: str, lead: str, fix: str
) -> None:
    # Reptile's SGD step theta += meta_lr (phi - theta) stops between the meta-parameters and the adapted
    # weights at a meta-lr of at most 1: meta-parameters that ran away were led there by the inner loop, and
    # "lower --meta-lr" would send a user who already lowered it to lower it again. Above 1 the step
    # overshoots, and the fix is a meta-lr of at most 1, below the one passed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.01, steps=2, mode="reptile")
    optimizer = torch.optim.SGD(learner.parameters(), lr=meta_lr)
    g = torch.Generator().manual_seed(0)
    batch = maml.TaskBatch(*(torch.randn(3, 5, 1, generator=g) for _ in range(4)))
    watch = DivergenceWatch(learner, 0, meta_lr, 0.01, reptile=True)
    meta_step(watch, learner, optimizer, batch)  # a good iteration: the own loss the run started from
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e5)
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    line = f"error: {diverged.value}"
    says(line, lead, "meta-iteration 2", "0.8196", own, fix)
    assert ("lower --meta-lr" in line) == (meta_lr > 1), line


def test_a_reptile_run_that_diverges_names_the_inner_lr_not_the_meta_lr_it_lowered(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["--algorithm", "reptile", "--inner-lr", "5", "--meta-lr", "0.01", "--iterations", "50", "--out", str(out)]
    err = exits(capsys, sine.run, [*argv, *TINY_SINE], 1)
    says(err, "the inner loop", "lower --inner-lr 5 or --steps 5")
    assert re.search(r"meta-iteration \d+", err), err
    assert "lower --meta-lr" not in err
