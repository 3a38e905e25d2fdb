"""A learner's state beyond its options: the model's, the learnable rates', a module rule's, the batching chosen.

``MetaLearner.state_dict``, ``load_state_dict`` and ``to`` act on all of it together, so
that a checkpoint restores and a move places every meta-parameter, not the model's alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import checks
from .forward import TaskForward
from .hyperparameters import HyperparameterRule
from .planner import Planner
from .rules import UpdateRule

__all__ = ["load_state", "move", "rule_identity", "save_state"]


def save_state(
    model: nn.Module, rates: dict[str, nn.Parameter], rule: UpdateRule, forward: TaskForward, planner: Planner
) -> dict[str, Any]:
    """The state ``MetaLearner.state_dict`` returns: ``model``, ``inner_lrs``, ``batching``, ``plans``,
    ``inner_optimizer`` (:func:`rule_identity`) and, for a rule with tensors of its own, ``rule``."""
    state = {
        "model": model.state_dict(),
        "inner_lrs": {k: v.detach().clone() for k, v in rates.items()},
        "batching": forward.chosen,
        "plans": {k: dict(v) for k, v in planner.measured.items()},  # what the planner measured: a resume plans alike
        # Which rule the tensors of state["rule"] belong to: RMSprop's learned alpha and ASGD's have one key and
        # shape, and mean different things (0.99 and 99 from one raw value).
        "inner_optimizer": rule_identity(rule),
    }
    if _has_state(rule):
        state["rule"] = rule.state_dict()  # type: ignore[union-attr]
    return state


def load_state(
    state: Any,
    model: nn.Module,
    rates: dict[str, nn.Parameter],
    rule: UpdateRule,
    given: Any,
    forward: TaskForward,
    planner: Planner,
) -> None:
    """Loads what :func:`save_state` returned into these, after checking all of it (``checks.learner_state``).

    ``given``: the learner's ``inner_optimizer`` (a name, or the rule), to name the rule in the errors.
    """
    module = rule if _has_state(rule) else None
    rule_name = given if isinstance(given, str) else type(rule).__name__
    checks.learner_state(state, model.state_dict(), dict(rates), module, rule_name, rule_identity(rule))
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for k, v in state["inner_lrs"].items():
            rates[k].copy_(v)
    forward.chosen = state.get("batching", {})  # absent from checkpoints of earlier versions
    planner.measured.update({k: dict(v) for k, v in state.get("plans", {}).items()})  # checked: non-negative ints
    if module is not None:
        module.load_state_dict(state["rule"])


def rule_identity(rule: UpdateRule) -> dict[str, Any]:
    """What a saved state records of its rule: its class (name and module) and the options it learns, sorted."""
    learned = sorted(rule.learned) if isinstance(rule, HyperparameterRule) else []
    return {"class": type(rule).__name__, "module": type(rule).__module__, "learned": learned}


def _has_state(rule: UpdateRule) -> bool:
    """Whether the rule keeps tensors of its own (a module rule; a rule with fixed options keeps none)."""
    return isinstance(rule, nn.Module) and bool(rule.state_dict())


def move(model: nn.Module, rates: dict[str, nn.Parameter], rule: UpdateRule, *args: Any, **kwargs: Any) -> None:
    """Moves the model, the learnable rates (in place, so optimizers keep them) and a module rule, like ``.to``."""
    model.to(*args, **kwargs)
    if isinstance(rule, nn.Module):
        rule.to(*args, **kwargs)
    for p in rates.values():
        p.data = p.data.to(*args, **kwargs)
