"""The MAML family as named recipes (``--algorithm``), what a config builds (the learner, the meta-optimizer), and
the per-iteration schedules the recipes use.

A recipe is a set of config defaults: ``--algorithm mamlpp`` changes what an unset key means,
and every flag or YAML key still overrides it (precedence: the experiment's defaults, then the
recipe, then ``--config``, then flags). The resolved settings are what ``config.yaml`` and
``results.json`` record.

The recipes and their papers are tabled, with where each value comes from and where a recipe
differs from its paper's released code, in the Recipes section of docs/experiments.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import maml
from experiments.harness.folder import UsageError

__all__ = [
    "ADAPT",
    "ALGORITHMS",
    "PAPERS",
    "Schedule",
    "adapt_set",
    "inner_options",
    "learner",
    "meta_optimizer",
    "recipe",
]

ALGORITHMS = ("maml", "fomaml", "metasgd", "anil", "mamlpp", "reptile", "imaml")
PAPERS = {
    "maml": "Finn et al. 2017",
    "fomaml": "Finn et al. 2017",
    "metasgd": "Li et al. 2017",
    "anil": "Raghu et al. 2020",
    "mamlpp": "Antoniou et al. 2019",
    "reptile": "Nichol et al. 2018",
    "imaml": "Rajeswaran et al. 2019",
}
ADAPT = ("all", "head", "body")  # body: BOIL's inner loop (everything but the head)

_MAMLPP = {
    "steps": 5,
    "learn_inner_lr": "per_layer_per_step",
    "msl_fraction": 0.1,
    "first_order_fraction": 0.5,
    "meta_lr_schedule": "cosine",
    "min_meta_lr": 1e-5,
}
_RECIPES: dict[str, dict[str, Any]] = {
    "maml": {},
    "fomaml": {"mode": "first_order"},
    "metasgd": {"learn_inner_lr": "per_parameter"},
    "anil": {"adapt": "head"},
    "mamlpp": _MAMLPP,
    "reptile": {
        "mode": "reptile",
        "meta_optimizer": "sgd",
        "meta_lr_schedule": "linear",
        "min_meta_lr": 0.0,
        "steps": 5,
    },
    "imaml": {"mode": "implicit", "implicit_lam": 2.0, "cg_iterations": 5},
}


def recipe(config: type, algorithm: str) -> dict[str, Any]:
    """The config keys ``algorithm`` sets for the experiment whose config dataclass is ``config``: the recipe's,
    then what the experiment sets differently (its ``RECIPES``: the paper's values for that data).

    Raises:
        ValueError: an unknown algorithm, naming the flag and the choices.
    """
    if algorithm not in _RECIPES:
        raise ValueError(f"--algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}.")
    return {**_RECIPES[algorithm], **getattr(config, "RECIPES", {}).get(algorithm, {})}


def adapt_set(model: nn.Module, adapt: str, meta_only: Collection[str] = ()) -> Callable[[str], bool] | None:
    """The ``adapt=`` argument of ``maml.MetaLearner`` for ``adapt`` in ``ADAPT``.

    The head is the module that holds the model's last parameter (the final linear layer of both
    experiments' models). ``meta_only``: parameters the model's own design keeps out of the inner
    loop (the reference Omniglot net's batch-norm offsets), left out of every set. ``None``
    (adapt everything) for ``"all"`` when nothing is meta-only.
    """
    if adapt == "all" and not meta_only:
        return None
    last = list(dict(model.named_parameters()))[-1]
    head = last.rpartition(".")[0] + "."
    if adapt == "all":
        return lambda name: name not in meta_only
    if adapt == "head":
        return lambda name: name.startswith(head) and name not in meta_only
    return lambda name: not name.startswith(head) and name not in meta_only


PAIRS = ("betas", "etas", "step_sizes")  # torch.optim's options that are pairs: a JSON list is read as a tuple


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's keys, refusing one given twice (``json.loads`` keeps the last silently)."""
    keys = [k for k, _ in pairs]
    if twice := next((k for k in keys if keys.count(k) > 1), None):
        raise ValueError(f"the key {twice!r} is given twice; keep one")
    return dict(pairs)


def inner_options(cfg: Any) -> dict[str, Any] | None:
    """The learner's ``inner_optimizer_options`` of a config: ``--inner-optimizer-options``' JSON object (torch.optim's
    keyword names; a list of a pair option is a tuple), over ``--inner-adam-betas`` under ``--inner-optimizer adam``.

    The options are checked by building the rule for a stand-in model (a learned option's layout is shaped by the
    model's parameters; whether the options are valid does not depend on them).

    Raises:
        ValueError: one line naming the flag, its value and the fix.
    """
    betas = cfg.inner_adam_betas
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        shown = ",".join(f"{b:g}" for b in betas)
        raise ValueError(f"--inner-adam-betas {shown} must be two numbers in [0, 1), e.g. 0.9,0.999 (the default).")
    text, name = cfg.inner_optimizer_options, cfg.inner_optimizer
    named, example = f"--inner-optimizer-options {text}", "e.g. '{\"momentum\": 0.9}' (torch.optim's keyword names)"
    try:
        options = {} if text is None else json.loads(text, object_pairs_hook=_unique)
    except ValueError as e:  # json.JSONDecodeError too
        why = f"{e.msg} at character {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ValueError(f"{named} is not a JSON object ({why}); pass one, {example}.") from None
    if not isinstance(options, dict):
        raise ValueError(f"{named} is not a JSON object of options; pass one, {example}.")
    if "lr" in options:
        raise ValueError(
            f"{named}: torch.optim's lr is --inner-lr (learned with --learn-inner-lr); drop lr from the options and "
            f"pass --inner-lr {options['lr']}."
        )
    options = {k: tuple(v) if k in PAIRS and isinstance(v, list) else v for k, v in options.items()}
    if name == "adam":
        options = {"betas": tuple(betas), **options}
    try:
        steps = max(cfg.steps or 1, 1)  # a per-step option's length: any, for the check
        maml.MetaLearner(nn.Linear(1, 1), F.mse_loss, 0.1, steps, inner_optimizer=name, inner_optimizer_options=options)
    except (TypeError, ValueError) as e:
        # The engine's words, with the flags for its arguments.
        why = str(e).removeprefix(f"inner_optimizer_options for inner_optimizer={name!r}: ")
        why = why.replace("inner_optimizer_options has", "it has").replace("inner_optimizer=", "--inner-optimizer ")
        raise ValueError(f"{named} (--inner-optimizer {name}): {why}") from None
    learned = options.get("learn")
    if learned and not maml.Mode.of(cfg.mode).unrolled:
        what = ", ".join([learned] if isinstance(learned, str) else list(learned))
        why = "differentiates no inner step" if cfg.mode == "reptile" else "does not depend on how the inner loop ran"
        raise ValueError(
            f"{named} learns {what}: --mode {cfg.mode}'s meta-gradient {why}, so it has none for them; drop "
            f'"learn", or pick another --mode.'
        )
    return options or None


@dataclasses.dataclass(frozen=True)
class ProximalLoss:
    """``--inner-proximal``'s inner loss: the task's loss plus ``lam / 2 * |phi - theta|^2`` to the initial weights.

    ``MetaLearner(inner_loss_fn=...)`` passes the task's fast weights and their initial values to the keywords
    this signature names, and differentiates the term exactly in every mode that unrolls the inner loop.
    """

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lam: float

    def __call__(
        self,
        out: torch.Tensor,
        y: torch.Tensor,
        *,
        fast: dict[str, torch.Tensor],
        initial: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        return self.loss(out, y) + self.lam / 2 * sum((fast[k] - initial[k]).pow(2).sum() for k in fast)


def check_inner_proximal(cfg: Any) -> None:
    """Raises ValueError naming ``--inner-proximal`` where its value cannot be a proximal term's strength."""
    lam = cfg.inner_proximal
    if not 0 <= lam <= torch.finfo(torch.float32).max:  # NaN fails
        raise ValueError(f"--inner-proximal {lam:g} must be a finite number >= 0 (0: no proximal term), e.g. 0.1.")
    if lam and cfg.mode == "implicit":
        raise ValueError(
            f"--inner-proximal {lam:g} with --mode implicit: iMAML's inner problem is proximal already, with its "
            f"strength --implicit-lam; drop --inner-proximal."
        )


def inner_loss(cfg: Any, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> ProximalLoss | None:
    """The learner's inner loss from ``--inner-proximal`` (None: ``loss``, the task's)."""
    check_inner_proximal(cfg)
    return ProximalLoss(loss, cfg.inner_proximal) if cfg.inner_proximal else None


def learner(
    cfg: Any,
    net: nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    meta_only: Collection[str] = (),
) -> maml.MetaLearner:
    """The run's learner, built from its config; an option the engine refuses (a ``--memory-budget`` that is no
    size, or one for a mode that plans nothing) is a usage error: one line, exit code 2, nothing written."""
    try:
        return maml.MetaLearner(
            net,
            loss,
            inner_lr=cfg.inner_lr,
            steps=cfg.steps,
            mode=maml.Implicit(cfg.implicit_lam, cfg.cg_iterations) if cfg.mode == "implicit" else cfg.mode,
            batching=cfg.batching,
            learn_inner_lr=cfg.learn_inner_lr,
            compile=cfg.compile,
            adapt=adapt_set(net, cfg.adapt, meta_only),
            inner_optimizer=cfg.inner_optimizer,
            inner_optimizer_options=inner_options(cfg),
            memory_budget=cfg.memory_budget,
            inner_loss_fn=inner_loss(cfg, loss),
        )
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def meta_optimizer(
    learner: maml.MetaLearner, meta_lr: float, rate_meta_lr: float | None = None, kind: str = "adam"
) -> torch.optim.Optimizer:
    """The outer loop's optimizer (``kind``: ``"adam"`` or ``"sgd"``): the model's weights at ``meta_lr``, learned inner rates at ``rate_meta_lr``.

    Learned rates get a parameter group of their own (``None``: at ``meta_lr`` too), and so do the update
    rule's own tensors (the inner optimizer's learned options, at ``meta_lr``). Each group's ``"scale"``
    is its lr over ``meta_lr``, which ``Schedule.apply`` keeps through the schedule.
    ``"sgd"`` is Reptile's outer step: with its direction in ``.grad``, ``theta += lr (phi - theta)``.
    """
    rate_lr = meta_lr if rate_meta_lr is None else rate_meta_lr
    groups = [{"params": list(learner.model.parameters()), "lr": meta_lr, "scale": 1.0}]
    if learner.rate_parameters:
        groups.append({"params": list(learner.rate_parameters.values()), "lr": rate_lr, "scale": rate_lr / meta_lr})
    grouped = {id(p) for group in groups for p in group["params"]}
    if rule := [p for p in learner.parameters() if id(p) not in grouped]:  # the rest: the rule's own tensors
        groups.append({"params": rule, "lr": meta_lr, "scale": 1.0})
    # Adam's fused kernel: one call for every tensor instead of a dozen per tensor (0.13 against 0.45 ms a
    # step for the sine MLP on one CPU thread), the same update to float rounding.
    return torch.optim.SGD(groups, lr=meta_lr) if kind == "sgd" else torch.optim.Adam(groups, fused=True)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What changes during training: the meta-lr, the derivative order and the per-step loss weights.

    Each is a function of the iteration and the run's length, nothing else, so a resumed run
    follows the uninterrupted one; a run whose schedule depends on its length cannot change
    ``--iterations`` on resume (``depends_on_length``).

    Attributes:
        iterations: the run's length.
        meta_lr: the optimizer's learning rate (the start of a cosine schedule).
        meta_lr_schedule: ``"constant"``, or ``"cosine"`` or ``"linear"`` (annealed to ``min_meta_lr`` at the end).
        min_meta_lr: the annealed schedules' floor.
        mode: the learner's mode once ``first_order_fraction`` of training is past.
        first_order_fraction: the share of training in first order (derivative-order annealing).
        msl_fraction: the share of training with MAML++'s annealed multi-step loss.
        steps: inner steps in training (the multi-step loss weighs each).
    """

    iterations: int
    meta_lr: float
    meta_lr_schedule: str = "constant"
    min_meta_lr: float = 0.0
    mode: str = "second_order"
    first_order_fraction: float = 0.0
    msl_fraction: float = 0.0
    steps: int = 1

    @classmethod
    def of(cls, cfg: Any) -> Schedule:
        """The schedule of an experiment config (or of a saved config's dict, whose missing keys take the defaults)."""
        get = cfg.get if isinstance(cfg, dict) else lambda key, default: getattr(cfg, key)
        return cls(**{f.name: get(f.name, f.default) for f in dataclasses.fields(cls)})

    @property
    def depends_on_length(self) -> bool:
        return self.meta_lr_schedule != "constant" or self.first_order_fraction > 0 or self.msl_fraction > 0

    def lr(self, iteration: int) -> float:
        """The meta-lr of (0-based) ``iteration``."""
        if self.meta_lr_schedule == "constant":
            return self.meta_lr
        if self.meta_lr_schedule == "linear":  # supervised-reptile: frac_done = i / meta_iters
            return self.meta_lr + (self.min_meta_lr - self.meta_lr) * iteration / self.iterations
        progress = iteration / max(self.iterations - 1, 1)
        return self.min_meta_lr + 0.5 * (self.meta_lr - self.min_meta_lr) * (1 + math.cos(math.pi * progress))

    def mode_at(self, iteration: int) -> str:
        """First order for the first ``first_order_fraction`` of training, then ``mode``."""
        return "first_order" if iteration < self.first_order_fraction * self.iterations else self.mode

    def step_weights(self, iteration: int) -> torch.Tensor | None:
        """MAML++'s per-step loss weights ``(steps,)`` while annealing, else None (the last step's loss)."""
        span = self.msl_fraction * self.iterations
        if self.steps < 2 or iteration >= span:
            return None
        n, progress = self.steps, iteration / span  # MAML++ decays by 1/steps per msl epoch: 0 -> 1 over the span
        floor = 0.03 / n
        weights = torch.full((n,), 1.0 / n, dtype=torch.float64)
        weights[:-1] = torch.clamp(weights[:-1] - progress / n, min=floor)
        weights[-1] = min(1.0 / n + progress * (n - 1) / n, 1.0 - (n - 1) * floor)
        return weights

    def apply(self, iteration: int, learner: maml.MetaLearner, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Sets the learner's mode and the optimizer's lr for ``iteration``; returns its step weights."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr(iteration) * group.get("scale", 1.0)
        mode = self.mode_at(iteration)
        if learner.mode.name != mode:  # by name: a mode's options (iMAML's lam) stay as built
            learner.mode = mode
        return self.step_weights(iteration)
