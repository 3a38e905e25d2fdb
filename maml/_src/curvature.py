"""Meta-Curvature (Park & Oliva, NeurIPS 2019): inner gradient descent preconditioned by a learned curvature.

Each parameter tensor's gradient ``G`` is multiplied by small learned matrices along each of its
axes before the step ``p - rate * M(G)``, as in the paper's released code (and learn2learn's
``MetaCurvatureTransform``, which follows it):

- a linear layer's ``(out, in)`` weight: ``M(G) = L @ G @ R`` with ``L`` ``(out, out)`` and ``R``
  ``(in, in)``;
- a convolution's ``(out, in, kh, kw)`` weight: ``M(G)[o, i, f] = sum L[o, o'] G[o', i', f'] R[i', i]
  F[f, f']`` over the ``kh * kw`` filter positions ``f``;
- any other tensor (biases, norm layers' scales): ``M(G) = s * G`` with ``s`` shaped like it.

Every matrix starts at the identity (``s`` at ones), so the rule starts as plain gradient
descent. The rule is linear in ``(params, grads)`` at fixed curvature, which the checkpointed
mode's forward-over-reverse backward pass uses.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from .rules import StepRates

__all__ = ["MetaCurvature"]

Params = dict[str, Tensor]


class _Curvature(nn.Module):
    """The learned curvature of one parameter tensor (see the module docstring)."""

    def __init__(self, param: Tensor) -> None:
        super().__init__()
        like = {"dtype": param.dtype, "device": param.device}
        self.shape = tuple(param.shape)
        if param.dim() in (2, 4):
            self.left = nn.Parameter(torch.eye(param.shape[0], **like))
            self.right = nn.Parameter(torch.eye(param.shape[1], **like))
            if param.dim() == 4:
                self.filter = nn.Parameter(torch.eye(param.shape[2] * param.shape[3], **like))
        else:
            self.scale = nn.Parameter(torch.ones_like(param))

    def forward(self, g: Tensor) -> Tensor:
        """``(T, *shape)`` gradients, preconditioned."""
        if len(self.shape) == 2:
            return self.left @ g @ self.right
        if len(self.shape) == 4:
            out, inp, kh, kw = self.shape
            flat = g.reshape(-1, out, inp, kh * kw)
            return torch.einsum("op,tpqf,qi,gf->toig", self.left, flat, self.right, self.filter).reshape(g.shape)
        return self.scale * g


class MetaCurvature(nn.Module):
    """Meta-Curvature's update rule for every parameter of ``model``: ``p - rate * M(g)`` with ``M`` meta-learned.

    Pass it as ``maml.MetaLearner(model, loss_fn, inner_lr, inner_optimizer=maml.MetaCurvature(model))``:
    its curvatures are then in ``learner.parameters()`` and ``learner.state_dict()`` and get
    exact meta-gradients in every mode. Build it after moving ``model`` to its device and dtype
    (or move it with ``learner.to(...)``).

    Args:
        model: the network whose parameters the inner loop adapts; each trainable parameter gets
            a curvature (an unadapted one keeps a curvature that no gradient reaches).
    """

    linear: ClassVar[bool] = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError("model has no trainable parameters, so there is nothing to precondition.")
        # Module names cannot hold "."; the parameter of each curvature is kept in ``names``.
        self.names = tuple(names)
        self.curvatures = nn.ModuleList(_Curvature(p) for name, p in model.named_parameters() if p.requires_grad)
        self._index = {name: i for i, name in enumerate(names)}

    def init(self, params: Params) -> tuple[()]:
        return ()

    def update(
        self, grads: Params, state: tuple[()], params: Params, step: int, rates: StepRates
    ) -> tuple[Params, tuple[()]]:
        """``p - rates[k] * M_k(g)`` for every adapted parameter ``k`` (``(T, *shape)`` tensors)."""
        new = {}
        for k, p in params.items():
            if k not in self._index:
                raise KeyError(
                    f"MetaCurvature has no curvature for the parameter {k!r}; build it from the model the "
                    f"learner adapts (it knows {', '.join(self.names)})."
                )
            curvature = self.curvatures[self._index[k]]
            if tuple(p.shape[1:]) != curvature.shape:
                raise ValueError(
                    f"MetaCurvature's curvature of {k!r} was built for shape {curvature.shape}, but the learner "
                    f"adapts it with shape {tuple(p.shape[1:])}; build it from the model the learner adapts."
                )
            new[k] = p - rates[k] * curvature(grads[k])
        return new, ()

    def extra_repr(self) -> str:
        return f"{len(self.names)} parameter tensors"
