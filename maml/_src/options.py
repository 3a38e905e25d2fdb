"""MetaLearner's options: their types, their allowed values, and the checks of one options set.

The checks run before the learner builds anything, so a bad argument fails at construction,
naming itself; :mod:`modes` holds the rules on which options go with which mode.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from . import checks, modes, planner
from .forward import InnerLoss
from .layers import check_step_layers
from .optimizers import INNER_OPTIMIZERS, make_rule
from .rates import LEARN_INNER_LR
from .rules import UpdateRule, rule_tensors

__all__ = [
    "BATCHINGS",
    "Batching",
    "InnerOptimizer",
    "LearnInnerLr",
    "check_arguments",
    "forward_batching",
    "learned",
]

Batching = Literal["auto", "vmap", "loop"]
LearnInnerLr = Literal["scalar", "per_parameter", "per_layer_per_step"] | None
InnerOptimizer = Literal[
    "sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "radam", "rprop", "asgd"
]

BATCHINGS: tuple[str, ...] = ("auto", "vmap", "loop")


def check_arguments(
    model: Any,
    loss_fn: Any,
    inner_lr: Any,
    steps: Any,
    *,
    mode: Any,
    batching: Any,
    chunk_size: Any,
    learn_inner_lr: Any,
    compile: Any,
    adapt: Any,
    inner_optimizer: Any,
    inner_optimizer_options: Any,
    memory_budget: Any,
    inner_loss_fn: Any = None,
) -> tuple[UpdateRule, list[str]]:
    """Checks ``MetaLearner``'s arguments one by one, then which go together (:func:`modes.check_options`).

    Typed ``Any``: they come from the caller unchecked, and this is where they are checked; but
    ``mode`` is a :class:`modes.Mode` (``Mode.of`` checked it), whose options it checked itself.

    Returns:
        The update rule (``inner_optimizer`` built if it is a name) and the names of the
        parameters to adapt (``checks.adapt_set``).

    Raises:
        TypeError: an argument of the wrong type, naming it and its value.
        ValueError: a value out of range or not supported, or options that do not go together.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    checks.not_data_parallel("model", model)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, y) -> scalar, got {loss_fn!r}.")
    reads_initial = check_inner_loss(inner_loss_fn)
    checks.positive_number("inner_lr", inner_lr)
    checks.integer("steps", steps, 0)
    checks.one_of("batching", batching, BATCHINGS)
    checks.one_of("learn_inner_lr", learn_inner_lr, LEARN_INNER_LR)
    if isinstance(inner_optimizer, str):
        checks.one_of("inner_optimizer", inner_optimizer, INNER_OPTIMIZERS)
    else:
        checks.update_rule(inner_optimizer, inner_optimizer_options)
    checks.integer("chunk_size", chunk_size, 1, optional=True)
    modes.check_options(mode.name, batching=batching, chunk_size=chunk_size)
    planner.budget_bytes(memory_budget, torch.device("cpu"))  # its form; bytes are read on the call's device
    if memory_budget is not None and mode.plans is None:
        raise ValueError(
            f"memory_budget={memory_budget!r} does not apply to mode={mode.name!r}, whose memory is flat in the "
            f"steps and which runs the tasks one chunk_size at a time; drop it."
        )
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r} ({type(compile).__name__}).")
    rule = (
        make_rule(inner_optimizer, inner_optimizer_options, model, steps)
        if isinstance(inner_optimizer, str)
        else inner_optimizer
    )
    adapted = checks.adapt_set(adapt, model)
    check_step_layers(model)
    modes.check_mode(mode.name, compile=compile, learned=learned(learn_inner_lr, rule), reads_initial=reads_initial)
    return rule, adapted


def check_inner_loss(inner_loss_fn: Any) -> bool:
    """Refuses an inner loss that is not callable; returns whether it reads the initial weights (``initial=``)."""
    if inner_loss_fn is None:
        return False
    if not callable(inner_loss_fn):
        raise TypeError(
            f"inner_loss_fn must be callable as inner_loss_fn(output, y) -> scalar (with, if it names them, the "
            f"keywords fast=, initial=, params=, step=), or None for loss_fn, got {inner_loss_fn!r}."
        )
    return InnerLoss.of(inner_loss_fn).initial


def forward_batching(batching: str, chunk_size: int | None) -> str:
    """The batching ``TaskForward`` is built with: ``batching``, but ``"vmap"`` for ``"auto"`` with ``chunk_size``.

    A ``chunk_size`` asks for chunked vmap, so ``"auto"`` honours it.
    """
    return "vmap" if batching == "auto" and chunk_size is not None else batching


def learned(learn_inner_lr: LearnInnerLr, rule: UpdateRule) -> str | None:
    """What a learner built so meta-learns beside the model (learned rates, a rule's tensors), for an error; or None."""
    if learn_inner_lr:
        return f"learn_inner_lr={learn_inner_lr!r}"
    return f"the rule {type(rule).__name__}'s own tensors" if rule_tensors(rule) else None
