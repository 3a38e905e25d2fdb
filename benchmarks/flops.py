"""Floating-point operations of a function, counted once whatever the batching.

``torch.utils.flop_counter.FlopCounterMode`` counts a convolution's backward pass
(``aten.convolution_backward``) as a transposed convolution for the input's gradient plus a
convolution of the input with the output's gradient for the weight's gradient. The second term
ignores ``groups``: it multiplies all input channels by all output channels, where a grouped
convolution only multiplies the channels within each group, so the weight's gradient of a
convolution with ``groups=G`` is counted ``G`` times over (torch 2.14; the forward formula and the
input's gradient are right, because the weight's shape already holds the channels per group).

``vmap`` turns a convolution whose weights carry a task dimension (the fast weights of T tasks)
into one convolution with ``groups=T``, so every weight gradient of a vmapped meta-step, in the
inner loop, its backward and its double backward, was counted T times: the 5-way Omniglot
workload's vmap row (32 tasks) came to 1822 GFLOP against 167 GFLOP for the same step as a
per-task loop. :func:`count_flops` counts with the weight-gradient term divided by ``groups``,
which makes a vmapped step's count equal to the loop's (``tests/tools/test_benchmark_flops.py``) and
also counts a model's own grouped convolutions right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

__all__ = ["conv_backward_flop", "count_flops", "flop_counter"]


def _t(shape: Any) -> list[int]:
    """The shape with its first two dimensions swapped (batch and channels)."""
    return [shape[1], shape[0], *shape[2:]]


def conv_backward_flop(
    grad_out_shape: Any,
    x_shape: Any,
    w_shape: Any,
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    groups: int,
    output_mask: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """``aten.convolution_backward``'s FLOPs: PyTorch's formula with the weight's gradient divided by ``groups``."""
    flops = 0
    if output_mask[0]:  # the input's gradient: a transposed convolution of grad_out with the weight (right as is)
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:  # the weight's gradient: per group, C_in/G x C_out/G channel pairs, not C_in x C_out
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        flops += conv_flop_count(_t(a), _t(b), _t(out_shape[1]), transposed=False) // groups
    return flops


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (no display) with :func:`conv_backward_flop` for grouped convolutions."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flop})


def count_flops(fn: Callable[[], object]) -> int:
    """The FLOPs that ``fn()`` runs (matrix products, convolutions, attention; see ``FlopCounterMode``)."""
    counter = flop_counter()
    with counter:
        fn()
    return counter.get_total_flops()
