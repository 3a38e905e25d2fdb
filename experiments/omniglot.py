"""N-way K-shot Omniglot with MAML, as Finn et al.'s released code runs it (cbfinn/maml), by default.

    python -m experiments.omniglot --data ../shared/data/omniglot
    python -m experiments.omniglot --data ~/data/omniglot --ways 20     # 20-way: 5 steps, lr 0.1, meta-batch 16
    python -m experiments.omniglot --network maxpool --loss mean --query 15   # learn2learn's and MAML++'s setting
    python -m experiments.omniglot --engine learn2learn                 # the peer: learn2learn's MAML trains
    python -m experiments.omniglot --help
    torchrun --standalone --nproc-per-node 4 -m experiments.omniglot --data ~/data/omniglot --device cuda  # 4 GPUs

Reads every Omniglot archive or folder under --data (images_background, images_evaluation or
the minimal splits), splits the characters into train/validation/test (by alphabet by
default, so test characters come from held-out alphabets), meta-trains the reference's strided
conv net with its loss, batch norm, initialisation and task sizes on the characters in 4
rotations, keeps the best-validation parameters beside the last, and reports the test
accuracy of both on 600 tasks with 95 % confidence intervals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
import tyro
from torch import Tensor, nn

import maml
import tasks
from experiments import fit, peers
from experiments.cli import UsageError
from experiments.config import ExperimentConfig, check_config
from experiments.files import atomic_write
from experiments.results import mean_ci95
from experiments.rundir import BEST_FILE

__all__ = ["PAPER", "NETWORKS", "LOSSES", "SPLITS", "OmniglotConfig", "validate_config", "SameConv2d", "BatchNormOffset",
           "MeanPool", "META_ONLY", "build_model", "meta_only", "loss_function", "accuracy", "evaluate", "plot", "Data",
           "resolve", "load", "notes", "make_model", "train_tasks", "final_test", "run", "make_splits"]  # fmt: skip

# The paper's settings by number of ways: (inner steps, inner lr, meta-batch).
PAPER = {5: (1, 0.4, 32), 20: (5, 0.1, 16)}
NETWORKS = ("strided", "maxpool")
LOSSES = ("reference", "mean")
ROTATED = {"all": True, "train": (True, False, False), "none": False}  # --rotations: which of train, val, test


@dataclasses.dataclass(frozen=True)
class OmniglotConfig(ExperimentConfig):
    """The hyperparameters (each a flag and a --config key): the shared ones, then the data's, the model's and the
    evaluation's."""

    iterations: int = 60_000
    meta_batch: int | None = None
    """tasks per meta-batch (null: 32 for 5-way, 16 for 20-way)"""
    shots: int = 1
    """support images per class (K)"""
    query: int | None = None
    """query images per class (null: K, as the reference: 1 at 1-shot)"""
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
    eval_steps: tuple[int, ...] = (1, 3, 5, 10)
    """inner steps of the final evaluation (the reference tests with up to 10)"""
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
    rotations: Literal["all", "train", "none"] = "all"
    """which splits hold every character in 4 rotations, each a class: all (the reference rotates validation and test characters too), train or none"""
    network: Literal[NETWORKS] = "strided"  # type: ignore[valid-type]
    """strided: the reference's Omniglot net (stride-2 convs, batch norm with an offset only, spatial mean); maxpool: the net of learn2learn and MAML++"""
    loss: Literal[LOSSES] = "reference"  # type: ignore[valid-type]
    """reference: the reference's summed cross-entropy over K (ways x the mean: its inner lr 0.4 is 2.0 on the mean); mean: the mean cross-entropy"""
    filters: int = 64
    """filters in each of the 4 conv blocks"""
    engine: Literal[peers.ENGINES] = "maml"  # type: ignore[valid-type]
    """what computes the meta-gradient in training: this toolkit, or learn2learn's MAML (the peer row; the evaluation is this toolkit's either way)"""
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
            query=self.shots if self.query is None else self.query,
        )


def validate_config(cfg: OmniglotConfig) -> None:
    """Raises ValueError naming the key for an invalid value."""
    check_config(cfg, positive=("ways", "filters", "eval_chunk"))
    fractions = ",".join(f"{f:g}" for f in cfg.split_fractions)
    if len(cfg.split_fractions) != 3 or not all(math.isfinite(f) and f >= 0 for f in cfg.split_fractions):
        raise ValueError(f"--split-fractions {fractions} must be three shares >= 0 (train, validation, test) "
                         f"that sum to 1, e.g. 0.6,0.15,0.25.")  # fmt: skip
    if abs(sum(cfg.split_fractions) - 1) > 1e-6:
        raise ValueError(f"--split-fractions {fractions} sums to {sum(cfg.split_fractions):g}; the three shares "
                         f"(train, validation, test) must sum to 1, e.g. 0.6,0.15,0.25.")  # fmt: skip
    if cfg.engine == "learn2learn" and (why := peers.unsupported(cfg)):
        raise ValueError(f"{why}.")
    if cfg.split_fractions[0] == 0:
        raise ValueError(f"--split-fractions {fractions} gives the train split no characters; meta-training needs "
                         f"a train share > 0, e.g. 0.6,0.15,0.25.")  # fmt: skip


class SameConv2d(nn.Conv2d):
    """A convolution with TensorFlow's ``'SAME'`` padding: ``ceil(size / stride)`` outputs per side.

    TensorFlow pads ``(out - 1) * stride + kernel - size`` pixels in all and puts the odd one at
    the bottom and right; ``nn.Conv2d(padding=1)`` pads both sides, which moves a stride-2 grid
    by one pixel. The shapes of the reference's Omniglot net: 28 -> 14 -> 7 -> 4 -> 2.
    """

    def forward(self, x: Tensor) -> Tensor:
        pad: list[int] = []
        for size, k, s in reversed(list(zip(x.shape[-2:], self.kernel_size, self.stride))):  # F.pad: last dim first
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pad += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pad))


class BatchNormOffset(nn.Module):
    """``tf.contrib.layers.batch_norm`` as the reference calls it: batch statistics, an offset, no scale.

    Its defaults are ``center=True, scale=False, epsilon=0.001``, and the reference never sets
    ``is_training=False``, so every pass (support, query, test) normalises by its own batch.
    ``offset`` ``(C,)`` is meta-learned; the reference keeps it outside ``weights``, so the inner
    loop does not adapt it (:data:`META_ONLY`).
    """

    def __init__(self, channels: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.offset = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        # The offset added, not passed as batch_norm's bias: its double backward fails for a bias without a
        # weight (PyTorch 2.15: "Expected a proper Tensor but got None"), which adapting the offset needs.
        return F.batch_norm(x, None, None, training=True, eps=self.eps) + self.offset[:, None, None]


class MeanPool(nn.Module):
    """``(n, C, H, W) -> (n, C)``: the mean over the spatial positions (the reference's ``reduce_mean(hidden4, [1, 2])``)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean((-2, -1))


META_ONLY = (BatchNormOffset,)  # layers whose parameters the outer loop learns and the inner loop leaves alone


def build_model(ways: int, filters: int = 64, network: str = "strided") -> nn.Module:
    """The Omniglot conv net of Finn et al.'s reference code (``strided``) or the max-pool variant.

    ``strided`` (``maml.py``'s ``forward_conv`` with ``--max_pool False``, what its Omniglot runs
    use): 4 x [3x3 conv, stride 2, 'SAME' padding; batch norm with an offset and no scale; ReLU],
    28 -> 14 -> 7 -> 4 -> 2, the mean over the 2x2 positions, a linear layer. Initialised as
    ``construct_conv_weights``: convolutions Xavier-uniform, the output layer standard normal,
    biases and offsets 0.

    ``maxpool``: 4 x [3x3 conv, padding 1; batch norm with scale and offset; ReLU; 2x2 max-pool],
    28 -> 14 -> 7 -> 3 -> 1, a linear layer, PyTorch's default initialisation: the net learn2learn
    and MAML++ use (the reference's MiniImagenet net), adapted whole by the inner loop.
    """
    if network not in NETWORKS:
        raise ValueError(f"network {network!r} is not one of {', '.join(NETWORKS)}.")
    blocks: list[nn.Module] = []
    for i in range(4):
        channels = 1 if i == 0 else filters
        if network == "strided":
            conv = SameConv2d(channels, filters, 3, stride=2)
            nn.init.xavier_uniform_(conv.weight)
            nn.init.zeros_(conv.bias)
            blocks += [conv, BatchNormOffset(filters), nn.ReLU()]
        else:
            blocks += [
                nn.Conv2d(channels, filters, 3, padding=1),
                nn.BatchNorm2d(filters, track_running_stats=False),  # per-task batch statistics, as in MAML
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
    head = nn.Linear(filters, ways)
    if network == "strided":
        nn.init.normal_(head.weight)  # tf.random_normal([dim_hidden, dim_output]): std 1
        nn.init.zeros_(head.bias)
        return nn.Sequential(*blocks, MeanPool(), head)
    return nn.Sequential(*blocks, nn.Flatten(), head)


def meta_only(model: nn.Module) -> set[str]:
    """Names of the parameters the inner loop leaves alone (the strided net's batch-norm offsets)."""
    return {f"{m}.{p}" for m, layer in model.named_modules() if isinstance(layer, META_ONLY)
            for p, _ in layer.named_parameters(recurse=False)}  # fmt: skip


def loss_function(loss: str, ways: int) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-task classification loss ``(n, ways)`` logits, ``(n,)`` labels -> ``()``.

    ``"reference"``: the reference's ``xent``, ``softmax_cross_entropy_with_logits / K``, is a
    vector of per-example losses, and ``tf.gradients`` of a vector differentiates its sum: its
    loss is the cross-entropy summed over the task's ``ways * K`` examples over ``K``, i.e.
    ``ways`` times the mean, and its ``update_lr`` 0.4 is a step of 2.0 on the mean (5-way).
    Written as ``ways * mean``, which is that sum for ``K`` images per class, and stays the
    sum of the per-class means with another number of query images. ``"mean"``: ``F.cross_entropy``.
    """
    if loss == "mean":
        return F.cross_entropy
    if loss != "reference":
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}.")
    return functools.partial(_reference_cross_entropy, ways=ways)


def _reference_cross_entropy(logits: Tensor, y: Tensor, ways: int) -> Tensor:
    return ways * F.cross_entropy(logits, y)


def accuracy(logits: Tensor, y: Tensor) -> Tensor:
    """``(T, n, ways)`` logits, ``(T, n)`` labels -> ``(T,)`` per-task accuracy."""
    return (logits.argmax(-1) == y).float().mean(-1)


@torch.no_grad()
def evaluate(run: Callable[..., maml.MetaOutput], sampler: tasks.FewShotSampler, cfg: OmniglotConfig,
             device: torch.device, seed: int) -> dict[str, Any]:  # fmt: skip
    """Test accuracy on ``eval_tasks`` tasks for each number of steps, with 95 % CIs (same tasks for every column).

    ``run``: ``learner.run``, or what calls it (``fit.Fitted.run`` explains a NaN/Inf).
    """
    g = torch.Generator().manual_seed(seed)
    chunks = [sampler.sample(min(cfg.eval_chunk, cfg.eval_tasks - i), g, device=device)
              for i in range(0, cfg.eval_tasks, cfg.eval_chunk)]  # fmt: skip
    results = {}
    for steps in cfg.eval_steps:
        acc = torch.cat([accuracy(run(b, steps=steps).query_out, b.query_y) for b in chunks])
        mean, ci = mean_ci95(acc)
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
    atomic_write(out / "learning_curves.png", lambda p: fig.savefig(p, format="png", dpi=120))
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
    atomic_write(out / "task_grid.png", lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


# What load gives the other hooks: the split characters, and the train, validation and test samplers (None: no characters).
Data = tuple[tasks.OmniglotSplits, list[tasks.FewShotSampler | None]]


def resolve(cfg: OmniglotConfig) -> OmniglotConfig:
    """The config with its per-ways defaults and the data path filled in (:meth:`OmniglotConfig.resolved`)."""
    cfg = cfg.resolved()
    if cfg.data is None:
        raise UsageError("no data: pass --data PATH (Omniglot archives or folders) or set $OMNIGLOT_DIR.")
    return cfg


def load(cfg: OmniglotConfig) -> Data:
    """The characters split into train, validation and test, and their task samplers (:func:`make_splits`)."""
    try:
        omni = tasks.Omniglot(cfg.data, rotations=cfg.rotations != "none")
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise UsageError(f"--data {cfg.data}: {e}") from None
    return make_splits(omni, cfg)


def notes(cfg: OmniglotConfig, data: Data) -> list[str]:
    """A line for each split that --split-fractions leaves without characters."""
    _, (_, val, test) = data
    return [f"note: --split-fractions {_shares(cfg)} gives the {name} split no characters; the run "
            f"{'trains without validation' if name == 'validation' else 'skips the final test'}."
            for name, sampler in (("validation", val), ("test", test)) if sampler is None]  # fmt: skip


def make_model(cfg: OmniglotConfig) -> fit.Model:
    net = build_model(cfg.ways, cfg.filters, cfg.network)
    return fit.Model(net, loss_function(cfg.loss, cfg.ways), meta_only(net), engine=cfg.engine)


def train_tasks(cfg: OmniglotConfig, data: Data, device: torch.device) -> fit.Tasks:
    """Training tasks of the train characters; ``val_tasks`` fixed tasks of the validation characters, if any."""
    _, (train, val, _) = data
    val_batch = None if val is None else val.sample(cfg.val_tasks, torch.Generator().manual_seed(cfg.seed + 10_000), device=device)

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


def final_test(fitted: fit.Fitted) -> fit.Results:
    """The test accuracy of the last and of the best-validation parameters on the same tasks, and the plots."""
    cfg, opts, learner, trainer = fitted.cfg, fitted.opts, fitted.learner, fitted.trainer
    splits, (_, _, test_tasks) = fitted.data
    results = evaluate(fitted.run, test_tasks, cfg, opts.device, seed=cfg.seed + 20_000) if test_tasks is not None else {}
    plot(opts.out, learner, test_tasks, cfg, trainer.history, opts.device)
    # Model selection: the best-validation parameters on the same test tasks (the last's results when they are the last).
    best_results = results
    if test_tasks is not None and trainer.best and trainer.best["iteration"] != trainer.iterations:
        learner.load_state_dict(torch.load(opts.out / BEST_FILE, weights_only=True)["learner"])
        best_results = evaluate(fitted.run, test_tasks, cfg, opts.device, seed=cfg.seed + 20_000)
    data = {"characters": [len(p.characters) for p in splits],
            "alphabets": [p.alphabets for p in splits], "batching": learner.resolved_batching}  # fmt: skip
    if test_tasks is None:
        why = f"--split-fractions {_shares(cfg)} gives the test split no characters"
        return fit.Results(results, "accuracy", f"no final test: {why} (results.json has test: {{}}); the model is in "
                           f"{opts.out / 'checkpoint.pt'}.", {"data": data, "test_best": best_results, "test_skipped": why})  # fmt: skip
    best_at = trainer.best.get("iteration", trainer.iterations)
    lines = [f"{cfg.ways}-way {cfg.shots}-shot test accuracy on {cfg.eval_tasks} tasks of held-out characters "
             f"(last: iteration {trainer.iterations}; best validation: iteration {best_at}):"]  # fmt: skip
    for key, r in results.items():
        b = best_results[key]
        lines.append(f"  {r['steps']} steps: last {100 * r['accuracy']:.2f} % +- {100 * r['ci95']:.2f} %, "
                     f"best {100 * b['accuracy']:.2f} % +- {100 * b['ci95']:.2f} %")  # fmt: skip
    return fit.Results(results, "accuracy", "\n".join(lines), {"data": data, "test_best": best_results})


def run(argv: Sequence[str] | None = None) -> None:
    fit.fit(fit.Experiment("omniglot", OmniglotConfig, __doc__.split("\n\n")[0], validate_config, model=make_model,
                           tasks=train_tasks, test=final_test, resolve=resolve, load=load, notes=notes,
                           run_name=lambda cfg: f"omniglot-{cfg.ways}way-{cfg.shots}shot"), argv)  # fmt: skip


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
        splits = omni.split(by, cfg.split_fractions, seed=cfg.split_seed, rotations=ROTATED[cfg.rotations])
    except ValueError as e:  # too few alphabets or archives for every share > 0
        reason = str(e).split("): ", 1)[-1]  # without the API call, which names no flag
        raise UsageError(f"--split-by {by} --split-fractions {shares}: {reason}") from None
    samplers: list[tasks.FewShotSampler | None] = []
    for name, part, share in zip(SPLITS, splits, cfg.split_fractions, strict=True):
        if share == 0:
            samplers.append(None)
            continue
        if part.num_classes < cfg.ways:
            alphabets = f"{len(part.alphabets)} alphabet{'s' if len(part.alphabets) != 1 else ''}"
            classes = f"{len(part.characters)} characters of {alphabets}" + (", 4 rotations each" if part.rotations else "")
            finer = " or --split-by character" if by != "character" else ""
            raise UsageError(
                f"--ways {cfg.ways}: the {name} split holds only {part.num_classes} classes ({classes}; --split-by {by} "
                f"--split-fractions {shares}); lower --ways to at most {part.num_classes}, or give the {name} split "
                f"more characters: a larger share in --split-fractions{finer}."
            )
        try:
            samplers.append(tasks.FewShotSampler(part.images, part.labels, cfg.ways, cfg.shots, cfg.query))
        except ValueError as e:  # fewer images per class than shots + query
            raise UsageError(f"--shots {cfg.shots} --query {cfg.query}, the {name} split: {e}") from None
    return splits, samplers


if __name__ == "__main__":
    fit.main(run)
