"""What the N-way K-shot image scripts (experiments.omniglot and .images) share: their training tasks and final test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import maml
import tasks
from experiments.harness import fit, report
from experiments.harness.folder import BEST_FILE
from experiments.harness.report import mean_ci95
from experiments.nets import accuracy

__all__ = ["train_tasks", "final_test"]

PANELS = [
    ("meta-loss", "cross-entropy", "linear", [("train/meta_loss", "train meta-loss")]),
    (
        "accuracy",
        "accuracy",
        "linear",
        [("train/accuracy", "train query accuracy"), ("val/accuracy", "validation accuracy")],
    ),
]


@torch.no_grad()
def evaluate(
    run: Callable[..., maml.MetaOutput], sampler: tasks.FewShotSampler, cfg: Any, device: torch.device
) -> dict[str, Any]:
    """Test accuracy on ``eval_tasks`` tasks (the same at each number of steps) with 95 % CIs (``run``: fitted.run)."""
    g = torch.Generator().manual_seed(cfg.seed + 20_000)
    # A chunk is drawn, evaluated at every number of steps and let go before the next is drawn: the
    # same tasks as drawing all first, with one chunk's images in memory (--eval-chunk bounds it).
    per_steps: dict[int, list[torch.Tensor]] = {steps: [] for steps in cfg.eval_steps}
    for i in range(0, cfg.eval_tasks, cfg.eval_chunk):
        batch = sampler.sample(min(cfg.eval_chunk, cfg.eval_tasks - i), g, device=device)
        for steps in per_steps:
            per_steps[steps].append(accuracy(run(batch, steps=steps).query_out, batch.query_y))
        del batch
    results = {}
    for steps in per_steps:
        acc = torch.cat(per_steps[steps])
        mean, ci = mean_ci95(acc)
        results[f"{steps}step"] = {"accuracy": mean, "ci95": ci, "steps": steps, "tasks": acc.numel()}
    return results


def train_tasks(cfg: Any, data: Any, device: torch.device) -> fit.Tasks:
    """Training tasks of the train split; ``val_tasks`` fixed tasks of the validation split, if any."""
    _, (train, val, _) = data
    g = torch.Generator().manual_seed(cfg.seed + 10_000)
    val_batch = None if val is None else val.sample(cfg.val_tasks, g, device=device)

    def val_metrics(out: maml.MetaOutput, batch: maml.TaskBatch) -> dict[str, float]:
        acc, ci = mean_ci95(accuracy(out.query_out, batch.query_y))
        return {"val/accuracy": acc, "val/accuracy_ci95": ci}

    return fit.Tasks(
        sample=lambda g: train.sample(cfg.meta_batch, g, device=device),
        metrics=lambda out, batch: {"train/accuracy": float(accuracy(out.query_out, batch.query_y).mean())},
        val_batch=val_batch,
        val_metrics=val_metrics,
        select=("val/accuracy", "max"),
    )


def final_test(fitted: fit.Fitted, data: dict[str, Any], held_out: str, untested: str = "") -> fit.Results:
    """The test accuracy of the last and of the best-validation parameters on the same tasks, and the plots.

    ``data``: results.json's ``data`` entry; ``held_out``: what the test tasks are drawn from, for the summary;
    ``untested``: why there is no test split, where the script allows none.
    """
    cfg, opts, learner, trainer = fitted.cfg, fitted.opts, fitted.learner, fitted.trainer
    test_tasks = fitted.data[1][2]
    results = evaluate(fitted.run, test_tasks, cfg, opts.device) if test_tasks is not None else {}
    report.learning_curves(opts.out, trainer.history, PANELS)
    if test_tasks is not None:
        task_grid(opts.out, learner, test_tasks, cfg, opts.device)
    # Model selection: the best-validation parameters on the same test tasks (the last's results when they are the last).
    best_results = results
    if test_tasks is not None and trainer.best and trainer.best["iteration"] != trainer.iterations:
        # map_location: a run trained on a GPU may be tested, resumed, on a machine without one
        best = torch.load(opts.out / BEST_FILE, map_location=opts.device, weights_only=True)
        learner.load_state_dict(best["learner"])
        best_results = evaluate(fitted.run, test_tasks, cfg, opts.device)
    data["batching"] = learner.resolved_batching
    if test_tasks is None:
        return fit.Results(
            results,
            "accuracy",
            f"no final test: {untested} (results.json has test: {{}}); the model is in {opts.out / 'checkpoint.pt'}.",
            {"data": data, "test_best": best_results, "test_skipped": untested},
        )
    best_at = trainer.best.get("iteration", trainer.iterations)
    lines = [
        f"{cfg.ways}-way {cfg.shots}-shot test accuracy on {cfg.eval_tasks} tasks of {held_out} "
        f"(last: iteration {trainer.iterations}; best validation: iteration {best_at}):"
    ]
    for key, r in results.items():
        b = best_results[key]
        lines.append(
            f"  {r['steps']} steps: last {100 * r['accuracy']:.2f} % +- {100 * r['ci95']:.2f} %, "
            f"best {100 * b['accuracy']:.2f} % +- {100 * b['ci95']:.2f} %"
        )
    return fit.Results(results, "accuracy", "\n".join(lines), {"data": data, "test_best": best_results})


def task_grid(
    out: Path, learner: maml.MetaLearner, sampler: tasks.FewShotSampler, cfg: Any, device: torch.device
) -> None:
    """``task_grid.png``: one test task's support and query images, with the predictions after the most eval steps."""
    plt = report.pyplot()
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
    report.save_figure(fig, out / "task_grid.png")
