"""The update-rule contract (``init``/``update``), and the rule as the inner loop calls it (:class:`BoundRule`).

A rule in the optax manner: ``init(params) -> state`` and ``update(grads, state, params, step,
rates) -> (new_params, new_state)``. Every tensor is a function of its inputs (nothing is
written in place), so the meta-gradient flows through the rule and through its state. The
state is a tuple (a NamedTuple names its fields: ``maml.MomentumState``, ``maml.AdamState``)
of dicts keyed like the parameters and shaped like them, so it stacks per task exactly as the
fast weights do (``(T, *shape)``) and the checkpointed mode can keep it beside the kept iterates.

A rule that is an ``nn.Module`` may hold tensors of its own that the outer loop learns (its
parameters, e.g. :class:`~maml.MetaCurvature`'s curvature matrices). The engine passes them
beside the learnable rates, keyed ``"rule." + name``, through every execution path, and
:class:`BoundRule` puts them back into the rule by ``torch.func.functional_call`` at each
update: so they get exact meta-gradients wherever the rates do.

``torch.optim``'s optimizers are rules of this contract in ``optimizers.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from . import checks
from .functional import Reparametrized

Params = dict[str, Tensor]
State = tuple[Params, ...]
StepRates = Mapping[str, float | Tensor]

__all__ = ["RULE_PREFIX", "BoundRule", "Params", "State", "StepRates", "UpdateRule", "rule_tensors"]

RULE_PREFIX = "rule."  # the keys of a rule's own tensors among the learnable rates


class UpdateRule(Protocol):
    """What the inner step needs of an update rule.

    ``linear``: the update is linear in ``(params, state, grads)`` at fixed rates (SGD, momentum),
    so its vector-Jacobian product with respect to them does not depend on their values; the
    checkpointed mode's forward-over-reverse backward pass (``hvp.py``) then needs no support
    gradient before a step's Hessian-vector product.
    """

    linear: ClassVar[bool]

    def init(self, params: Params) -> State:
        """The rule's state before the first inner step, shaped like ``params``."""
        ...

    def update(self, grads: Params, state: State, params: Params, step: int, rates: StepRates) -> tuple[Params, State]:
        """One inner step: the new parameters and state.

        Args:
            grads: the support loss's gradient, keyed and shaped like ``params``.
            state: what :meth:`init` or the previous ``update`` returned.
            params: the current (fast) parameters.
            step: the inner step's index, 0-based.
            rates: each parameter's step size at this step: a float, a scalar tensor or a
                tensor shaped like the parameter (broadcasting over a leading task dimension).
        """
        ...


def rule_tensors(rule: UpdateRule) -> dict[str, nn.Parameter]:
    """A rule's own meta-learned tensors, keyed ``RULE_PREFIX + name`` (empty unless it is an ``nn.Module``)."""
    if not isinstance(rule, nn.Module):
        return {}
    return {RULE_PREFIX + name: p for name, p in rule.named_parameters()}


class _Update(nn.Module):
    """A rule's ``update`` as a forward pass, for ``functional_call`` (its parameters are ``rule.*``)."""

    def __init__(self, rule: nn.Module) -> None:
        super().__init__()
        self.rule = rule

    def forward(self, grads: Params, state: State, params: Params, step: int, rates: StepRates) -> tuple[Params, State]:
        return self.rule.update(grads, state, params, step, rates)


class BoundRule:
    """A rule as the inner loop calls it: its own tensors taken from the rates' values, its contract checked.

    The execution paths rebuild the state from flat tensors (the checkpointed mode keeps and
    restores it), so :meth:`update` gives the rule its state as the type its ``init`` returns
    (a NamedTuple stays one). Every path reads the rule's output by key, so :meth:`update`
    returns the new parameters in the order of the parameters it was given, whatever order the
    rule builds its dict in. The :class:`UpdateRule` contract (a pair; the parameters' keys,
    shapes, dtypes and devices; a state of dicts keyed and shaped like the parameters) is checked
    at the first call of each inner step, so a rule that breaks it fails there with a message
    naming the rule and the key, not deep inside a path.
    """

    def __init__(self, rule: UpdateRule) -> None:
        self.rule = rule
        self.linear: bool = bool(getattr(rule, "linear", False))
        self._module = Reparametrized(_Update(rule)) if rule_tensors(rule) else None
        empty = _checked_state(rule, "init", rule.init({}), {})
        self._make = getattr(type(empty), "_make", tuple)
        self._checked: set[int] = set()  # the inner steps whose first update was checked

    def init(self, params: Params) -> State:
        return _checked_state(self.rule, "init", self.rule.init(params), params)

    def update(
        self,
        values: Params,
        grads: Params,
        state: State,
        params: Params,
        step: int,
        rates: StepRates,
        unused: frozenset[str] = frozenset(),
    ) -> tuple[Params, State]:
        """The rule's step, with its own tensors from ``values`` (keys ``RULE_PREFIX + name``).

        ``unused``: the parameters the step's support loss does not use (``TaskForward.unused``): they and
        their state come out as they went in, as ``torch.optim`` skips a parameter whose ``.grad`` is None
        (higher and TorchOpt too), where a rule given their zero gradient would still decay them.
        """
        state = self._make(state)
        if self._module is None:
            out = self.rule.update(grads, state, params, step, rates)
        else:
            own = {k: v for k, v in values.items() if k.startswith(RULE_PREFIX)}
            # The buffers as they are now: a constant reassigned between calls (rule.temp = ...) takes effect.
            buffers = {RULE_PREFIX + k: b for k, b in self.rule.named_buffers()}
            out = self._module({**buffers, **own}, (grads, state, params, step, rates))
        if torch.compiler.is_compiling():
            # Checked at every trace, which is once per compilation: reading the set would make dynamo guard
            # on its contents, and the first call's add would recompile the step at the second call.
            _check_update(self.rule, out, params)
        elif step not in self._checked:
            _check_update(self.rule, out, params)
            self._checked.add(step)
        new, new_state = out
        if unused:
            new = {**new, **{k: params[k] for k in unused}}
            if len(new_state) == len(state):  # the state as it went in (a rule whose state grows keeps its new parts)
                kept = [{**part, **{k: was[k] for k in unused}} for part, was in zip(new_state, state)]
                new_state = getattr(type(new_state), "_make", tuple)(kept)
        # By key: a path that lays tensors out by position must not read a reordered dict.
        return {k: new[k] for k in params}, new_state


def _rule_name(rule: UpdateRule) -> str:
    return f"the update rule {type(rule).__name__}"


def _check_tensors(rule: UpdateRule, what: str, got: Any, params: Params) -> None:
    """``got`` must be a dict with ``params``' keys, each a tensor of its parameter's shape, dtype and device."""
    if not isinstance(got, Mapping):
        raise TypeError(
            f"{_rule_name(rule)}: {what} is a {type(got).__name__}; it must be a dict keyed like the parameters "
            f"(name -> tensor); see maml.UpdateRule."
        )
    if said := checks.key_differences(params, got):
        raise ValueError(
            f"{_rule_name(rule)}: {what} must have exactly the keys of the parameters it was given "
            f"({', '.join(map(repr, params))}); {said}."
        )
    for k, p in params.items():
        t = got[k]
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{_rule_name(rule)}: {what}[{k!r}] is a {type(t).__name__}; it must be a torch.Tensor computed "
                f"from the inputs (no numpy or Python numbers: the meta-gradient flows through it)."
            )
        if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(
                f"{_rule_name(rule)}: {what}[{k!r}] is {tuple(t.shape)} {t.dtype} on {t.device}, but the parameter "
                f"it belongs to is {tuple(p.shape)} {p.dtype} on {p.device} (a leading task dimension included); "
                f"return tensors shaped, typed and placed like the parameters."
            )


def _checked_state(rule: UpdateRule, where: str, state: Any, params: Params) -> State:
    """A rule's state: a tuple (a NamedTuple too) of dicts keyed and shaped like ``params``."""
    if not isinstance(state, tuple):
        raise TypeError(
            f"{_rule_name(rule)}: {where} returned a {type(state).__name__} as its state; it must return a "
            f"tuple of dicts keyed like the parameters (() for a rule without state); see maml.UpdateRule."
        )
    for i, part in enumerate(state):
        _check_tensors(rule, f"{where}'s state[{i}]", part, params)
    return state


def _check_update(rule: UpdateRule, out: Any, params: Params) -> None:
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            f"{_rule_name(rule)}: update returned {type(out).__name__}"
            f"{f' of {len(out)}' if isinstance(out, tuple) else ''}; it must return a pair "
            f"(new parameters, new state); see maml.UpdateRule."
        )
    _check_tensors(rule, "update's new parameters", out[0], params)
    _checked_state(rule, "update", out[1], params)
