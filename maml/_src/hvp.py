"""Forward over reverse: one inner step's pullback for the checkpointed mode's backward pass.

The checkpointed mode (``checkpointed.py``) has two ways to pull the meta-gradient back through a
recomputed segment of inner steps, chosen by ``maml.Checkpointed(hvp=...)``:

- ``"reverse_over_reverse"`` (the default): replay the segment with ``create_graph=True`` and
  differentiate the replay again with ``torch.autograd.grad``.
- ``"forward_over_reverse"`` (this module): replay the segment for values only, then walk it
  backwards one step at a time with the step's vector-Jacobian product written out below, the
  support loss's Hessian-vector products taken in forward mode over its reverse-mode gradient
  (``torch.func.jvp`` of ``torch.func.grad``) and the update rule's Jacobian by autograd on the
  rule alone, which is elementwise and cheap. No second-order graph is ever built; peak memory
  is one step's activations and their tangents.

The math. Inner step ``k`` of one task maps the fast weights and the rule's state
``(theta_k, s_k)`` to ``(theta_{k+1}, s_{k+1}) = U(theta_k, s_k, g_k, r)``, with the support
gradient ``g_k = grad_theta L(theta_k, phi)``, the rates ``r`` and the trained parameters outside
the adapt set ``phi``. Given the cotangents ``(v, w)`` of ``(theta_{k+1}, s_{k+1})``:

    (v_U, w_k, u, r_bar) = vjp of U at (theta_k, s_k, g_k, r), applied to (v, w)    # the rule alone
    v_k      = v_U + H_theta_theta u        H = the support loss's Hessian at (theta_k, phi)
    phi_bar += H_phi_theta u                (the cross terms of the parameters outside the adapt set)
    rates   += r_bar

``H`` is symmetric, so ``H_theta_theta u`` and ``H_phi_theta u`` are both the tangent of
``(theta, phi) -> (grad_theta L, grad_phi L)`` along ``(u, 0)``: one ``jvp`` of one ``grad``.
For SGD at a fixed rate ``lr`` the rule's vjp is ``u = -lr * v`` and ``v_U = v``, so the step is
``v <- v - lr * H v``; momentum, Nesterov, Adam (its safe square root included) and learnable
rates of every layout come out of the same autograd call on the rule. A rule that is linear in
``(theta, s, g)`` (SGD, momentum: ``UpdateRule.linear``) has a vjp that does not depend on
``g_k``, so ``u`` is taken at ``g = 0`` and ``g_k``, which the rates' cotangent needs, is the
``jvp``'s primal output; Adam's vjp needs ``g_k`` first, so the segment's replay keeps it, and
for a segment's last step (whose output the forward pass kept) it is computed once more.

Why a choice and not the only backward: forward-over-reverse needs a forward-mode derivative
of every operator's backward and runs the support loss under ``torch.func`` transforms. PyTorch
lacks the first for some losses (``F.huber_loss``, ``F.soft_margin_loss``: "Trying to use forward
AD with huber_loss_backward") and the second refuses a custom ``autograd.Function`` without
``setup_context`` and any saved-tensor hooks around the backward pass
(``torch.autograd.graph.save_on_cpu``); reverse-over-reverse takes all three. So the default
stays reverse over reverse, which runs every model the engine runs, and this one is chosen by
name; such a failure names the switch. Both are exact, so the default can become a per-model
choice once they are timed.
Under ``vmap`` the ``jvp`` wraps ``grad`` of the summed losses of the batched forward pass
(``jvp(grad(sum(vmap(f))))``), which is exact for batch, layer, group and instance norm (unlike
reverse-over-reverse batching rules, pytorch/functorch#534).

A support target without a tangent trips a PyTorch bug in some losses' forward derivatives
(``F.mse_loss``: "ZeroTensors are immutable"), so a floating-point target enters the ``jvp`` as a
primal with a zero tangent; integer targets (class labels) have no tangent at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from .forward import Params, TaskForward
from .rates import InnerRates
from .rules import BoundRule, State

__all__ = ["HessianProducts", "rule_vjp", "step_vjp", "support_hvp"]


# hvp(fast (T, *shape), tangent (T, *shape)) -> (support gradient (T, *shape), H_theta_theta tangent
# (T, *shape), H_phi_theta tangent keyed like the trained parameters, summed over the tasks)
HessianProducts = Callable[[Params, Params], tuple[Params, Params, Params]]

# What PyTorch says when the jvp over grad cannot run: an operator without a forward-mode derivative, a
# custom autograd.Function without setup_context, saved-tensor hooks (e.g. save_on_cpu) around the call.
# What PyTorch says where the forward-mode pass cannot run; the last: a loss of a float output and
# integer targets (F.mse_loss with Long targets), whose tangent forward mode types like the targets.
_UNSUPPORTED = ("forward AD", "functorch transforms", "saved tensor hooks", "can't be cast to the desired output type")


def support_hvp(
    forward: TaskForward,
    consts: Params,
    trained: Params,
    x: Tensor,
    y: Tensor,
    fast: Params,
    tangent: Params,
    *,
    step: int = 0,
) -> tuple[Params, Params, Params]:
    """The support gradient at ``fast`` and the support loss's Hessian times ``tangent``, forward over reverse.

    Args:
        forward: the per-task forward pass (vmap or loop).
        consts: shared parameters and buffers held constant.
        trained: shared parameters whose cross terms are wanted (no task dimension).
        x: ``(T, n, *x_shape)`` support inputs.
        y: ``(T, n, *y_shape)`` support targets.
        fast: ``(T, *shape)`` fast weights (values).
        tangent: ``(T, *shape)`` the direction ``u``.
        step: the inner step (for a model that takes ``step``).

    Returns:
        ``grad_theta L`` ``(T, *shape)``, ``H_theta_theta u`` ``(T, *shape)`` and ``H_phi_theta u``
        (shaped like ``trained``), where ``L`` is the sum of the tasks' support losses.
    """

    def loss(theta: Params, phi: Params, target: Tensor) -> Tensor:
        losses, _ = forward(theta, {**consts, **phi}, x, target, step=step, inner=True)  # (T,)
        return losses.sum()

    def gradients(theta: Params, target: Tensor) -> tuple[Params, Params]:
        return torch.func.grad(loss, argnums=(0, 1))(theta, trained, target)

    # Dual tensors need memory of their own: the first step's fast weights are an expanded view.
    fast = {k: v.contiguous() for k, v in fast.items()}
    tangent = {k: v.contiguous() for k, v in tangent.items()}
    try:
        if y.is_floating_point():  # a zero tangent, not none: see the module docstring (mse_loss)
            (g, _), (h_fast, h_trained) = torch.func.jvp(gradients, (fast, y), (tangent, torch.zeros_like(y)))
        else:
            (g, _), (h_fast, h_trained) = torch.func.jvp(lambda theta: gradients(theta, y), (fast,), (tangent,))
    except RuntimeError as e:
        if any(s in str(e) for s in _UNSUPPORTED):
            raise RuntimeError(
                f"Checkpointed(hvp='forward_over_reverse') takes the support loss's Hessian-vector products "
                f"with torch.func.jvp over torch.func.grad, which cannot run here: {e} Use "
                f"maml.Checkpointed(hvp='reverse_over_reverse') (the default), which needs neither forward-mode "
                f"derivatives nor torch.func."
            ) from e
        raise
    return g, h_fast, h_trained


def rule_vjp(
    rule: BoundRule,
    rates: InnerRates,
    rate_values: Params,
    step: int,
    inputs: tuple[Params, State, Params],
    cotangents: tuple[Params, State],
    *,
    wrt_inputs: bool = True,
    wrt_rates: bool = False,
    unused: frozenset[str] = frozenset(),
) -> tuple[Params, State, Params, Params]:
    """The update rule's vector-Jacobian product at one step, by autograd on the rule alone.

    Args:
        rule, rates, rate_values, step: the rule and the step's rates (``rates.at(rate_values, step)``).
        inputs: ``(fast, state, grads)``, ``(T, *shape)`` the step's inputs (values).
        cotangents: ``(cot_fast, cot_state)``, ``(T, *shape)`` cotangents of the step's new fast weights and state.
        wrt_inputs: pull back to ``(fast, state, grads)``.
        wrt_rates: pull back to the learnable rates.
        unused: the parameters the step's support loss does not use, which the rule leaves as they are
            (``BoundRule.update``).

    Returns:
        The cotangents of ``fast``, ``state`` and ``grads`` (``(T, *shape)``; empty without
        ``wrt_inputs``) and of ``rate_values`` (keyed like it; empty without ``wrt_rates``).
    """
    (fast, state, grads), (cot_fast, cot_state) = inputs, cotangents
    names = tuple(fast)
    with torch.enable_grad():
        fast_in = {k: v.detach().requires_grad_(wrt_inputs) for k, v in fast.items()}
        state_in = tuple({k: v.detach().requires_grad_(wrt_inputs) for k, v in s.items()} for s in state)
        grads_in = {k: v.detach().requires_grad_(wrt_inputs) for k, v in grads.items()}
        rates_in = {k: v.detach().requires_grad_(wrt_rates) for k, v in rate_values.items()}
        new_fast, new_state = rule.update(rates_in, grads_in, state_in, fast_in, step, rates.at(rates_in, step), unused)
        inputs: list[Tensor] = []
        if wrt_inputs:
            inputs += [*fast_in.values(), *(s[k] for s in state_in for k in names), *grads_in.values()]
        if wrt_rates:
            inputs += list(rates_in.values())
        outputs = [*new_fast.values(), *(s[k] for s in new_state for k in names)]
        cotangents = [*cot_fast.values(), *(s[k] for s in cot_state for k in names)]
        # A new state that does not depend on the inputs has nothing to pull back.
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        pulled = torch.autograd.grad(
            [o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True, materialize_grads=True
        )
    n, n_state = len(names), len(names) * len(state)
    if not wrt_inputs:
        return {}, (), {}, dict(zip(rate_values, pulled))
    cot_in = dict(zip(names, pulled[:n]))
    cot_state_in = tuple(dict(zip(names, pulled[n + i : n + i + n])) for i in range(0, n_state, n))
    cot_grads = dict(zip(names, pulled[n + n_state : 2 * n + n_state]))
    return cot_in, cot_state_in, cot_grads, dict(zip(rate_values, pulled[2 * n + n_state :]))


def step_vjp(
    hvp: HessianProducts,
    support_grad: Callable[[Params], Params],
    rule: BoundRule,
    rates: InnerRates,
    rate_values: Params,
    step: int,
    fast: Params,
    state: State,
    grads: Params | None,
    cot_fast: Params,
    cot_state: State,
    *,
    want_rates: bool,
    unused: frozenset[str] = frozenset(),
) -> tuple[Params, State, Params, Params]:
    """One inner step's pullback: ``v_k = v_U + H u``, ``phi_bar = H_phi_theta u`` (module docstring).

    Args:
        hvp: the step's Hessian products (its random-number state restored by the caller's closure).
        support_grad: the step's support gradient at given fast weights (values), for a nonlinear
            rule whose ``grads`` were not kept.
        rule, rates, rate_values, step: the update rule and the step's rates.
        fast, state: ``(T, *shape)`` the fast weights and the rule's state entering the step.
        grads: ``(T, *shape)`` the step's support gradient, or ``None`` if not at hand.
        cot_fast, cot_state: ``(T, *shape)`` cotangents of the step's outputs.
        want_rates: pull back to the learnable rates too.
        unused: the parameters the step's support loss does not use (``TaskForward.unused``).

    Returns:
        The cotangents of ``fast`` and ``state`` entering the step (``(T, *shape)``), of the rates
        (keyed like ``rate_values``; empty unless ``want_rates``) and of the trained parameters
        outside the adapt set (keyed as ``hvp`` returns them).
    """
    pull = functools.partial(rule_vjp, rule, rates, rate_values, step, unused=unused)  # the rule's vjp at this step
    cotangents = (cot_fast, cot_state)
    if grads is None and not rule.linear:
        grads = support_grad(fast)
    if grads is None:
        # A linear rule's vjp does not depend on the gradient's value: take it at 0, and the
        # rates' cotangent (which does depend on it) at the gradient the jvp returns.
        zeros = {k: torch.zeros_like(v) for k, v in fast.items()}
        cot_in, cot_state_in, u, _ = pull((fast, state, zeros), cotangents)
        grads, h_fast, h_trained = hvp(fast, u)
        cot_rates = {}
        if want_rates:
            cot_rates = pull((fast, state, grads), cotangents, wrt_inputs=False, wrt_rates=True)[3]
    else:
        cot_in, cot_state_in, u, cot_rates = pull((fast, state, grads), cotangents, wrt_rates=want_rates)
        _, h_fast, h_trained = hvp(fast, u)
    return {k: v + h_fast[k] for k, v in cot_in.items()}, cot_state_in, cot_rates, h_trained
