"""N-way K-shot Omniglot with MAML and the paper's conv net (Finn et al., 2017).

    python -m experiments.omniglot --data ../shared/data/omniglot
    python -m experiments.omniglot --data ~/data/omniglot --ways 20     # 20-way: 5 steps, lr 0.1, meta-batch 16
    python -m experiments.omniglot --help
    torchrun --standalone --nproc-per-node 4 -m experiments.omniglot --data ~/data/omniglot --device cuda  # 4 GPUs

Reads every Omniglot archive or folder under --data (images_background, images_evaluation or
the minimal splits), splits the characters into train/validation/test (by alphabet by
default, so test characters come from held-out alphabets), meta-trains on rotated training
characters, and reports test accuracy on 600 tasks with 95 % confidence intervals.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
import tyro
from torch import Tensor, nn

import maml
import tasks
from experiments import common, recipes


# The paper's settings by number of ways: (inner steps, inner lr, meta-batch).
PAPER = {5: (1, 0.4, 32), 20: (5, 0.1, 16)}


@dataclasses.dataclass(frozen=True)
class OmniglotConfig(common.ExperimentConfig):
    """The hyperparameters (each a flag and a --config key): the shared ones, then the data's, the model's and the
    evaluation's."""

    iterations: int = 60_000
    meta_batch: int | None = None
    """tasks per meta-batch (null: 32 for 5-way, 16 for 20-way)"""
    shots: int = 1
    """support images per class (K)"""
    query: int = 15
    """query images per class"""
    inner_lr: float | None = None
    """inner learning rate (null: 0.4 for 5-way, 0.1 for 20-way)"""
    steps: int | None = None
    """inner steps in training (null: 1 for 5-way, 5 for 20-way)"""
    compile: bool = False
    """compile the meta-step with torch.compile (second or first order; exact; a one-off compile of about a minute on a CPU, then steps a few percent faster)"""
    log_every: int = 50
    val_every: int = 500
    checkpoint_every: int = 200
    eval_tasks: int = 600
    """test tasks in the final evaluation"""
    eval_steps: tuple[int, ...] = (3, 5)
    data: Annotated[str | None, tyro.conf.arg(help_behavior_hint="(default: $OMNIGLOT_DIR)")] = None
    """Omniglot archives or folders"""
    ways: int = 5
    """classes per task (N)"""
    split_by: Literal[tasks.SPLIT_BY] = "alphabet"  # type: ignore[valid-type]
    """the unit the characters are split by into train, validation and test"""
    split_fractions: tuple[float, ...] = (0.6, 0.15, 0.25)
    """train, validation, test shares (>= 0, summing to 1); a 0 validation share trains without validation, a 0 test share skips the final test (results.json then says why its test is empty)"""
    split_seed: int = 0
    """fixes the character split"""
    rotations: bool = True
    """rotated training characters as extra classes"""
    filters: int = 64
    """filters in each of the 4 conv blocks"""
    eval_chunk: int = 50
    """test tasks per evaluation pass (bounds memory)"""

    def resolved(self) -> OmniglotConfig:
        """The config with the paper's per-ways defaults and the data path filled in."""
        steps, lr, batch = PAPER.get(self.ways, PAPER[5] if self.ways < 20 else PAPER[20])
        return dataclasses.replace(
            self,
            data=self.data or os.environ.get("OMNIGLOT_DIR"),
            steps=steps if self.steps is None else self.steps,
            inner_lr=lr if self.inner_lr is None else self.inner_lr,
            meta_batch=batch if self.meta_batch is None else self.meta_batch,
        )


def validate_config(cfg: OmniglotConfig) -> None:
    """Raises ValueError naming the key for an invalid value."""
    common.check_config(cfg, positive=("ways", "filters", "eval_chunk"))
    fractions = ",".join(f"{f:g}" for f in cfg.split_fractions)
    if len(cfg.split_fractions) != 3 or not all(math.isfinite(f) and f >= 0 for f in cfg.split_fractions):
        raise ValueError(f"--split-fractions {fractions} must be three shares >= 0 (train, validation, test) "
                         f"that sum to 1, e.g. 0.6,0.15,0.25.")  # fmt: skip
    if abs(sum(cfg.split_fractions) - 1) > 1e-6:
        raise ValueError(f"--split-fractions {fractions} sums to {sum(cfg.split_fractions):g}; the three shares "
                         f"(train, validation, test) must sum to 1, e.g. 0.6,0.15,0.25.")  # fmt: skip
    if cfg.split_fractions[0] == 0:
        raise ValueError(f"--split-fractions {fractions} gives the train split no characters; meta-training needs "
                         f"a train share > 0, e.g. 0.6,0.15,0.25.")  # fmt: skip


def build_model(ways: int, filters: int = 64) -> nn.Module:
    """The MAML Omniglot net: 4 x (3x3 conv, BatchNorm, ReLU, 2x2 max-pool), 28 -> 14 -> 7 -> 3 -> 1, then linear."""
    blocks: list[nn.Module] = []
    for i in range(4):
        blocks += [
            nn.Conv2d(1 if i == 0 else filters, filters, 3, padding=1),
            nn.BatchNorm2d(filters, track_running_stats=False),  # per-task batch statistics, as in MAML
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(filters, ways))


def accuracy(logits: Tensor, y: Tensor) -> Tensor:
    """``(T, n, ways)`` logits, ``(T, n)`` labels -> ``(T,)`` per-task accuracy."""
    return (logits.argmax(-1) == y).float().mean(-1)


@torch.no_grad()
def evaluate(learner: maml.MetaLearner, sampler: tasks.FewShotSampler, cfg: OmniglotConfig,
             device: torch.device, seed: int) -> dict[str, Any]:  # fmt: skip
    """Test accuracy on ``eval_tasks`` tasks for each number of steps, with 95 % CIs (same tasks for every column)."""
    g = torch.Generator().manual_seed(seed)
    chunks = [sampler.sample(min(cfg.eval_chunk, cfg.eval_tasks - i), g, device=device)
              for i in range(0, cfg.eval_tasks, cfg.eval_chunk)]  # fmt: skip
    results = {}
    for steps in cfg.eval_steps:
        acc = torch.cat([accuracy(learner.run(b, steps=steps).query_out, b.query_y) for b in chunks])
        mean, ci = common.mean_ci95(acc)
        results[f"{steps}step"] = {"accuracy": mean, "ci95": ci, "steps": steps, "tasks": acc.numel()}
    return results


def plot(out: Path, learner: maml.MetaLearner, sampler: tasks.FewShotSampler | None, cfg: OmniglotConfig,
         history: list[dict[str, float]], device: torch.device) -> None:  # fmt: skip
    """learning_curves.png and task_grid.png (one test task's support and query images, predictions; none without a test split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    its = [r["iteration"] for r in history]
    axes[0].plot(its, [r["train/meta_loss"] for r in history], label="train meta-loss")
    axes[0].set(xlabel="meta-iteration", ylabel="cross-entropy", title="meta-loss")
    axes[1].plot(its, [r["train/accuracy"] for r in history], label="train query accuracy")
    val = [(r["iteration"], r["val/accuracy"]) for r in history if "val/accuracy" in r]
    if val:
        axes[1].plot(*zip(*val), "o-", label="validation accuracy")
    axes[1].set(xlabel="meta-iteration", ylabel="accuracy", title="accuracy")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    common.atomic_write(out / "learning_curves.png", lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)

    if sampler is None:
        return
    batch = sampler.sample(1, torch.Generator().manual_seed(4321), device=device)
    steps = max(cfg.eval_steps)
    with torch.no_grad():
        pred = learner.run(batch, steps=steps).query_out[0].argmax(-1).cpu()
    support_x, support_y = batch.support_x[0, :, 0].cpu(), batch.support_y[0].cpu()
    query_x, query_y = batch.query_x[0, :, 0].cpu(), batch.query_y[0].cpu()
    cols = max(cfg.shots, cfg.query) + 1
    fig, axes = plt.subplots(cfg.ways, cols, figsize=(cols * 0.8, cfg.ways * 0.9))
    axes = axes.reshape(cfg.ways, cols)
    for ax in axes.flat:
        ax.axis("off")
    for c in range(cfg.ways):
        for j, i in enumerate((support_y == c).nonzero()[:, 0].tolist()):
            axes[c, j].imshow(support_x[i], cmap="gray_r")
            axes[c, j].set_title(f"support {c}", fontsize=5)
        for j, i in enumerate((query_y == c).nonzero()[:, 0].tolist()[: cols - 1]):
            ax = axes[c, cfg.shots + j] if cfg.shots + j < cols else None
            if ax is None:
                break
            ok = bool(pred[i] == c)
            ax.imshow(query_x[i], cmap="gray_r")
            ax.set_title(f"pred {int(pred[i])}", fontsize=5, color="green" if ok else "red")
    fig.suptitle(f"one test task after {steps} steps: support (left), query with predictions", fontsize=8)
    fig.tight_layout()
    common.atomic_write(out / "task_grid.png", lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


def run(argv: Sequence[str] | None = None) -> None:
    cfg, opts = common.parse_args("omniglot", OmniglotConfig, argv, __doc__.split("\n\n")[0], validate_config)
    cfg = cfg.resolved()
    if cfg.data is None:
        raise common.UsageError("no data: pass --data PATH (Omniglot archives or folders) or set $OMNIGLOT_DIR.")
    assert cfg.meta_batch is not None  # resolved() fills it in
    common.check_shards(cfg.meta_batch, opts)
    resumed = common.prepare_out(opts, cfg)
    try:
        omni = tasks.Omniglot(cfg.data, rotations=cfg.rotations)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise common.UsageError(f"--data {cfg.data}: {e}") from None
    splits, (train, val, test) = make_splits(omni, cfg)
    if opts.main:
        common.take_out(opts, cfg)  # clears an --overwrite'n run's files, then writes config.yaml
        for name, sampler in (("validation", val), ("test", test)):
            if sampler is None:
                skipped = "trains without validation" if name == "validation" else "skips the final test"
                print(f"note: --split-fractions {_shares(cfg)} gives the {name} split no characters; the run {skipped}.",
                      file=sys.stderr)  # fmt: skip

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.ways, cfg.filters).to(opts.device)
    learner = maml.MetaLearner(model, F.cross_entropy, inner_lr=cfg.inner_lr, steps=cfg.steps, mode=cfg.mode,
                               batching=cfg.batching, learn_inner_lr=cfg.learn_inner_lr, compile=cfg.compile,
                               adapt=recipes.adapt_set(model, cfg.adapt), inner_optimizer=cfg.inner_optimizer)  # fmt: skip
    optimizer = recipes.meta_optimizer(learner, cfg.meta_lr, cfg.rate_meta_lr)
    watch = common.DivergenceWatch(learner, optimizer, resumed["iteration"] if resumed else 0, cfg.meta_lr, cfg.inner_lr, opts.out)
    if val is not None:
        val_batch = val.sample(cfg.val_tasks, torch.Generator().manual_seed(cfg.seed + 10_000), device=opts.device)

    def validate() -> dict[str, float]:
        if val is None:
            return {}  # --split-fractions gave the validation split no characters
        with torch.no_grad():
            acc, ci = common.mean_ci95(accuracy(learner.run(val_batch).query_out, val_batch.query_y))
        return {"val/accuracy": acc, "val/accuracy_ci95": ci}

    trainer = common.Trainer(
        learner=learner,
        optimizer=optimizer,
        sample=lambda g: train.sample(cfg.meta_batch, g, device=opts.device),
        metrics=lambda out, batch: {"train/accuracy": float(accuracy(out.query_out, batch.query_y).mean())},
        validate=validate,
        iterations=cfg.iterations,
        log_every=cfg.log_every,
        val_every=cfg.val_every,
        checkpoint_every=cfg.checkpoint_every,
        seed=cfg.seed,
        device=opts.device,
        schedule=recipes.Schedule.of(cfg),
    )
    name = f"omniglot-{cfg.ways}way-{cfg.shots}shot"
    wandb_run = common.init_wandb(opts, cfg, name, resumed["wandb_id"] if resumed else None) if opts.main else None
    with watch.guard(wandb_run, opts.main):  # a NaN/Inf: one line naming the loop and the flag, exit code 1
        trainer.run(opts, cfg, resumed, wandb_run)
    if not opts.main:
        return  # rank 0 evaluates and writes the results
    watch.phase = "the final test"
    with watch.guard(wandb_run):
        results = evaluate(learner, test, cfg, opts.device, seed=cfg.seed + 20_000) if test is not None else {}
    plot(opts.out, learner, test, cfg, trainer.history, opts.device)
    data = {"root": str(cfg.data), "characters": [len(p.characters) for p in splits],
            "alphabets": [p.alphabets for p in splits], "batching": learner.resolved_batching}  # fmt: skip
    skipped = {} if test is not None else {"test_skipped": f"--split-fractions {_shares(cfg)} gives the test split no characters"}
    common.finish(opts, cfg, wandb_run, trainer, results, "accuracy", data=data, **skipped)
    if test is None:
        print(f"no final test: --split-fractions {_shares(cfg)} gives the test split no characters "
              f"(results.json has test: {{}}); the model is in {opts.out / 'checkpoint.pt'}.")  # fmt: skip
        return
    print(f"{cfg.ways}-way {cfg.shots}-shot test accuracy on {cfg.eval_tasks} tasks of held-out characters:")
    for key, r in results.items():
        print(f"  {r['steps']} steps: {100 * r['accuracy']:.2f} % +- {100 * r['ci95']:.2f} %")


SPLITS = ("train", "validation", "test")


def _shares(cfg: OmniglotConfig) -> str:
    """--split-fractions as it is written on the command line."""
    return ",".join(f"{f:g}" for f in cfg.split_fractions)


def make_splits(omni: tasks.Omniglot, cfg: OmniglotConfig) -> tuple[tasks.OmniglotSplits, list[tasks.FewShotSampler | None]]:
    """The train, validation and test parts and their task samplers (None for a part whose share is 0).

    Raises:
        UsageError: naming the flag, the split and the fix, when a share > 0 gets no character or a
            split cannot make the tasks that --ways, --shots and --query ask for.
    """
    by, shares = cfg.split_by, _shares(cfg)
    try:
        splits = omni.split(by, cfg.split_fractions, seed=cfg.split_seed)
    except ValueError as e:  # too few alphabets or archives for every share > 0
        reason = str(e).split("): ", 1)[-1]  # without the API call, which names no flag
        raise common.UsageError(f"--split-by {by} --split-fractions {shares}: {reason}") from None
    samplers: list[tasks.FewShotSampler | None] = []
    for name, part, share in zip(SPLITS, splits, cfg.split_fractions, strict=True):
        if share == 0:
            samplers.append(None)
            continue
        if part.num_classes < cfg.ways:
            alphabets = f"{len(part.alphabets)} alphabet{'s' if len(part.alphabets) != 1 else ''}"
            classes = f"{len(part.characters)} characters of {alphabets}" + (", 4 rotations each" if part.rotations else "")
            finer = " or --split-by character" if by != "character" else ""
            raise common.UsageError(
                f"--ways {cfg.ways}: the {name} split holds only {part.num_classes} classes ({classes}; --split-by {by} "
                f"--split-fractions {shares}); lower --ways to at most {part.num_classes}, or give the {name} split "
                f"more characters: a larger share in --split-fractions{finer}."
            )
        try:
            samplers.append(tasks.FewShotSampler(part.images, part.labels, cfg.ways, cfg.shots, cfg.query))
        except ValueError as e:  # fewer images per class than shots + query
            raise common.UsageError(f"--shots {cfg.shots} --query {cfg.query}, the {name} split: {e}") from None
    return splits, samplers


if __name__ == "__main__":
    common.main(run)
