"""What only running a model tells: buffers its forward pass writes, operators vmap cannot batch.

Both are properties of the model's code, not of its layer types (a parametrization, a custom
module, a fused kernel), so no type list covers them. Before a learner's first call with a
given model configuration, :func:`check_model` runs one task's forward pass (and loss) twice,
on copies of the buffers and with the random number generators forked, so the model, its
buffers and the random stream are left as they were:

- plainly, watching each buffer's version counter, which every in-place write increments:
  a module that writes its state would overwrite it with every task's fast weights (so the
  results depend on the order of tasks and calls), and under ``vmap`` the write fails;
- under ``vmap``, when the tasks would be batched: an operator without a batching rule
  (the fused recurrent kernels, ``.item()``, data-dependent shapes) moves ``"auto"`` to the
  loop and fails an explicit ``"vmap"`` with a message naming the module.
"""

from __future__ import annotations

import traceback
import warnings

import torch
from torch import Tensor, nn

from .checks import module_kind
from .forward import Params, TaskForward


def check_model(
    forward: TaskForward, params: Params, consts: Params, x: Tensor, y: Tensor, *, may_fall_back: bool
) -> bool:
    """Refuses a model whose forward pass writes its buffers, and settles the batching on ``x``'s device.

    Returns whether the support loss (the inner loss) requires grad though every tensor it was given is
    detached: it closes over a tensor on a graph, which only an autograd graph of the whole inner loop
    (second and first order, eager) differentiates.

    Args:
        forward: the learner's per-task forward pass.
        params: one task's parameters that are adapted, without a task dimension.
        consts: the shared parameters and buffers, keyed like ``named_parameters()``/``named_buffers()``.
        x: ``(1, n, *x_shape)`` one task's inputs.
        y: ``(1, n, *y_shape)`` its targets.
        may_fall_back: the batching was ``"auto"``: a model vmap cannot batch runs in a loop
            instead of failing.

    Raises:
        ValueError: the forward pass writes a buffer in place, or vmap was asked for and cannot
            batch the model.
    """
    model = forward.model
    buffers = [name for name, _ in model.named_buffers()]
    fast = {k: v.unsqueeze(0) for k, v in params.items()}
    devices = sorted({t.device.index for t in (*params.values(), x) if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        copies = {**consts, **{k: consts[k].clone() for k in buffers}}
        # An in-place write increments the version counter; assigning `.data` swaps the storage.
        before = {k: (copies[k]._version, copies[k].data_ptr()) for k in buffers}
        try:
            losses, out = forward(fast, copies, x.detach(), y.detach(), batching="loop", inner=True)
        except IndexError as e:  # e.g. cross_entropy's "Target 5 is out of bounds."
            which = "inner_loss_fn" if forward.inner_loss is not None else "loss_fn"
            raise ValueError(
                f"{which}(output, support_y) failed on the first task: {e} Class labels must be in [0, C) for a "
                f"model of C outputs; check support_y and query_y."
            ) from e
        if forward.inner_loss is None and y.is_floating_point() and out.shape != y.shape:
            warnings.warn(
                f"the model's output for one task has shape {tuple(out.shape[1:])} but its targets "
                f"{tuple(y.shape[1:])}; loss_fn broadcasts them (F.mse_loss compares every output with every "
                f"target), which is rarely meant: give the targets the output's shape.",
                UserWarning,
                stacklevel=4,
            )
        written = [k for k in buffers if (copies[k]._version, copies[k].data_ptr()) != before[k]]
        if written:
            raise ValueError(_writes_state(model, written))
        closes_over = forward.inner_loss is not None and losses.requires_grad
        if forward.resolve(x.device) != "vmap":
            return closes_over
        try:
            forward(fast, copies, x, y, batching="vmap", inner=True)
        except RuntimeError as e:
            if not _unbatchable(e):
                raise
            if not may_fall_back:
                raise ValueError(
                    f"batching='vmap' cannot batch {_module_in(model, e)} over the tasks: PyTorch's vmap has "
                    f"no rule for an operator of its forward pass. Use batching='loop', or batching='auto', "
                    f"which picks the loop for such a model. (PyTorch: {str(e).splitlines()[0]})"
                ) from e
            forward.settle(x.device, "loop")
    return closes_over


def unused_parameters(
    forward: TaskForward, params: Params, consts: Params, x: Tensor, y: Tensor, step: int
) -> frozenset[str]:
    """The adapted parameters that one task's support loss at inner step ``step`` does not use.

    Those whose gradient ``torch.autograd.grad(..., allow_unused=True)`` gives as None: the loss
    does not depend on them (or only through a detached or non-differentiable op). ``torch.optim``
    skips such a parameter (no weight decay, no state), and so does the inner loop
    (``rules.BoundRule.update``). A property of the model's code, found on the first task with the
    random number generators forked, so the random stream is left as it was.

    Args:
        forward: the learner's per-task forward pass.
        params: one task's adapted parameters, without a task dimension (detached).
        consts: the shared parameters and buffers (detached).
        x: ``(1, n, *x_shape)`` one task's support inputs at ``step``.
        y: ``(1, n, *y_shape)`` its targets.
        step: the inner step (0-based) whose support pass is run.
    """
    leaves = {k: v.detach().unsqueeze(0).requires_grad_() for k, v in params.items()}
    devices = sorted({t.device.index for t in (*params.values(), x) if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        losses, _ = forward(leaves, consts, x.detach(), y.detach(), batching="loop", step=step, inner=True)
        if not losses.requires_grad:  # depends on none of them (an objective of the data alone)
            return frozenset(leaves)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
    return frozenset(k for k, g in zip(leaves, grads) if g is None)


def _unbatchable(error: RuntimeError) -> bool:
    """Whether ``error`` is vmap refusing an operation (rather than an error of the model itself)."""
    message = str(error)
    return message.startswith("vmap:") or "Batching rule not implemented" in message


def _module_in(model: nn.Module, error: BaseException) -> str:
    """The innermost of ``model``'s modules running when ``error`` was raised, e.g. ``GRU 'rnn'``."""
    names = {id(m): name for name, m in model.named_modules()}
    found = "its forward pass"
    for frame, _ in traceback.walk_tb(error.__traceback__):
        module = frame.f_locals.get("self")
        if isinstance(module, nn.Module) and id(module) in names:
            found = f"{module_kind(module)} {names[id(module)]!r}"
    return found


def _writes_state(model: nn.Module, written: list[str]) -> str:
    """The error for buffers ``written`` in place by the forward pass: the module, its buffers, the fix."""
    owner_name, _, _ = written[0].rpartition(".")
    owner = model.get_submodule(owner_name)
    leaves = [name.rpartition(".")[2] for name in written if name.rpartition(".")[0] == owner_name]
    its = f"its buffer {leaves[0]!r}" if len(leaves) == 1 else f"its buffers {', '.join(map(repr, leaves))}"
    them = "it" if len(leaves) == 1 else "them"
    eval_fix = (
        "Call model.eval() if the module leaves its state alone in eval mode (spectral_norm does), or stop it"
        if owner.training
        else "Stop it"
    )
    return (
        f"{module_kind(owner)} {owner_name!r} writes {its} in place in its forward pass (in "
        f"{'training' if owner.training else 'eval'} mode): every inner step of every task would overwrite "
        f"{them} with that task's fast weights, so results would depend on the order of the tasks and calls "
        f"(and vmap cannot batch the writes). {eval_fix} from writing its state in the forward pass (a "
        f"parametrization comes off with torch.nn.utils.parametrize.remove_parametrizations)."
    )
