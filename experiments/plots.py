"""The PNG plots the scripts write: the learning curves, one sine task's fit, one few-shot task's images."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import maml
import tasks
from experiments.files import atomic_write

__all__ = ["learning_curves", "sine_fit", "task_grid"]

# A panel of the learning curves: its title, y label and scale, and the (metric, label) lines it draws; a
# validation metric ("val/...") is drawn at the iterations that validated, as dots.
Panel = tuple[str, str, str, Sequence[tuple[str, str]]]


def _pyplot() -> Any:
    import matplotlib  # when a plot is drawn; Agg: files only, no display needed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=120))
    _pyplot().close(fig)


def learning_curves(out: Path, history: list[dict[str, float]], panels: Sequence[Panel]) -> None:
    """``learning_curves.png``: one panel per entry of ``panels``, over the logged rows ``history``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.5))
    its = [r["iteration"] for r in history]
    for ax, (title, ylabel, yscale, lines) in zip(axes, panels):
        for key, label in lines:
            if key.startswith("val/"):
                val = [(r["iteration"], r[key]) for r in history if key in r]
                if val:
                    ax.plot(*zip(*val), "o-", label=label)
            else:
                ax.plot(its, [r.get(key, float("nan")) for r in history], label=label)
        ax.set(xlabel="meta-iteration", ylabel=ylabel, yscale=yscale, title=title)
        ax.legend()
    _save(fig, out / "learning_curves.png")


def sine_fit(out: Path, model: nn.Module, learner: maml.MetaLearner, device: torch.device) -> None:
    """``sine_fit.png``: the true curve, 5 support points, and the prediction before and after 1 and 10 steps."""
    plt = _pyplot()
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
    _save(fig, out / "sine_fit.png")


def task_grid(
    out: Path, learner: maml.MetaLearner, sampler: tasks.FewShotSampler, cfg: Any, device: torch.device
) -> None:
    """``task_grid.png``: one test task's support and query images, with the predictions after the most eval steps."""
    plt = _pyplot()
    batch = sampler.sample(1, torch.Generator().manual_seed(4321), device=device)
    steps = max(cfg.eval_steps)
    with torch.no_grad():
        pred = learner.run(batch, steps=steps).query_out[0].argmax(-1).cpu()
    # (n, C, H, W) as imshow takes it: (n, H, W) greyscale, (n, H, W, 3) colour
    support_x, query_x = (x[0].cpu().permute(0, 2, 3, 1).squeeze(-1) for x in (batch.support_x, batch.query_x))
    support_y, query_y = batch.support_y[0].cpu(), batch.query_y[0].cpu()
    cols = max(cfg.shots, cfg.query) + 1
    fig, axes = plt.subplots(cfg.ways, cols, figsize=(cols * 0.8, cfg.ways * 0.9))
    axes = axes.reshape(cfg.ways, cols)
    for ax in axes.flat:
        ax.axis("off")
    for c in range(cfg.ways):
        for j, i in enumerate((support_y == c).nonzero()[:, 0].tolist()):
            axes[c, j].imshow(support_x[i], cmap="gray_r")
            axes[c, j].set_title(f"support {c}", fontsize=5)
        for j, i in enumerate((query_y == c).nonzero()[:, 0].tolist()[: cols - cfg.shots]):
            axes[c, cfg.shots + j].imshow(query_x[i], cmap="gray_r")
            axes[c, cfg.shots + j].set_title(
                f"pred {int(pred[i])}", fontsize=5, color="green" if pred[i] == c else "red"
            )
    fig.suptitle(f"one test task after {steps} steps: support (left), query with predictions", fontsize=8)
    _save(fig, out / "task_grid.png")
