"""What every execution path shares: the inner loop's pieces, and what a pass over a meta-batch returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor

from .inner import Params, TaskForward
from .rates import InnerRates
from .rules import State, UpdateRule

__all__ = ["InnerLoop", "Trace", "flatten_state", "unflatten_state"]


@dataclasses.dataclass(frozen=True)
class InnerLoop:
    """The inner loop of a learner: forward pass, update rule, rates, finiteness check.

    Attributes:
        forward: the per-task forward pass.
        rule: the update rule.
        rates: the rates' layout; ``rates.at(values, step)`` gives a step's rates.
        check: ``check(losses (T,), step, steps)`` raises on a NaN/Inf support loss, or ``None``.
    """

    forward: TaskForward
    rule: UpdateRule
    rates: InnerRates
    check: Callable[[Tensor, int, int], None] | None


@dataclasses.dataclass(frozen=True)
class Trace:
    """One pass over ``T`` tasks, as each path returns it.

    Attributes:
        query_losses: ``(T,)`` query losses at the fast weights, differentiable.
        query_out: ``(T, n_query, ...)`` outputs on the query inputs (detached).
        support_losses: ``(steps, T)`` support loss before each inner step (detached).
        fast: ``(T, *shape)`` fast weights of the adapted parameters.
        step_query_losses: ``(steps, T)`` query losses after each inner step (the last row is
            ``query_losses``), differentiable; ``None`` unless asked for (the multi-step loss).
    """

    query_losses: Tensor
    query_out: Tensor
    support_losses: Tensor
    fast: Params
    step_query_losses: Tensor | None


def flatten_state(state: State, names: tuple[str, ...]) -> list[Tensor]:
    """The rule's state as one list of tensors: every dict's tensors in ``names`` order."""
    return [d[n] for d in state for n in names]


def unflatten_state(values: list[Tensor] | tuple[Tensor, ...], names: tuple[str, ...]) -> State:
    """Inverse of :func:`flatten_state`."""
    n = len(names)
    return tuple(dict(zip(names, values[i : i + n])) for i in range(0, len(values), n))
