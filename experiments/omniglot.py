"""N-way K-shot Omniglot with MAML, as Finn et al.'s released code runs it (cbfinn/maml), by default.

    python -m experiments.omniglot --data PATH
    python -m experiments.omniglot --data ~/data/omniglot --ways 20     # 20-way: 5 steps, lr 0.1, meta-batch 16
    python -m experiments.omniglot --network maxpool --loss mean --query 15   # learn2learn's and MAML++'s setting
    python -m experiments.omniglot --engine learn2learn                 # the peer: learn2learn's MAML trains
    python -m experiments.omniglot --help
    torchrun --standalone --nproc-per-node 4 -m experiments.omniglot --data ~/data/omniglot --device cuda  # 4 GPUs

Splits the characters of every archive or folder under --data by alphabet, meta-trains the reference's net on
them in 4 rotations, and reports the test accuracy of the last and best-validation parameters on 600 tasks.
"""

from __future__ import annotations

from experiments.harness.lifecycle import Lifecycle, catch_start_up_stops

if __name__ == "__main__":  # run as a script: a Ctrl-C or SIGTERM while torch imports (seconds) is one line
    catch_start_up_stops()

import dataclasses
import math
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
from experiments.nets import LOSSES, NETWORKS, build_model, loss_function, meta_only

__all__ = ["OmniglotConfig", "validate_config", "load", "make_model", "run"]

PAPER = {5: (1, 0.4, 32), 20: (5, 0.1, 16)}  # by number of ways: inner steps, inner lr, meta-batch
ROTATED = {"all": True, "train": (True, False, False), "none": False}  # --rotations: which of train, val, test
SPLITS = ("train", "validation", "test")
# load's data: the splits and their train, validation and test samplers (None: a share of 0)
Data = tuple[tasks.OmniglotSplits, list[tasks.FewShotSampler | None]]


@dataclasses.dataclass(frozen=True)
class OmniglotConfig(ExperimentConfig):
    """The hyperparameters (each a flag and a --config key): the shared ones, then the data's, the model's and the
    evaluation's."""

    # What the recipes set differently on Omniglot (experiments.harness.recipes; their papers' Omniglot values).
    RECIPES: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "mamlpp": {"inner_lr": 0.1, "meta_batch": 8, "loss": "mean", "per_step_bn": True},
        "reptile": {
            "inner_optimizer": "adam",
            "inner_adam_betas": (0.0, 0.999),
            "inner_lr": 1e-3,
            "train_shots": 10,
            "meta_batch": 5,
            "meta_lr": 1.0,
            "loss": "mean",
            "iterations": 100_000,
            "eval_steps": (50,),
        },
        "imaml": {
            "inner_lr": 0.1,
            "steps": 16,
            "meta_batch": 32,
            "loss": "mean",
            "network": "maxpool",
            "eval_steps": (16,),
        },
    }

    iterations: int = 60_000
    meta_batch: int | None = None
    """tasks per meta-batch (null: 32 for 5-way, 16 for 20-way)"""
    shots: int = 1
    """support images per class (K)"""
    train_shots: int | None = None
    """support images per class in meta-training (null: --shots; Reptile's recipe trains on 10)"""
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
    per_step_bn: bool = False
    """MAML++'s per-step batch-norm weights and biases (BNWB) in place of each batch norm, learned by the outer loop only"""
    engine: Literal[peers.ENGINES] = "maml"  # type: ignore[valid-type]
    """what computes the meta-gradient in training: this toolkit, or learn2learn's MAML (the peer row; the evaluation is this toolkit's either way)"""
    eval_chunk: int = 50
    """test tasks per evaluation pass (bounds memory)"""

    @property
    def train_shots_flag(self) -> str:
        """The flag that set the train K of a resolved config (``--train-shots`` defaults to ``--shots``)."""
        return "--train-shots" if self.train_shots != self.shots else "--shots"

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
            train_shots=self.shots if self.train_shots is None else self.train_shots,
        )


def shares(cfg: OmniglotConfig) -> str:
    """--split-fractions as it is written on the command line."""
    return ",".join(f"{f:g}" for f in cfg.split_fractions)


def validate_config(cfg: OmniglotConfig) -> None:
    """Raises ValueError naming the key for an invalid value."""
    check_config(cfg, positive=("ways", "filters", "eval_chunk", "train_shots"))
    if cfg.ways < 2:
        raise ValueError(f"--ways {cfg.ways}: a task needs at least 2 classes to tell apart; pass --ways 2 or more.")
    if len(cfg.split_fractions) != 3 or not all(math.isfinite(f) and f >= 0 for f in cfg.split_fractions):
        raise ValueError(
            f"--split-fractions {shares(cfg)} must be three shares >= 0 (train, validation, test) "
            f"that sum to 1, e.g. 0.6,0.15,0.25."
        )
    if abs(sum(cfg.split_fractions) - 1) > 1e-6:
        raise ValueError(
            f"--split-fractions {shares(cfg)} sums to {sum(cfg.split_fractions):g}; the three shares "
            f"(train, validation, test) must sum to 1, e.g. 0.6,0.15,0.25."
        )
    if cfg.mode == "implicit" and (cfg.network == "strided" or cfg.per_step_bn):
        kept = "--per-step-bn's weights" if cfg.per_step_bn else "the strided net's batch-norm offsets"
        raise ValueError(
            f"--mode implicit needs every trained parameter adapted (iMAML's meta-gradient is that of the adapted "
            f"weights), and {kept} are learned by the outer loop only; pass --network maxpool without --per-step-bn, "
            f"or pick another --mode."
        )
    if cfg.engine == "learn2learn" and (why := peers.unsupported(cfg)):
        raise ValueError(f"{why}.")
    if cfg.split_fractions[0] == 0:
        raise ValueError(
            f"--split-fractions {shares(cfg)} gives the train split no characters; meta-training needs "
            f"a train share > 0, e.g. 0.6,0.15,0.25."
        )


def resolve(cfg: OmniglotConfig) -> OmniglotConfig:
    cfg = cfg.resolved()
    if cfg.data is None:
        raise UsageError("no data: pass --data PATH (Omniglot archives or folders) or set $OMNIGLOT_DIR.")
    return cfg


def load(cfg: OmniglotConfig) -> Data:
    """The characters split into train, validation and test, and their task samplers (None for a 0 share).

    Raises UsageError naming the flag and the fix where the data or a split cannot make the tasks asked for.
    """
    try:
        omni = tasks.Omniglot(cfg.data, rotations=cfg.rotations != "none")
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise UsageError(f"--data {cfg.data}: {e}") from None
    by, given = cfg.split_by, shares(cfg)
    try:
        splits = omni.split(by, cfg.split_fractions, seed=cfg.split_seed, rotations=ROTATED[cfg.rotations])
    except ValueError as e:  # too few alphabets or archives for every share > 0
        reason = str(e).split("): ", 1)[-1]  # without the API call, which names no flag
        raise UsageError(f"--split-by {by} --split-fractions {given}: {reason}") from None
    samplers: list[tasks.FewShotSampler | None] = []
    for name, part, share in zip(SPLITS, splits, cfg.split_fractions, strict=True):
        if share == 0:
            samplers.append(None)
            continue
        if part.num_classes < cfg.ways:
            plural, rotated = "s" if len(part.alphabets) != 1 else "", ", 4 rotations each" if part.rotations else ""
            classes = f"{len(part.characters)} characters of {len(part.alphabets)} alphabet{plural}{rotated}"
            finer = " or --split-by character" if by != "character" else ""
            raise UsageError(
                f"--ways {cfg.ways}: the {name} split holds only {part.num_classes} classes ({classes}; --split-by {by} "
                f"--split-fractions {given}); lower --ways to at most {part.num_classes}, or give the {name} split "
                f"more characters: a larger share in --split-fractions{finer}."
            )
        shots = cfg.train_shots if name == "train" else cfg.shots
        flag = cfg.train_shots_flag if name == "train" else "--shots"
        try:
            samplers.append(tasks.FewShotSampler(part.images, part.labels, cfg.ways, shots, cfg.query))
        except ValueError as e:  # fewer images per class than shots + query
            raise UsageError(f"{flag} {shots} --query {cfg.query}, the {name} split: {e}") from None
    return splits, samplers


def notes(cfg: OmniglotConfig, data: Data) -> list[str]:
    """A line for each split that --split-fractions leaves without characters."""
    _, (_, val, test) = data
    return [
        f"note: --split-fractions {shares(cfg)} gives the {name} split no characters; the run "
        f"{'trains without validation' if name == 'validation' else 'skips the final test'}."
        for name, sampler in (("validation", val), ("test", test))
        if sampler is None
    ]


def memory_needs(cfg: OmniglotConfig, params: int | None) -> list[Need]:
    """Lower bounds on what an Omniglot run holds at one moment (:mod:`experiments.memory`)."""
    image = 28 * 28 * FLOAT_BYTES
    per_task = cfg.ways * (cfg.shots + cfg.query)  # images of one test task
    first_layer = cfg.ways * max(cfg.train_shots, cfg.query) * cfg.filters * 14 * 14 * FLOAT_BYTES  # of one pass
    return [
        Need(
            "the network's weights, meta-gradient, and one task's support gradient and fast weights",
            "--filters, --ways",
            None if params is None else 4 * params,
        ),
        Need(
            "the training meta-batch's images and one task's first feature maps",
            f"--meta-batch, --ways, {cfg.train_shots_flag}, --query, --filters",
            cfg.meta_batch * cfg.ways * (cfg.train_shots + cfg.query) * image + first_layer,
        ),
        Need("the validation tasks' images", "--val-tasks, --ways, --shots, --query", cfg.val_tasks * per_task * image),
        Need("the test tasks' images", "--eval-tasks, --ways, --shots, --query", cfg.eval_tasks * per_task * image),
    ]


def make_model(cfg: OmniglotConfig) -> fit.Model:
    net = build_model(cfg.ways, cfg.filters, cfg.network, cfg.steps if cfg.per_step_bn else None)
    # openai/supervised-reptile adapts and interpolates every trainable variable, batch norm included.
    kept_out = set() if cfg.mode == "reptile" else meta_only(net)
    return fit.Model(
        net,
        loss_function(cfg.loss, cfg.ways),
        kept_out,
        engine=peers.Learn2LearnMAML if cfg.engine == "learn2learn" else None,
    )


def held_out(cfg: OmniglotConfig, test: tasks.Omniglot) -> str:
    """What the test tasks are drawn from, in the unit --split-by held out: "2 held-out alphabets"."""
    units = {"character": test.characters, "alphabet": test.alphabets, "archive": test.archives}[cfg.split_by]
    return f"{len(units)} held-out {cfg.split_by}{'s' if len(units) != 1 else ''}"


def final_test(fitted: fit.Fitted) -> fit.Results:
    splits = fitted.data[0]
    data = {"characters": [len(p.characters) for p in splits], "alphabets": [p.alphabets for p in splits]}
    untested = f"--split-fractions {shares(fitted.cfg)} gives the test split no characters"
    return fewshot.final_test(fitted, data, held_out(fitted.cfg, splits.test), untested)


EXPERIMENT = fit.Experiment(
    "omniglot",
    OmniglotConfig,
    __doc__.split("\n\n")[0],
    validate_config,
    make_model,
    fewshot.train_tasks,
    final_test,
    resolve=resolve,
    load=load,
    notes=notes,
    run_name=lambda cfg: f"omniglot-{cfg.ways}way-{cfg.shots}shot",
    needs=memory_needs,
)


def run(argv: Sequence[str] | None = None, life: Lifecycle | None = None) -> None:
    """The script, with the command line ``argv`` (default: ``sys.argv[1:]``)."""
    fit.fit(EXPERIMENT, argv, life)


if __name__ == "__main__":
    fit.main(run)
