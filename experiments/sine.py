"""Few-shot sine regression with MAML, the protocol of Finn et al. (2017) by default.

    python -m experiments.sine                        # 70,000 meta-iterations, then the evaluation
    python -m experiments.sine --iterations 2000 --inner-lr 0.02 --out runs/try
    python -m experiments.sine --help
    torchrun --standalone --nproc-per-node 5 -m experiments.sine    # 5 processes adapt 5 of the 25 tasks each

Meta-trains a 1-40-40-1 ReLU MLP on 10-shot tasks (meta-batch 25, inner lr 0.001, one inner step,
Adam at 0.001), then evaluates on 600 fresh tasks at 1, 5 and 10 inner steps for K = 5, 10, 20.
"""

from __future__ import annotations

from experiments.harness.lifecycle import Lifecycle, catch_start_up_stops

if __name__ == "__main__":  # run as a script: a Ctrl-C or SIGTERM while torch imports (seconds) is one line
    catch_start_up_stops()

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import maml
import tasks
from experiments.harness import fit, report
from experiments.harness.config import ExperimentConfig, check_config
from experiments.harness.failures import FLOAT_BYTES, Need
from experiments.harness.report import mean_ci95

__all__ = ["SineConfig", "validate_config", "build_model", "run"]

# The learning curves' panels (experiments.harness.report.learning_curves): the losses, on a log scale.
PANELS = [
    ("learning curves", "MSE", "log", [("train/meta_loss", "train meta-loss"), ("val/mse", "validation MSE")]),
    (
        "inner loss",
        "MSE",
        "log",
        [("train/support_loss_before", "support, before"), ("train/support_loss_after", "support, after")],
    ),
]


@dataclasses.dataclass(frozen=True)
class SineConfig(ExperimentConfig):
    """The hyperparameters (each a flag and a --config key): the shared ones, then the model's and the evaluation's."""

    # What the recipes set differently on sine (experiments.harness.recipes; their papers' sine values).
    RECIPES: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "mamlpp": {"rate_meta_lr": 1e-4},
        "reptile": {"inner_lr": 0.02, "meta_batch": 1, "meta_lr": 0.1, "iterations": 30_000},
        "imaml": {"steps": 10},
    }

    hidden: int = 40
    """width of the two hidden layers"""
    init: Literal["paper", "torch"] = "paper"
    """paper (weights ~ truncated normal, std 0.01; zero biases, as in Finn et al.'s code) or torch"""
    eval_shots: tuple[int, ...] = (5, 10, 20)
    """K values of the final evaluation"""
    eval_query: int = 100
    """query points per test task"""


def validate_config(cfg: SineConfig) -> None:
    """Raises ValueError naming the key for an invalid value."""
    check_config(cfg, positive=("hidden", "eval_query", "eval_shots"))


def build_model(hidden: int, init: str = "paper") -> nn.Module:
    """The paper's regressor, 1 -> hidden -> hidden -> 1 with ReLU, initialised as ``--init`` says."""
    model = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    if init == "paper":
        for layer in model[::2]:
            nn.init.trunc_normal_(layer.weight, std=0.01, a=-0.02, b=0.02)
            nn.init.zeros_(layer.bias)
    return model


@torch.no_grad()
def evaluate(learner: maml.MetaLearner, cfg: SineConfig, device: torch.device, seed: int) -> dict[str, Any]:
    """Test MSE on ``eval_tasks`` fresh tasks for each K in eval_shots and steps in eval_steps, with 95 % CIs."""
    sine = tasks.Sine()
    results: dict[str, Any] = {}
    for shots in cfg.eval_shots:
        # The same tasks and points for every number of steps: the columns are comparable.
        g = torch.Generator().manual_seed(seed + shots)
        batch = sine.sample(cfg.eval_tasks, shots=shots, query=cfg.eval_query, generator=g).to(device)
        for steps in cfg.eval_steps:
            losses = learner.run(batch, steps=steps).query_losses
            mse, ci = mean_ci95(losses)
            results[f"{shots}shot_{steps}step"] = {
                "mse": mse,
                "ci95": ci,
                "median": float(losses.median()),
                "diverged_tasks": int((~losses.isfinite()).sum()),
                "shots": shots,
                "steps": steps,
            }
    return results


def make_model(cfg: SineConfig) -> fit.Model:
    return fit.Model(build_model(cfg.hidden, cfg.init), F.mse_loss)


def train_tasks(cfg: SineConfig, data: None, device: torch.device) -> fit.Tasks:
    """Fresh tasks every meta-batch, and ``val_tasks`` fixed validation tasks (the training K and steps)."""
    sine = tasks.Sine()
    val_batch = sine.sample(
        cfg.val_tasks, shots=cfg.shots, query=cfg.query, generator=torch.Generator().manual_seed(cfg.seed + 10_000)
    ).to(device)

    def val_metrics(out: maml.MetaOutput, batch: maml.TaskBatch) -> dict[str, float]:
        mse, ci = mean_ci95(out.query_losses)
        return {"val/mse": mse, "val/mse_ci95": ci}

    return fit.Tasks(
        sample=lambda g: sine.sample(cfg.meta_batch, shots=cfg.shots, query=cfg.query, generator=g),
        metrics=lambda out, batch: {"train/mse": float(out.query_losses.mean())},
        val_batch=val_batch,
        val_metrics=val_metrics,
    )


def final_test(fitted: fit.Fitted) -> fit.Results:
    """The evaluation on fresh tasks, the plots, and the table."""
    cfg, opts, learner = fitted.cfg, fitted.opts, fitted.learner
    # A task whose inner loop diverges at test time (more steps than in training) is reported, not fatal.
    learner.check_finite = False
    results = evaluate(learner, cfg, opts.device, seed=cfg.seed + 20_000)
    report.learning_curves(opts.out, fitted.trainer.history, PANELS)
    sine_fit(opts.out, fitted.model, learner, opts.device)
    # What "auto" chose, as a resume keeps it (the learner's state_dict): a rerun reads which path this one took.
    return fit.Results(results, "mse", _table(results, cfg), {"batching": learner.resolved_batching})


def sine_fit(out: Path, model: nn.Module, learner: maml.MetaLearner, device: torch.device) -> None:
    """``sine_fit.png``: the true curve, 5 support points, and the prediction before and after 1 and 10 steps."""
    plt = report.pyplot()
    g = torch.Generator().manual_seed(12345)
    batch, truth = tasks.Sine().sample(1, shots=5, query=1, generator=g, return_params=True)
    batch = batch.to(device)
    xs = torch.linspace(-5, 5, 200).view(1, -1, 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs[0, :, 0], truth.true_y(xs)[0, :, 0], "k-", lw=2, label="true function")
    ax.plot(batch.support_x[0, :, 0].cpu(), batch.support_y[0, :, 0].cpu(), "r^", ms=9, label="5 support points")
    for steps, style in ((0, ":"), (1, "--"), (10, "-")):
        with torch.no_grad():
            fast = learner.adapt(batch.support_x[0], batch.support_y[0], steps=steps)
            pred = functional_call(model, fast, (xs[0].to(device),))
        ax.plot(xs[0, :, 0], pred[:, 0].cpu(), style, label=f"MAML, {steps} step{'s' if steps != 1 else ''}")
    ax.set(xlabel="x", ylabel="y", title="one test task, K = 5")
    ax.legend(fontsize=8)
    report.save_figure(fig, out / "sine_fit.png")


def memory_needs(cfg: SineConfig, params: int | None) -> list[Need]:
    """Lower bounds on what a sine run holds at one moment (:func:`experiments.harness.failures.check_fits`)."""
    task = (cfg.shots + cfg.query) * 2 * FLOAT_BYTES  # a training task's (x, y) pairs
    return [
        Need(
            "the network's weights, meta-gradient, and one task's support gradient and fast weights",
            "--hidden",
            None if params is None else 4 * params,
        ),
        Need(
            "the training meta-batch's points and one task's first hidden layer",
            "--meta-batch, --shots, --query, --hidden",
            cfg.meta_batch * task + max(cfg.shots, cfg.query) * cfg.hidden * FLOAT_BYTES,
        ),
        Need("the validation tasks' points", "--val-tasks, --shots, --query", cfg.val_tasks * task),
        Need(
            "the test tasks' points",
            "--eval-tasks, --eval-shots, --eval-query",
            cfg.eval_tasks * (max(cfg.eval_shots) + cfg.eval_query) * 2 * FLOAT_BYTES,
        ),
    ]


# One thread: the MLP's steps are too small to gain from more, and each parallel region costs
# more than it saves (compiled step 4.6 ms with 2 threads, 2.7 ms with 1, the same results).
EXPERIMENT = fit.Experiment(
    "sine",
    SineConfig,
    __doc__.split("\n\n")[0],
    validate_config,
    make_model,
    train_tasks,
    final_test,
    threads=1,
    needs=memory_needs,
)


def run(argv: Sequence[str] | None = None, life: Lifecycle | None = None) -> None:
    """The script, with the command line ``argv`` (default: ``sys.argv[1:]``)."""
    fit.fit(EXPERIMENT, argv, life)


def _table(results: dict[str, Any], cfg: SineConfig) -> str:
    """The test MSE as a K x steps table, mean +- 95 % CI half-width."""
    # Fixed-width cells (_number is at most 9 characters), so a diverged 3.41e+06 keeps the columns aligned.
    head = "".join(f"{f'{s} step' + ('s' if s != 1 else ''):>23}" for s in cfg.eval_steps)
    lines = [f"test MSE on {cfg.eval_tasks} tasks (mean +- 95% CI)", f"{'K':<4}{head}"]
    for k in cfg.eval_shots:
        cells = (results[f"{k}shot_{s}step"] for s in cfg.eval_steps)
        lines.append(f"{k:<4}" + "".join(f"{_number(c['mse']):>10} +- {_number(c['ci95']):>9}" for c in cells))
    diverged = [
        f"K={r['shots']} {r['steps']} steps: {r['diverged_tasks']}" for r in results.values() if r["diverged_tasks"]
    ]
    if diverged:
        lines.append("tasks whose inner loop diverged (infinite or NaN loss): " + ", ".join(diverged))
    return "\n".join(lines)


def _number(x: float) -> str:
    """``x >= 0`` in at most 9 characters: 3 decimals from 0.001 to 9999.999, else 3 significant digits (3.41e+06)."""
    if not math.isfinite(x):
        return str(x)  # inf, -inf, nan
    return f"{x:.3f}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.3g}"


if __name__ == "__main__":
    fit.main(run)
