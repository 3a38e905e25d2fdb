"""The networks of experiments.omniglot and experiments.images (cbfinn/maml's and the max-pool net), loss, accuracy."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maml.nn import StepBatchNorm2d, StepSequential

__all__ = ["NETWORKS", "REFERENCE_MAXPOOL", "LOSSES", "BatchNormOffset", "build_model", "meta_only", "loss_function"]

NETWORKS = ("strided", "maxpool")
REFERENCE_MAXPOOL = "reference_maxpool"  # cbfinn/maml's mini-ImageNet net (for experiments.images)
LOSSES = ("reference", "mean")


class SameConv2d(nn.Conv2d):
    """A convolution with TensorFlow's ``'SAME'`` padding, the odd pixel at the bottom and right (``padding=1`` pads
    both sides, which moves a stride-2 grid by one pixel)."""

    def forward(self, x: Tensor) -> Tensor:
        pad: list[int] = []
        for size, k, s in reversed(list(zip(x.shape[-2:], self.kernel_size, self.stride))):  # F.pad: last dim first
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pad += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pad))


class BatchNormOffset(nn.Module):
    """``tf.contrib.layers.batch_norm`` as the reference calls it: every pass's batch statistics, an offset
    ``(C,)``, no scale, epsilon 1e-3. The reference keeps the offset out of ``weights``: the inner loop leaves it."""

    def __init__(self, channels: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.offset = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        # Added, not batch_norm's bias: the double backward of a bias without a weight fails (PyTorch 2.15).
        return F.batch_norm(x, None, None, training=True, eps=self.eps) + self.offset[:, None, None]


class MeanPool(nn.Module):
    """``(n, C, H, W) -> (n, C)``: the reference's ``reduce_mean(hidden4, [1, 2])``."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean((-2, -1))


def build_model(
    ways: int,
    filters: int = 64,
    network: str = "strided",
    per_step_bn: int | None = None,
    *,
    channels: int = 1,
    side: int = 28,
) -> nn.Module:
    """The conv net of 4 blocks for ``(n, channels, side, side)`` images and ``ways`` classes.

    ``strided``, the reference's Omniglot net (``maml.py --max_pool False``): [3x3 conv, stride 2, 'SAME';
    :class:`BatchNormOffset`; ReLU], 28 -> 14 -> 7 -> 4 -> 2, the spatial mean, a linear layer; convolutions
    Xavier-uniform, the output layer standard normal, biases 0. ``reference_maxpool``, its mini-ImageNet net
    (``--max_pool True``): [3x3 conv, stride 1; :class:`BatchNormOffset`; ReLU; 2x2 max-pool], flattened, a linear
    layer; all weights Xavier-uniform, biases 0. ``maxpool``, learn2learn's and MAML++'s: [3x3 conv; affine batch
    norm; ReLU; 2x2 max-pool], PyTorch's initialisation, all adapted. ``per_step_bn``: the inner steps of MAML++'s
    per-step batch norm (BNWB), a :class:`maml.nn.StepBatchNorm2d` in place of each batch norm, meta-only.
    """
    if network not in (*NETWORKS, REFERENCE_MAXPOOL):
        raise ValueError(f"network {network!r} is not one of {', '.join((*NETWORKS, REFERENCE_MAXPOOL))}.")
    blocks: list[nn.Module] = []
    for i in range(4):
        inputs = channels if i == 0 else filters
        if network == "maxpool":
            blocks += [
                nn.Conv2d(inputs, filters, 3, padding=1),
                # per-task batch statistics, as in MAML
                nn.BatchNorm2d(filters, track_running_stats=False)
                if per_step_bn is None
                else StepBatchNorm2d(filters, per_step_bn),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            continue
        # 'SAME' at stride 1 is one pixel each side
        conv = SameConv2d(inputs, filters, 3, stride=2) if network == "strided" else nn.Conv2d(inputs, filters, 3, 1, 1)
        nn.init.xavier_uniform_(conv.weight)
        nn.init.zeros_(conv.bias)
        norm = BatchNormOffset(filters) if per_step_bn is None else StepBatchNorm2d(filters, per_step_bn, eps=1e-3)
        blocks += [conv, norm, nn.ReLU()] + ([] if network == "strided" else [nn.MaxPool2d(2)])
    pooled = side // 16  # four 2x2 pools, each rounding down ('VALID')
    head = nn.Linear(filters if network == "strided" else filters * pooled * pooled, ways)
    stack = nn.Sequential if per_step_bn is None else StepSequential
    if network != "maxpool":
        # tf.random_normal (std 1) in the Omniglot net, xavier_initializer in the mini-ImageNet net
        (nn.init.normal_ if network == "strided" else nn.init.xavier_uniform_)(head.weight)
        nn.init.zeros_(head.bias)
    return stack(*blocks, MeanPool() if network == "strided" else nn.Flatten(), head)


def meta_only(model: nn.Module) -> set[str]:
    """Names of the parameters the inner loop leaves alone: those of the batch-norm offsets, per-step batch norms."""
    return {
        f"{m}.{p}"
        for m, layer in model.named_modules()
        if isinstance(layer, (BatchNormOffset, StepBatchNorm2d))
        for p, _ in layer.named_parameters(recurse=False)
    }


def loss_function(loss: str, ways: int, shots: int | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-task classification loss ``(n, ways)`` logits, ``(n,)`` labels -> ``()``.

    ``"reference"``: the reference's ``softmax_cross_entropy_with_logits / K`` is a vector, and ``tf.gradients``
    differentiates its sum: the summed cross-entropy over ``K``, ``ways`` times the mean with K images per class (its
    ``update_lr`` 0.4 is 2.0 on the mean), written as ``ways * mean``. With ``shots``, the sum over ``K = shots`` on
    any set: ``ways * Q / K`` times the mean on ``Q`` query images per class (mini-ImageNet's meta-gradient is
    clipped at that scale). ``"mean"``: ``F.cross_entropy``.
    """
    if loss == "mean":
        return F.cross_entropy
    if loss != "reference":
        raise ValueError(f"loss {loss!r} is not one of {', '.join(LOSSES)}.")
    if shots is not None:
        return functools.partial(_summed_cross_entropy, shots=shots)
    return functools.partial(_reference_cross_entropy, ways=ways)


def _reference_cross_entropy(logits: Tensor, y: Tensor, ways: int) -> Tensor:
    return ways * F.cross_entropy(logits, y)


def _summed_cross_entropy(logits: Tensor, y: Tensor, shots: int) -> Tensor:
    return F.cross_entropy(logits, y, reduction="sum") / shots


def accuracy(logits: Tensor, y: Tensor) -> Tensor:
    """``(T, n, ways)`` logits, ``(T, n)`` labels -> ``(T,)`` per-task accuracy."""
    return (logits.argmax(-1) == y).float().mean(-1)
