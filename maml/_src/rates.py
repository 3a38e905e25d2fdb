"""The inner rates: one representation for every execution path.

A learner's learnable rates are a ``dict[str, Tensor]`` (its ``rate_parameters``); which
rate a parameter takes at an inner step is a pure function of that dict, :meth:`InnerRates.at`.
The eager, checkpointed and compiled paths all call it, on the live parameters or on the
values a transform hands them.

- ``None``: the fixed float ``inner_lr`` for every parameter.
- ``"scalar"``: one learnable rate, key ``"inner_lr"``, shape ``()``.
- ``"per_parameter"`` (Meta-SGD, Li et al. 2017): a learnable rate tensor shaped like each
  adapted parameter, keyed by its name.
- ``"per_layer_per_step"`` (MAML++'s LSLR, Antoniou et al. 2019): one learnable rate per
  adapted parameter tensor and inner step, ``(steps,)`` keyed by its name. A call with more
  inner steps than the learner was built with uses the last step's rate for the extra steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["LEARN_INNER_LR", "InnerRates"]

LEARN_INNER_LR: tuple[str | None, ...] = (None, "scalar", "per_parameter", "per_layer_per_step")


@dataclasses.dataclass(frozen=True)
class InnerRates:
    """How the inner rates are laid out.

    Attributes:
        kind: one of :data:`LEARN_INNER_LR`.
        inner_lr: the fixed rate, or every learnable rate's initial value.
        names: the adapted parameters' names.
    """

    kind: str | None
    inner_lr: float
    names: tuple[str, ...]

    def init(self, params: Mapping[str, Tensor], steps: int) -> dict[str, Tensor]:
        """The learnable rates' initial values (empty when the rate is fixed).

        Args:
            params: the model's parameters (the rates take their dtype and device).
            steps: inner steps; ``"per_layer_per_step"`` learns one rate per step (at least one).
        """
        if self.kind is None:
            return {}
        if self.kind == "scalar":
            p = params[self.names[0]]
            return {"inner_lr": torch.tensor(self.inner_lr, dtype=p.dtype, device=p.device)}
        if self.kind == "per_parameter":
            return {n: torch.full_like(params[n], self.inner_lr) for n in self.names}
        return {n: params[n].new_full((max(steps, 1),), self.inner_lr) for n in self.names}

    def at(
        self, values: Mapping[str, Tensor], step: int, names: Sequence[str] | None = None
    ) -> dict[str, float | Tensor]:
        """Each adapted parameter's rate at inner step ``step`` (0-based).

        Args:
            values: the learnable rates, keyed as :meth:`init` keys them.
            step: the inner step.
            names: the parameters to give rates for (default: every adapted one).
        """
        names = self.names if names is None else names
        if self.kind is None:
            return {n: self.inner_lr for n in names}
        if self.kind == "scalar":
            return {n: values["inner_lr"] for n in names}
        if self.kind == "per_parameter":
            return {n: values[n] for n in names}
        return {n: values[n][min(step, values[n].shape[0] - 1)] for n in names}

    def reported(self, values: Mapping[str, Tensor]) -> dict[str, float | Tensor]:
        """Each adapted parameter's rate over all steps: a float, or its learnable tensor (``(steps,)`` per step)."""
        if self.kind == "per_layer_per_step":
            return {n: values[n] for n in self.names}
        return self.at(values, 0)  # one rate for every step

    @property
    def hint(self) -> str:
        """The rate setting to name in an error about the inner loop (a NaN/Inf loss)."""
        return f"learn_inner_lr={self.kind!r}" if self.kind else f"inner_lr={self.inner_lr}"
