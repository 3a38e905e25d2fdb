"""What makes a config invalid: :func:`check_config` and :func:`check_given`, each raising one line that names the flag.

The experiment scripts call :func:`check_config` from their own checks; ``experiments.config``
calls :func:`check_given` on the keys the user set.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import maml
from experiments.harness.cli import flag, show

__all__ = ["MAX_STEPS", "MAX_CG_ITERATIONS", "check_config", "check_given"]

# Upper bounds, so that a run asked for can finish: published protocols take at most 50 inner steps (MAML 1-10,
# MAML++ 5, iMAML 16-25, Reptile's evaluation 50) and 20 conjugate-gradient iterations (iMAML 5-20).
MAX_STEPS = 10_000
MAX_CG_ITERATIONS = 1_000


def check_config(cfg: Any, positive: Sequence[str] = ()) -> None:
    """Raises ValueError naming the flag and the value of the first invalid key of :class:`ExperimentConfig`.

    ``positive``: the experiment's own integer keys (or tuples of them) that must be >= 1; None passes.
    """
    if cfg.clip_meta_grad is not None and not 0 < cfg.clip_meta_grad < float("inf"):
        raise ValueError(
            f"--clip-meta-grad {cfg.clip_meta_grad:g} must be a finite number > 0 (10 is the reference's), or null."
        )
    for key in ("msl_fraction", "first_order_fraction"):
        if not 0 <= getattr(cfg, key) <= 1:  # NaN fails too
            raise ValueError(f"{flag(key)} {getattr(cfg, key):g} must be a share of training in [0, 1].")
    positive = (
        *("iterations", "meta_batch", "shots", "query", "log_every", "val_every", "val_tasks", "checkpoint_every"),
        *("eval_tasks", "cg_iterations", "backward_chunk", *positive),
    )
    # Only the loops inside a meta-iteration are bounded: a long run is stopped and resumed, and memory bounds sizes.
    most = f"{MAX_STEPS} inner steps, the most a run takes (each step is a forward and backward pass of every task; "
    most += "published protocols take 1 to 50)"
    for keys, low in ((positive, 1), (("steps", "eval_steps"), 0)):
        for key in keys:
            value = getattr(cfg, key)
            listed = isinstance(value, tuple)
            values = value if listed else () if value is None else (value,)
            if any(v < low for v in values):
                raise ValueError(f"{flag(key)} {show(value)}{': each' if listed else ''} must be an integer >= {low}.")
            if low == 0 and any(v > MAX_STEPS for v in values):
                if listed:
                    raise ValueError(
                        f"{flag(key)} {show(value)}: each must be at most {most}; pass values up to {MAX_STEPS}."
                    )
                raise ValueError(f"{flag(key)} {value} is above {most}; pass at most {MAX_STEPS}.")
    if cfg.cg_iterations > MAX_CG_ITERATIONS:
        raise ValueError(
            f"--cg-iterations {cfg.cg_iterations} is above {MAX_CG_ITERATIONS}: conjugate gradient solves an "
            f"n-dimensional system in n iterations in exact arithmetic and stops gaining far sooner in float32 "
            f"(iMAML runs 5 to 20), and each iteration is a Hessian-vector product of every task; pass at most "
            f"{MAX_CG_ITERATIONS}."
        )
    for key in ("inner_lr", "meta_lr", "rate_meta_lr", "implicit_lam"):
        value = getattr(cfg, key)
        if value is not None and not 0 < value <= torch.finfo(torch.float32).max:  # NaN fails; inf overflows float32
            default = next(f.default for f in dataclasses.fields(cfg) if f.name == key)
            fix = (
                f", e.g. {default:g} (the default)" if isinstance(default, float) else "; leave it out for the default"
            )
            big = " (in float32, the parameters' precision)" if math.isfinite(value) and value > 0 else ""
            raise ValueError(f"{flag(key)} {value:g} must be a finite number > 0{big}{fix}.")
    if cfg.rate_meta_lr is not None and cfg.learn_inner_lr is None:
        raise ValueError(
            f"--rate-meta-lr {cfg.rate_meta_lr:g} is the Adam lr of learned inner rates, and none are learned; "
            f"drop it, or learn them with --learn-inner-lr."
        )
    if not 0 <= cfg.min_meta_lr <= torch.finfo(torch.float32).max:
        raise ValueError(f"--min-meta-lr {cfg.min_meta_lr:g} must be a finite number >= 0, e.g. 1e-05 (the default).")
    if cfg.meta_lr_schedule != "constant" and cfg.min_meta_lr > cfg.meta_lr:
        raise ValueError(
            f"--min-meta-lr {cfg.min_meta_lr:g} is above --meta-lr {cfg.meta_lr:g}, where the {cfg.meta_lr_schedule} "
            f"schedule starts: it would anneal the meta-lr upwards; pass a --min-meta-lr below --meta-lr."
        )
    if len(cfg.inner_adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.inner_adam_betas):
        betas = ",".join(f"{b:g}" for b in cfg.inner_adam_betas)
        raise ValueError(f"--inner-adam-betas {betas} must be two numbers in [0, 1), e.g. 0.9,0.999 (the default).")
    mode = maml.Mode.of(cfg.mode)  # what the mode differentiates, as the engine says
    if not mode.unrolled and cfg.msl_fraction > 0:
        raise ValueError(
            f"--msl-fraction {cfg.msl_fraction:g} weighs the query losses of an unrolled inner loop, and --mode "
            f"{cfg.mode} unrolls none; drop it, or pick another --mode."
        )
    if not mode.unrolled and cfg.first_order_fraction > 0:
        raise ValueError(
            f"--first-order-fraction {cfg.first_order_fraction:g} trains that share in first order, dropping the "
            f"second derivatives of an unrolled inner loop, and --mode {cfg.mode} differentiates none; drop it, or "
            f"pick another --mode."
        )
    if cfg.mode == "reptile" and cfg.steps == 0:
        raise ValueError(
            "--steps 0 with --mode reptile: Reptile's meta-gradient is the meta-parameters minus the weights the "
            "inner steps adapt, which 0 steps leave where they are, so it is zero and nothing trains; pass --steps 1 "
            "or more (the reptile recipe takes 5)."
        )
    if cfg.mode == "implicit" and cfg.steps == 0:
        raise ValueError(
            "--steps 0 with --mode implicit: iMAML's meta-gradient is that of the inner problem's solution, and 0 "
            "inner steps solve nothing (the adapted weights stay the meta-parameters); pass --steps 1 or more (the "
            "imaml recipe takes 10 on sine, 16 on Omniglot)."
        )
    if not mode.unrolled and cfg.learn_inner_lr is not None:
        why = "differentiates no inner step" if cfg.mode == "reptile" else "does not depend on how the inner loop ran"
        raise ValueError(
            f"--learn-inner-lr {cfg.learn_inner_lr}: --mode {cfg.mode}'s meta-gradient {why}, so it has none for "
            f"the rates; drop it, or pick another --mode."
        )
    if not mode.unrolled and cfg.adapt != "all":
        why = (
            "iMAML's meta-gradient is that of the adapted weights"
            if cfg.mode == "implicit"
            else "Reptile moves only what the inner loop moved; its reference adapts every trainable variable"
        )
        raise ValueError(
            f"--mode {cfg.mode} needs every trained parameter adapted ({why}), and --adapt {cfg.adapt} leaves "
            f"some out, which would never train; pass --adapt all, or pick another --mode."
        )
    if cfg.compile and not mode.compiles:
        raise ValueError(
            f"--compile true with --mode {cfg.mode}: only --mode {' or '.join(maml.COMPILED_MODES)} compiles; drop "
            f"--compile or pick another --mode."
        )


# The keys only --mode implicit reads: set with another mode, they would be recorded as if they had shaped the run.
IMPLICIT_KEYS = {
    "implicit_lam": "iMAML's proximal regularisation",
    "cg_iterations": "the number of conjugate-gradient iterations of iMAML's linear solve",
}


def check_given(cfg: Any, given: Mapping[str, Path | None]) -> None:
    """Raises ValueError naming a key the user set that ``cfg``'s mode does not read.

    ``given``: the keys set by a flag (None) or a ``--config`` file (its path), not by a default or a
    recipe: ``--algorithm imaml --mode first_order`` passes, ``--mode first_order --cg-iterations 10`` does not.
    """
    if cfg.mode == "implicit":
        return
    for key, what in IMPLICIT_KEYS.items():
        if key not in given:
            continue
        value = getattr(cfg, key)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        path = given[key]
        named = f"{flag(key)} {shown}" if path is None else f"--config {path}: {key} {shown}"
        raise ValueError(
            f"{named} is {what} (--mode implicit), and --mode {cfg.mode} does not read it (it would only be "
            f"recorded in results.json); drop it, or pass --mode implicit."
        )
