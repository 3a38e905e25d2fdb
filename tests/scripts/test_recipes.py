"""The recipes: their schedules (MAML++'s multi-step loss, derivative-order annealing, cosine meta-lr), the Reptile
and iMAML recipes, MAML++'s per-step batch norm in the scripts, and their runs.

The multi-step loss weights are checked against MAML++'s own formula
(``get_per_step_loss_importance_vector`` in ``HowToTrainYourMAMLPytorch``), rewritten here
independently in numpy with its epoch counter made continuous. Reptile's outer step is checked
against supervised-reptile's (``reptile.py``: ``frac_done = i / meta_iters``, the meta-step
interpolated linearly to ``meta_step_final``, then ``old + step * (mean(new) - old)``), written out
here by hand.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal

import numpy as np
import pytest
import torch
from helpers import checkpoint, omniglot_root, one_error, run_sine, says
from torch import nn

import maml
from experiments import omniglot, sine
from experiments.harness import config, recipes
from experiments.harness.recipes import Schedule
from experiments.nets import build_model, meta_only
from experiments.omniglot import load as load_omniglot


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
    says(line, "--resume", "--iterations 6", "resume with --iterations 4")


# ---------------------------------------------------------------- Reptile, iMAML, per-step batch norm


def parsed(experiment, cls, argv):
    cfg, _ = config.parse_args(experiment, cls, [*argv, "--wandb", "disabled"], "", lambda c: None)
    return cfg.resolved() if hasattr(cfg, "resolved") else cfg


def test_the_linear_meta_step_is_supervised_reptiles():
    schedule = Schedule(iterations=100, meta_lr=1.0, meta_lr_schedule="linear", min_meta_lr=0.0)
    for i in (0, 1, 37, 99):
        frac_done = i / 100
        assert schedule.lr(i) == pytest.approx(frac_done * 0.0 + (1 - frac_done) * 1.0, abs=1e-15)
    assert schedule.depends_on_length


def test_sgd_on_reptiles_direction_is_its_outer_step():
    torch.manual_seed(0)
    net = sine.build_model(8)
    learner = maml.MetaLearner(net, torch.nn.functional.mse_loss, 0.02, steps=3, mode="reptile")
    batch = maml.TaskBatch(*(torch.randn(4, 6, 1) for _ in range(4)))
    old = {k: v.detach().clone() for k, v in net.named_parameters()}
    with torch.no_grad():  # the adapted weights of each task, by hand: plain SGD on the support MSE
        adapted = []
        for t in range(4):
            w = {k: v.clone().requires_grad_() for k, v in old.items()}
            for _ in range(3):
                with torch.enable_grad():
                    loss = torch.nn.functional.mse_loss(
                        torch.func.functional_call(net, w, batch.support_x[t]), batch.support_y[t]
                    )
                    grads = torch.autograd.grad(loss, list(w.values()))
                w = {k: (v - 0.02 * g).detach().requires_grad_() for (k, v), g in zip(w.items(), grads)}
            adapted.append(w)
    optimizer = recipes.meta_optimizer(learner, 0.7, kind="sgd")
    learner.meta_loss(batch).backward()
    optimizer.step()
    for k, p in net.named_parameters():
        mean_new = torch.stack([a[k] for a in adapted]).mean(0)
        torch.testing.assert_close(p.detach(), old[k] + 0.7 * (mean_new - old[k]), rtol=1e-5, atol=1e-6)


def test_the_reptile_recipe_sets_its_released_codes_values():
    cfg = parsed("omniglot", omniglot.OmniglotConfig, ["--algorithm", "reptile"])
    assert (cfg.mode, cfg.meta_optimizer, cfg.meta_lr, cfg.meta_lr_schedule, cfg.min_meta_lr) == (
        "reptile",
        "sgd",
        1.0,
        "linear",
        0.0,
    )
    assert (cfg.inner_optimizer, cfg.inner_adam_betas, cfg.inner_lr, cfg.steps) == ("adam", (0.0, 0.999), 1e-3, 5)
    assert (cfg.shots, cfg.train_shots, cfg.meta_batch, cfg.iterations, cfg.eval_steps) == (1, 10, 5, 100_000, (50,))
    cfg = parsed("sine", sine.SineConfig, ["--algorithm", "reptile"])
    assert (cfg.mode, cfg.inner_lr, cfg.steps, cfg.meta_batch, cfg.meta_lr, cfg.iterations) == (
        "reptile",
        0.02,
        5,
        1,
        0.1,
        30_000,
    )


def test_the_imaml_recipe_sets_its_released_codes_values():
    cfg = parsed("omniglot", omniglot.OmniglotConfig, ["--algorithm", "imaml"])
    assert (cfg.mode, cfg.implicit_lam, cfg.cg_iterations, cfg.steps, cfg.inner_lr, cfg.meta_batch) == (
        "implicit",
        2.0,
        5,
        16,
        0.1,
        32,
    )
    assert (cfg.loss, cfg.network) == ("mean", "maxpool")


@pytest.mark.parametrize("network", ["strided", "maxpool"])
def test_per_step_batch_norm_gets_the_step_and_stays_out_of_the_inner_loop(network):
    torch.manual_seed(0)
    net = build_model(5, 8, network, per_step_bn=3)
    norms = [m for m in net.modules() if isinstance(m, maml.nn.StepBatchNorm2d)]
    assert len(norms) == 4 and all(m.weight.shape == (3, 8) for m in norms)
    assert meta_only(net) == {f"{i}.{p}" for i, m in enumerate(net) if m in norms for p in ("weight", "bias")}
    with torch.no_grad():
        for m in norms:
            m.bias[2] += 1.0  # step 2's offsets only
    x = torch.randn(5, 1, 28, 28)
    assert torch.equal(net(x, step=0), net(x, step=1)) and not torch.equal(net(x, step=1), net(x, step=2))
    assert torch.equal(net(x, step=2), net(x, step=7))  # past the last row: the last row


def test_the_mamlpp_recipe_builds_per_step_batch_norm_on_omniglot():
    cfg = parsed("omniglot", omniglot.OmniglotConfig, ["--algorithm", "mamlpp"])
    assert cfg.per_step_bn and cfg.steps == 5
    net = omniglot.make_model(cfg).module
    assert isinstance(net, maml.nn.StepSequential)
    assert sum(isinstance(m, maml.nn.StepBatchNorm2d) and m.steps == 5 for m in net.modules()) == 4


def test_reptile_trains_on_more_shots_than_it_tests():
    cfg = parsed("omniglot", omniglot.OmniglotConfig, ["--algorithm", "reptile", "--data", str(omniglot_root())])
    _, (train, val, test) = load_omniglot(dataclasses.replace(cfg, split_fractions=(0.6, 0.15, 0.25)))
    g = torch.Generator().manual_seed(0)
    assert train.sample(2, g).support_x.shape[1] == 5 * 10
    assert val.sample(2, g).support_x.shape[1] == test.sample(2, g).support_x.shape[1] == 5 * 1


@pytest.mark.parametrize(
    "args, lead, fixes",
    [
        (
            ["--algorithm", "reptile", "--learn-inner-lr", "scalar"],
            "--learn-inner-lr scalar",
            ("--mode reptile", "drop it", "pick another --mode"),
        ),
        (
            ["--algorithm", "imaml", "--msl-fraction", "0.1"],
            "--msl-fraction 0.1",
            ("--mode implicit", "drop it", "pick another --mode"),
        ),
        (
            ["--algorithm", "imaml", "--adapt", "head"],
            "--mode implicit",
            ("--adapt head", "pass --adapt all", "pick another --mode"),
        ),
        (
            ["--mode", "reptile", "--compile", "true"],
            "--compile true with --mode reptile",
            ("drop --compile", "pick another --mode"),
        ),
        (["--inner-adam-betas", "0.9,1"], "--inner-adam-betas 0.9,1", ("[0, 1)", "e.g. 0.9,0.999")),
        (["--min-meta-lr", "-1"], "--min-meta-lr -1", (">= 0", "e.g. 1e-05")),
        (["--implicit-lam", "0"], "--implicit-lam 0", ("> 0", "e.g. 1")),
    ],
)
def test_settings_reptile_and_implicit_cannot_honour_are_refused(capsys, tmp_path, args, lead, fixes):
    out = tmp_path / "run"
    says(one_error(run_sine(capsys, [*args, "--out", str(out)], code=2)), lead, *fixes)
    assert not out.exists()


def test_implicit_on_a_net_with_meta_only_weights_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        from experiments.harness import fit

        fit.main(omniglot.run, ["--mode", "implicit", "--data", str(omniglot_root()), "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert "the strided net's batch-norm offsets are learned by the outer loop only; pass --network maxpool" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("algorithm", ["reptile", "imaml"])
def test_the_reptile_and_imaml_recipes_run_end_to_end_on_sine(capsys, tmp_path, algorithm):
    out = tmp_path / "run"
    run_sine(capsys, ["--algorithm", algorithm, "--iterations", "3", "--steps", "2", "--out", str(out)])
    results = (out / "results.json").read_text()
    assert f'"algorithm": "{algorithm}"' in results


def test_reptile_adapt_head_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    line = one_error(run_sine(capsys, ["--algorithm", "reptile", "--adapt", "head", "--out", str(out)], code=2))
    says(line, "--mode reptile", "--adapt head", "pass --adapt all", "pick another --mode")
    assert not out.exists()


@pytest.mark.parametrize("per_step_bn", [False, True], ids=["offsets", "per-step-bn"])
def test_reptile_on_omniglot_trains_every_batch_norm_weight(per_step_bn):
    """supervised-reptile adapts and interpolates every trainable variable: the strided net's batch norms too."""
    per_step = ["--per-step-bn", "true"] if per_step_bn else []
    argv = ["--algorithm", "reptile", "--filters", "4", "--steps", "2", *per_step]
    cfg = parsed("omniglot", omniglot.OmniglotConfig, argv)
    model = omniglot.make_model(cfg)
    assert not model.meta_only
    net = model.module.double()
    norms = {k for k in meta_only(net)}
    assert norms  # the strided net's offsets, or the per-step weights and biases
    learner = maml.MetaLearner(
        net,
        model.loss,
        cfg.inner_lr,
        cfg.steps,
        mode="reptile",
        inner_optimizer="adam",
        inner_optimizer_options={"betas": cfg.inner_adam_betas},
    )
    assert norms <= set(learner.adapted)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.arange(5).expand(2, 5).contiguous()
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    learner.meta_loss(maml.TaskBatch(x, y, x, y)).backward()
    optimizer.step()
    moved = {k for k, v in net.named_parameters() if not torch.equal(v, before[k])}
    assert norms <= moved, sorted(norms - moved)
