"""N-way K-shot mini-ImageNet, tieredImageNet, CIFAR-FS or FC100 with MAML, as Finn et al.'s released code runs mini-ImageNet.

    python -m experiments.images --data PATH                          # mini-ImageNet 5-way 1-shot, the reference's protocol
    python -m experiments.images --data PATH --shots 5                # 5-way 5-shot
    python -m experiments.images --dataset tieredimagenet --data PATH
    python -m experiments.images --dataset cifarfs --algorithm mamlpp # data from $CIFARFS_DIR
    python -m experiments.images --data PATH --test-dataset cub --test-data PATH2  # mini-ImageNet -> CUB
    python -m experiments.images --help

Reads the data set's splits from --data (or $MINIIMAGENET_DIR, $TIEREDIMAGENET_DIR, $CIFARFS_DIR, $FC100_DIR) in
any layout of docs/data.md, meta-trains the reference's mini-ImageNet net, and reports the test accuracy of the last
and best-validation parameters on 600 tasks of the test classes: the same set's, or, across domains
(--test-dataset), another set's test split, its images at the size the network was trained on.
"""

from __future__ import annotations

from experiments.harness.lifecycle import Lifecycle, catch_start_up_stops

if __name__ == "__main__":  # run as a script: a Ctrl-C or SIGTERM while torch imports (seconds) is one line
    catch_start_up_stops()

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import tyro

import tasks
from experiments import fewshot, peers
from experiments.harness import fit
from experiments.harness.config import ExperimentConfig, check_config
from experiments.harness.failures import FLOAT_BYTES, Need
from experiments.harness.folder import UsageError
from experiments.nets import LOSSES, REFERENCE_MAXPOOL, build_model, loss_function, meta_only

__all__ = ["ImagesConfig", "validate_config", "make_model", "run"]

DATASETS = tuple(tasks.IMAGE_DATASETS)  # miniimagenet, tieredimagenet, cifarfs, fc100, dtd, fungi
NETWORKS = ("reference", "maxpool")
Data = tuple[tasks.ImageSplits, list[tasks.FewShotSampler]]  # the splits and their train, val, test samplers


@dataclasses.dataclass(frozen=True)
class ImagesConfig(ExperimentConfig):
    """The hyperparameters (each a flag and a --config key): the shared ones, then the data's, the model's and the
    evaluation's."""

    # What the recipes set differently on mini-ImageNet and its kin (experiments.harness.recipes).
    # HowToTrainYourMAMLPytorch's mini-ImageNet configs: 150 epochs of 500 iterations, first order until epoch 80,
    # 5 steps at its default init_inner_loop_learning_rate 0.01, 15 targets; batch size 4 at 1-shot, 2 at 5-shot
    # (resolved() sets --meta-batch by --shots).
    RECIPES: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "mamlpp": {
            "loss": "mean",
            "network": "maxpool",
            "per_step_bn": True,
            "iterations": 75_000,
            "first_order_fraction": 80 / 150,
            "eval_steps": (5,),
        },
    }

    iterations: int = 60_000
    meta_batch: int | None = None
    """tasks per meta-batch (null: 4, the reference's at 1 and 5 shots; the mamlpp recipe's 2 at 5 shots)"""
    shots: int = 1
    """support images per class (K)"""
    query: int = 15
    """query images per class in training and validation (the reference's 15)"""
    eval_query: int | None = None
    """query images per class of the final test (null: --shots, as the reference's test tasks of 2K images per class)"""
    inner_lr: float = 0.01
    steps: int = 5
    compile: bool = False
    """compile the meta-step with torch.compile (second or first order; exact; a one-off compile, then faster steps)"""
    log_every: int = 50
    val_every: int = 500
    checkpoint_every: int = 500
    eval_tasks: int = 600
    """test tasks in the final evaluation"""
    eval_steps: tuple[int, ...] = (1, 5, 10)
    """inner steps of the final evaluation (the reference tests with 10)"""
    dataset: Literal[DATASETS] = "miniimagenet"  # type: ignore[valid-type]
    """the data set"""
    data: Annotated[str | None, tyro.conf.arg(help_behavior_hint="(default: $MINIIMAGENET_DIR, ...)")] = None
    """the folder holding the data set in a layout of docs/data.md (null: the data set's variable)"""
    ways: int = 5
    """classes per task (N)"""
    network: Literal[NETWORKS] = "reference"  # type: ignore[valid-type]
    """reference: the reference's mini-ImageNet net (batch norm with an offset only, meta-learned; Xavier init); maxpool: learn2learn's and MAML++'s (affine batch norm, adapted)"""
    loss: Literal[LOSSES] = "reference"  # type: ignore[valid-type]
    """reference: the reference's cross-entropy summed over the examples over K (its query loss is 15 x 5 times the mean at 1 shot); mean: the mean cross-entropy"""
    filters: int = 32
    """filters in each of the 4 conv blocks"""
    per_step_bn: bool = False
    """MAML++'s per-step batch-norm weights and biases (BNWB), learned by the outer loop only"""
    clip_meta_grad: float | None = 10.0
    """clamp each meta-gradient entry to [-c, c] before the meta-step (the reference clips at 10 on mini-ImageNet); null: none"""
    engine: Literal[peers.ENGINES] = "maml"  # type: ignore[valid-type]
    """what computes the meta-gradient in training: this toolkit, or learn2learn's MAML"""
    eval_chunk: int = 50
    """test tasks per evaluation pass (bounds memory)"""
    test_dataset: Literal[DATASETS] | None = None  # type: ignore[valid-type]
    """the data set whose test split the final test draws from (null: --dataset's): cross-domain, e.g. cub after miniimagenet"""
    test_data: Annotated[str | None, tyro.conf.arg(help_behavior_hint="(default: $CUB_DIR, ...)")] = None
    """the folder holding --test-dataset (null: its variable)"""

    def resolved(self) -> ImagesConfig:
        """The config with the data path and the per-shots meta-batch filled in."""
        env = tasks.IMAGE_LAYOUTS[self.dataset].env
        batch = 2 if self.algorithm == "mamlpp" and self.shots > 1 else 4
        test_env = tasks.IMAGE_LAYOUTS[self.test_dataset].env if self.test_dataset is not None else None
        return dataclasses.replace(
            self,
            data=self.data or os.environ.get(env),
            test_data=self.test_data or (os.environ.get(test_env) if test_env else None),
            meta_batch=batch if self.meta_batch is None else self.meta_batch,
            eval_query=self.shots if self.eval_query is None else self.eval_query,
        )


def validate_config(cfg: ImagesConfig) -> None:
    """Raises ValueError naming the key for an invalid value."""
    check_config(cfg, positive=("ways", "filters", "eval_chunk", "eval_query"))
    if cfg.ways < 2:
        raise ValueError(f"--ways {cfg.ways}: a task needs at least 2 classes to tell apart; pass --ways 2 or more.")
    if cfg.mode == "implicit" and (cfg.network == "reference" or cfg.per_step_bn):
        raise ValueError(
            "--mode implicit needs every trained parameter adapted, and the batch-norm offsets of --network reference "
            "(or --per-step-bn's weights) are learned by the outer loop only; pass --network maxpool without "
            "--per-step-bn, or pick another --mode."
        )
    if cfg.engine == "learn2learn" and (why := peers.unsupported(cfg)):
        raise ValueError(f"{why}.")


def resolve(cfg: ImagesConfig) -> ImagesConfig:
    cfg = cfg.resolved()
    if cfg.data is None:
        spec = tasks.IMAGE_LAYOUTS[cfg.dataset]
        raise UsageError(
            f"no data: pass --data PATH (the {spec.name} files in a layout of docs/data.md) or set ${spec.env}."
        )
    if cfg.test_dataset is None and cfg.test_data is not None:
        raise UsageError(f"--test-data {cfg.test_data} names no set to test on: pass --test-dataset too.")
    if cfg.test_dataset is not None and cfg.test_data is None:
        spec = tasks.IMAGE_LAYOUTS[cfg.test_dataset]
        raise UsageError(
            f"--test-dataset {cfg.test_dataset}: no test data: pass --test-data PATH (the {spec.name} files in a "
            f"layout of docs/data.md) or set ${spec.env}."
        )
    return cfg


def load(cfg: ImagesConfig) -> Data:
    """The train, validation and test splits and their samplers (UsageError naming the flag or the file)."""
    cls = tasks.IMAGE_DATASETS[cfg.dataset]
    try:
        splits = cls.splits(cfg.data)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--data {cfg.data}: {e}") from None
    if cfg.test_dataset is not None:  # across domains: another set's test split, at the network's image size
        try:
            test = tasks.IMAGE_DATASETS[cfg.test_dataset](cfg.test_data, "test")
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"--test-data {cfg.test_data}: {e}") from None
        trained, tested = tuple(splits.train.images.shape[1:]), tuple(test.images.shape[1:])
        if trained != tested:
            raise UsageError(
                f"--test-dataset {cfg.test_dataset}: its images are {_shape(tested)}, and the network trained on "
                f"{cfg.dataset} takes {_shape(trained)}; test on a set of the same image size."
            )
        splits = splits._replace(test=test)
    samplers = []
    for name, part, query in zip(("train", "validation", "test"), splits, (cfg.query, cfg.query, cfg.eval_query)):
        if part.num_classes < cfg.ways:
            raise UsageError(f"--ways {cfg.ways}: the {name} split holds {part.num_classes} classes; lower --ways.")
        flag = "--query" if name != "test" else "--eval-query"
        try:
            samplers.append(part.sampler(cfg.ways, cfg.shots, query))
        except ValueError as e:
            raise UsageError(f"--shots {cfg.shots} {flag} {query}, the {name} split: {e}") from None
    return splits, samplers


def _shape(shape: tuple[int, ...]) -> str:
    """``(3, 84, 84)`` as a person reads it: ``3-channel 84x84``."""
    return f"{shape[0]}-channel {shape[1]}x{shape[2]}"


def make_model(cfg: ImagesConfig) -> fit.Model:
    network = REFERENCE_MAXPOOL if cfg.network == "reference" else "maxpool"
    side = tasks.IMAGE_LAYOUTS[cfg.dataset].side
    net = build_model(cfg.ways, cfg.filters, network, cfg.steps if cfg.per_step_bn else None, channels=3, side=side)
    kept_out = set() if cfg.mode == "reptile" else meta_only(net)
    return fit.Model(
        net,
        loss_function(cfg.loss, cfg.ways, cfg.shots),
        kept_out,
        engine=peers.Learn2LearnMAML if cfg.engine == "learn2learn" else None,
    )


def memory_needs(cfg: ImagesConfig, params: int | None) -> list[Need]:
    """Lower bounds on what a run holds at one moment (:mod:`experiments.memory`)."""
    side = tasks.IMAGE_LAYOUTS[cfg.dataset].side
    image = 3 * side * side * FLOAT_BYTES
    first_layer = cfg.ways * max(cfg.shots, cfg.query) * cfg.filters * side * side * FLOAT_BYTES
    return [
        Need("the network's weights, meta-gradient and one task's fast weights", "--filters, --ways",
             None if params is None else 4 * params),
        Need("the training meta-batch's images and one task's first feature maps",
             "--meta-batch, --ways, --shots, --query, --filters",
             cfg.meta_batch * cfg.ways * (cfg.shots + cfg.query) * image + first_layer),
        Need("the test tasks' images", "--eval-tasks, --ways, --shots, --eval-query",
             cfg.eval_tasks * cfg.ways * (cfg.shots + cfg.eval_query) * image),
    ]  # fmt: skip


def final_test(fitted: fit.Fitted) -> fit.Results:
    splits = fitted.data[0]
    trained, tested = type(splits.train).spec.name, type(splits.test).spec.name
    data = {
        "dataset": trained,
        "test_dataset": tested,
        "layout": splits.train.layout,
        "test_layout": splits.test.layout,
        "classes": [p.num_classes for p in splits],
        "images": [len(p) for p in splits],
    }
    across = f" (meta-trained on {trained})" if fitted.cfg.test_dataset is not None else ""
    return fewshot.final_test(fitted, data, f"held-out {tested} classes{across}")


EXPERIMENT = fit.Experiment(
    "images",
    ImagesConfig,
    __doc__.split("\n\n")[0],
    validate_config,
    make_model,
    fewshot.train_tasks,
    final_test,
    resolve=resolve,
    load=load,
    run_name=lambda cfg: (
        f"{cfg.dataset}{f'-to-{cfg.test_dataset}' * (cfg.test_dataset is not None)}-{cfg.ways}way-{cfg.shots}shot"
    ),
    needs=memory_needs,
)


def run(argv: Sequence[str] | None = None, life: Lifecycle | None = None) -> None:
    """The script, with the command line ``argv`` (default: ``sys.argv[1:]``)."""
    fit.fit(EXPERIMENT, argv, life)


if __name__ == "__main__":
    fit.main(run)
