"""The functional core: per-task losses at stacked fast weights, and the inner SGD loop.

Fast weights are a ``dict[str, Tensor]`` keyed by ``named_parameters()`` names, each tensor
stacked on a leading task dimension: ``(T, *param.shape)``. Only the forward pass is batched
over tasks; every gradient is taken outside ``vmap`` by ``torch.autograd`` on the batched
graph. That is what keeps second order exact with batch, layer and instance norm, whose
reverse-over-reverse batching rules under ``vmap`` are wrong (pytorch/functorch#534).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call

Params = dict[str, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
Rates = Mapping[str, float | Tensor]
Batching = Literal["auto", "vmap", "loop"]
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def choose_batching(model: nn.Module, device: torch.device) -> str:
    """The faster task batching for ``model`` on ``device``: ``"vmap"`` or ``"loop"``.

    Measured with ``benchmarks/speed.py``: under ``vmap`` a convolution with per-task weights
    becomes one grouped convolution, which the CPU kernels run 2-2.5x slower than a per-task
    loop of ordinary convolutions (Omniglot conv net); everything else (linear layers, any
    layer on a GPU) is faster as one batched call (sine MLP: about 5x over the loop on the CPU).
    """
    if device.type == "cpu" and any(isinstance(m, _CONVS) for m in model.modules()):
        return "loop"
    return "vmap"


class TaskForward:
    """Per-task losses and outputs of ``model`` at per-task parameters.

    Args:
        model: the network; only its structure is used, its parameters are never read here.
        loss_fn: ``loss_fn(output, y) -> scalar`` for one task's examples.
        batching: ``"vmap"`` runs all tasks as one batched forward pass, ``"loop"`` runs
            them one after another, ``"auto"`` picks one by model and device (:func:`choose_batching`).
        chunk_size: with ``"vmap"``, at most this many tasks per batched call (``None``: all).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, batching: Batching, chunk_size: int | None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.batching = batching
        self.chunk_size = chunk_size
        self._chosen: dict[torch.device, str] = {}

    def resolve(self, device: torch.device) -> str:
        """The batching used for tensors on ``device``: ``"vmap"`` or ``"loop"``."""
        if self.batching != "auto":
            return self.batching
        if device not in self._chosen:
            self._chosen[device] = choose_batching(self.model, device)
        return self._chosen[device]

    def _one(self, fast: Params, consts: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """One task: ``x (n, *x_shape)``, ``y (n, *y_shape)`` -> loss ``()``, output ``(n, ...)``."""
        out = functional_call(self.model, {**fast, **consts}, (x,), strict=True)
        loss = self.loss_fn(out, y)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn returned {got} for one task; it must return a scalar tensor, the mean loss "
                f"over the task's examples (e.g. F.cross_entropy(out, y), or nn.MSELoss() with its "
                f"default reduction='mean')."
            )
        return loss, out

    def __call__(self, fast: Params, consts: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """All tasks.

        Args:
            fast: ``(T, *shape)`` per-task parameters.
            consts: parameters and buffers shared by all tasks (no task dimension).
            x: ``(T, n, *x_shape)`` inputs.
            y: ``(T, n, *y_shape)`` targets.

        Returns:
            ``(T,)`` losses and ``(T, n, ...)`` model outputs.
        """
        if self.resolve(x.device) == "vmap":
            names = tuple(fast)
            # A channels_last model's weights would make its layers ask, inside vmap, whether a
            # tensor is channels_last, which vmap cannot answer: batched calls get contiguous ones.
            shared = {k: v.contiguous() for k, v in consts.items()}

            # Only tensors cross the vmap boundary (a tuple, not dicts): fewer pytree passes per call.
            def one(values: tuple[Tensor, ...], xt: Tensor, yt: Tensor) -> tuple[Tensor, Tensor]:
                return self._one(dict(zip(names, values)), shared, xt, yt)

            # randomness="different": dropout draws independent masks for every task, as a loop would.
            batched = torch.func.vmap(one, randomness="different", chunk_size=self.chunk_size)
            return batched(tuple(v.contiguous() for v in fast.values()), x, y)
        # unbind has one backward node that stacks the task gradients; indexing p[t] would
        # build T full-size zero tensors per parameter in the backward pass.
        per_task = [dict(zip(fast, values)) for values in zip(*(v.unbind(0) for v in fast.values()))]
        losses, outs = zip(*(self._one(f, consts, xt, yt) for f, xt, yt in zip(per_task, x.unbind(0), y.unbind(0))))
        return torch.stack(losses), torch.stack(outs)


def check_finite(losses: Tensor, step: int, steps: int, rates_hint: str) -> None:
    """Raises a FloatingPointError naming the first task and step whose inner loss is NaN/Inf."""
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    task = int((~finite).nonzero()[0, 0])
    raise FloatingPointError(
        f"the inner (support) loss is {losses[task].item()} for task {task} at inner step {step} "
        f"(0-based, of {steps}); the fast weights diverged or the task's data holds NaN/Inf. "
        f"Lower the inner learning rate ({rates_hint}), check support_x/support_y of task {task}, "
        f"or pass check_finite=False to MetaLearner to skip this check."
    )


def sgd_step(
    forward: TaskForward,
    fast: Params,
    consts: Params,
    rates: Rates,
    x: Tensor,
    y: Tensor,
    *,
    create_graph: bool,
) -> tuple[Params, Tensor]:
    """One inner SGD step on every task: ``fast - rate * grad(support loss)``.

    Args:
        forward: the per-task forward pass.
        fast: ``(T, *shape)`` per-task parameters; each must require grad.
        consts: shared parameters and buffers.
        rates: the inner learning rate of each parameter in ``fast``: a float, a scalar
            tensor or a tensor of the parameter's shape (Meta-SGD).
        x: ``(T, n, *x_shape)`` support inputs.
        y: ``(T, n, *y_shape)`` support targets.
        create_graph: keep the gradient in the graph (second order); ``False`` treats the
            inner gradient as a constant (first order).

    Returns:
        The new fast weights and the ``(T,)`` support losses before the step (detached).
    """
    losses, _ = forward(fast, consts, x, y)
    # The tasks' losses depend on disjoint slices of `fast`, so the gradient of their sum
    # holds every task's own gradient in its slice.
    grads = torch.autograd.grad(
        losses.sum(), tuple(fast.values()), create_graph=create_graph, allow_unused=True, materialize_grads=True
    )
    new: Params = {}
    for (name, p), g in zip(fast.items(), grads):
        rate = rates[name]
        new[name] = torch.addcmul(p, rate, g, value=-1) if isinstance(rate, Tensor) else torch.add(p, g, alpha=-rate)
    return new, losses.detach()
