"""Layers for models that know the inner step: MAML++'s per-step batch-norm weights and biases (BNWB), and a
``Sequential`` that hands the step to the layers that take it.

A model whose ``forward`` takes ``step`` gets the inner step's index in every pass of the
inner loop (``forward.takes_step``); it hands it to these layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .forward import takes_step

__all__ = ["StepBatchNorm2d", "StepSequential", "check_step_layers"]


class StepBatchNorm2d(nn.Module):
    """Batch norm over ``(N, C, H, W)`` with a weight and a bias for each inner step (Antoniou et al., 2019).

    Normalises with the batch's statistics (every pass: support and query sets alike, as
    MAML++'s code does with its per-step statistics off), then scales and shifts by the step's
    row of ``weight`` and ``bias``, both ``(steps, C)``. A step past the last row uses the last
    row (more steps at test time than in training). Nothing is written during a pass, so it is
    exact in every mode of the engine.

    Args:
        num_features: channels ``C``.
        steps: inner steps with their own weights (the learner's ``steps``).
        eps: added to the variance.
    """

    def __init__(self, num_features: int, steps: int, eps: float = 1e-5) -> None:
        super().__init__()
        for name, value in (("num_features", num_features), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepBatchNorm2d: {name}={value!r} must be an int >= 1.")
        if (
            isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0
        ):  # not NaN, not a negative variance
            raise ValueError(f"StepBatchNorm2d: eps={eps!r} must be a number > 0 (e.g. the default 1e-5).")
        self.num_features, self.steps, self.eps = num_features, steps, eps
        self.weight = nn.Parameter(torch.ones(steps, num_features))
        self.bias = nn.Parameter(torch.zeros(steps, num_features))

    def forward(self, x: Tensor, step: int = 0) -> Tensor:
        """``x`` ``(N, C, H, W)`` normalised, then scaled and shifted by inner step ``step``'s weight and bias."""
        k = min(step, self.steps - 1)
        return F.batch_norm(x, None, None, self.weight[k], self.bias[k], training=True, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, steps={self.steps}, eps={self.eps}"


class StepSequential(nn.Sequential):
    """``nn.Sequential`` whose ``forward`` takes the inner step and hands it to the layers whose ``forward`` takes ``step``.

    So a stack with :class:`StepBatchNorm2d` layers is one module the learner passes the step
    to (``MetaLearner`` sees the ``step`` keyword of this ``forward``); the other layers are
    called as usual.
    """

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self._takes_step = [takes_step(layer) for layer in self]

    def forward(self, x: Tensor, step: int = 0) -> Tensor:  # type: ignore[override]
        """``x`` through every layer, ``step`` to those that take it."""
        if len(self._takes_step) != len(self):  # layers appended or deleted since
            self._takes_step = [takes_step(layer) for layer in self]
        for layer, takes in zip(self, self._takes_step):
            x = layer(x, step=step) if takes else layer(x)
        return x


def check_step_layers(model: nn.Module) -> None:
    """Refuses a :class:`StepBatchNorm2d` that the inner step cannot reach: it would use step 0's weights at every step.

    The step reaches a layer through the model's ``forward`` (which must take ``step``) and every
    container on the way: a plain ``nn.Sequential`` calls its layers without it. A custom module
    in between is trusted to hand it on.
    """
    sequential = {name for name, m in model.named_modules() if type(m) is nn.Sequential}
    for name, m in model.named_modules():
        if not isinstance(m, StepBatchNorm2d):
            continue
        parts = name.split(".")
        blocked = next((p for p in (".".join(parts[:i]) for i in range(len(parts))) if p in sequential), None)
        if blocked is not None or not takes_step(model):
            if blocked is None:
                where = f"the model's forward ({type(model).__name__}.forward)"
            else:
                where = "the model, a plain nn.Sequential," if blocked == "" else f"the nn.Sequential {blocked!r}"
            raise ValueError(
                f"StepBatchNorm2d {name!r} takes the inner step, but {where} does not pass it on, so every step "
                f"would use step 0's weight and bias; build the stack with maml.nn.StepSequential, or give "
                f"forward a `step` keyword and hand it to the layer."
            )
