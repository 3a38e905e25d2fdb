"""Checkpointed inner steps: keep a segment's input, recompute its steps in the backward pass.

``torch.utils.checkpoint`` cannot wrap the inner loop (its saved-tensor hooks are not allowed
under torch.func transforms, and its reentrant variant refuses ``torch.autograd.grad``), so a
segment of inner steps is one ``torch.autograd.Function``: its forward runs the steps without
building the second-order graph and keeps only its input fast weights; its backward replays
the steps with ``create_graph=True`` (same RNG state) and pulls the cotangents back through
them with ``torch.autograd.grad``. Peak memory is then the kept segment inputs plus one
segment's activations, instead of every step's activations.

A segment that returns new fast weights writes them into tensors allocated before its steps
run. Allocated after the steps, while their activations are still alive, each kept iterate
lands in the middle of the memory those activations free and splits it, so the next segment's
activations no longer fit there and glibc's heap grows by about one step's activations per
segment: a meta-training step of the Omniglot conv net (8 tasks recomputed one at a time, 40
inner steps) peaked at 1 GiB of resident memory instead of 0.28 GiB.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# run(fast_values, rate_values, replay) -> new fast values; replay=True builds the second-order graph.
SegmentFn = Callable[[Sequence[Tensor], Sequence[Tensor], bool], tuple[Tensor, ...]]
_RngState = tuple[Tensor, list[int], list[Tensor]]


def _rng_state(tensors: Sequence[Tensor]) -> _RngState:
    devices = sorted({t.device.index for t in tensors if t.is_cuda})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def _rng_restored(state: _RngState) -> Iterator[None]:
    """Replays random draws (dropout) exactly as in the forward pass, leaving the global RNG as it was."""
    cpu, devices, cuda = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        for device, s in zip(devices, cuda):
            torch.cuda.set_rng_state(s, device)
        yield


class _Segment(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, run: SegmentFn, n_fast: int, returns_fast: bool, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.run, ctx.n_fast = run, n_fast
        ctx.rng = _rng_state(inputs)
        ctx.save_for_backward(*inputs)
        detached = [t.detach() for t in inputs]
        # Allocated before the steps' activations, so the kept iterates cannot split the memory
        # those free (see the module docstring).
        kept = [torch.empty_like(t) for t in detached[:n_fast]] if returns_fast else []
        with torch.enable_grad():
            out = run(detached[:n_fast], detached[n_fast:], False)
        if returns_fast:
            return tuple(k.copy_(t) for k, t in zip(kept, out, strict=True))
        return tuple(t.detach() for t in out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *cotangents: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        needs = ctx.needs_input_grad[3:]
        # Fast weights always need grad: the replayed inner steps differentiate with respect to them.
        inputs = [t.detach().requires_grad_(i < ctx.n_fast or needs[i]) for i, t in enumerate(ctx.saved_tensors)]
        with torch.enable_grad(), _rng_restored(ctx.rng):
            out = ctx.run(inputs[: ctx.n_fast], inputs[ctx.n_fast :], True)
        wanted = [i for i, need in enumerate(needs) if need]
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], cotangents, allow_unused=True)
        result: list[Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, None, None, *result)


def checkpointed_segment(
    run: SegmentFn, fast: Sequence[Tensor], rates: Sequence[Tensor], *, returns_fast: bool = True
) -> tuple[Tensor, ...]:
    """Runs ``run`` on ``(fast, rates)`` keeping only those inputs for the backward pass.

    Args:
        run: the segment's inner steps; called with ``replay=False`` once in the forward pass
            (values only) and with ``replay=True`` in the backward pass (second-order graph).
        fast: ``(T, *shape)`` fast weights entering the segment.
        rates: learnable inner-rate tensors the steps use.
        returns_fast: ``run`` returns new fast weights, shaped like ``fast``; ``False`` for a
            segment that returns anything else (e.g. the query losses).

    Returns:
        What ``run`` returns (the fast weights leaving the segment), differentiable with
        respect to ``fast`` and ``rates`` with exactly the second-order meta-gradient.
    """
    return _Segment.apply(run, len(fast), returns_fast, *fast, *rates)
