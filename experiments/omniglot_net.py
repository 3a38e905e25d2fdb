"""The Omniglot networks of experiments.omniglot: the reference's strided net and the max-pool net, their loss and accuracy."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maml.nn import StepBatchNorm2d, StepSequential

__all__ = [
    "NETWORKS",
    "REFERENCE_MAXPOOL",
    "LOSSES",
    "SameConv2d",
    "BatchNormOffset",
    "MeanPool",
    "META_ONLY",
    "build_model",
    "meta_only",
    "loss_function",
    "accuracy",
]

NETWORKS = ("strided", "maxpool")
# cbfinn/maml's mini-ImageNet net (maml.py with --max_pool True): built for experiments.images, not an Omniglot --network.
REFERENCE_MAXPOOL = "reference_maxpool"
LOSSES = ("reference", "mean")


class SameConv2d(nn.Conv2d):
    """A convolution with TensorFlow's ``'SAME'`` padding: ``ceil(size / stride)`` outputs per side.

    TensorFlow pads ``(out - 1) * stride + kernel - size`` pixels in all and puts the odd one at
    the bottom and right; ``nn.Conv2d(padding=1)`` pads both sides, which moves a stride-2 grid
    by one pixel. The shapes of the reference's Omniglot net: 28 -> 14 -> 7 -> 4 -> 2.
    """

    def forward(self, x: Tensor) -> Tensor:
        pad: list[int] = []
        for size, k, s in reversed(list(zip(x.shape[-2:], self.kernel_size, self.stride))):  # F.pad: last dim first
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pad += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pad))


class BatchNormOffset(nn.Module):
    """``tf.contrib.layers.batch_norm`` as the reference calls it: batch statistics, an offset, no scale.

    Its defaults are ``center=True, scale=False, epsilon=0.001``, and the reference never sets
    ``is_training=False``, so every pass (support, query, test) normalises by its own batch.
    ``offset`` ``(C,)`` is meta-learned; the reference keeps it outside ``weights``, so the inner
    loop does not adapt it (:data:`META_ONLY`).
    """

    def __init__(self, channels: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.offset = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        # The offset added, not passed as batch_norm's bias: its double backward fails for a bias without a
        # weight (PyTorch 2.15: "Expected a proper Tensor but got None"), which adapting the offset needs.
        return F.batch_norm(x, None, None, training=True, eps=self.eps) + self.offset[:, None, None]


class MeanPool(nn.Module):
    """``(n, C, H, W) -> (n, C)``: the mean over the spatial positions (the reference's ``reduce_mean(hidden4, [1, 2])``)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean((-2, -1))


# Layers whose parameters the outer loop learns and the inner loop leaves alone.
META_ONLY = (BatchNormOffset, StepBatchNorm2d)


def build_model(
    ways: int,
    filters: int = 64,
    network: str = "strided",
    per_step_bn: int | None = None,
    *,
    channels: int = 1,
    side: int = 28,
) -> nn.Module:
    """The Omniglot conv net of Finn et al.'s reference code (``strided``) or the max-pool variants.

    ``channels`` and ``side``: the input images, ``(n, channels, side, side)`` (Omniglot's 1 and
    28; mini-ImageNet's 3 and 84). The max-pool nets' linear layer reads the ``filters x
    (side // 16)^2`` features the 4 pools leave (84 -> 42 -> 21 -> 10 -> 5).

    ``strided`` (``maml.py``'s ``forward_conv`` with ``--max_pool False``, what its Omniglot runs
    use): 4 x [3x3 conv, stride 2, 'SAME' padding; batch norm with an offset and no scale; ReLU],
    28 -> 14 -> 7 -> 4 -> 2, the mean over the 2x2 positions, a linear layer. Initialised as
    ``construct_conv_weights``: convolutions Xavier-uniform, the output layer standard normal,
    biases and offsets 0.

    ``maxpool``: 4 x [3x3 conv, padding 1; batch norm with scale and offset; ReLU; 2x2 max-pool],
    28 -> 14 -> 7 -> 3 -> 1, a linear layer, PyTorch's default initialisation: the net learn2learn
    and MAML++ use, adapted whole by the inner loop.

    ``reference_maxpool`` (:data:`REFERENCE_MAXPOOL`; ``maml.py`` with ``--max_pool True``, the
    reference's mini-ImageNet runs): 4 x [3x3 conv, stride 1, 'SAME'; batch norm with an offset
    and no scale (:class:`BatchNormOffset`, meta-only); ReLU; 2x2 max-pool 'VALID'], flattened,
    a linear layer; convolutions and the linear layer Xavier-uniform (``xavier_initializer``), biases 0.

    ``per_step_bn``: the inner steps of MAML++'s per-step batch norm (BNWB): each batch norm is
    a :class:`maml.nn.StepBatchNorm2d` with a weight and a bias per step (eps as the layer it
    replaces), in a :class:`maml.nn.StepSequential` that hands it the step; its parameters are
    meta-only (:data:`META_ONLY`), as MAML++'s code keeps normalisation out of the inner loop.
    """
    if network not in (*NETWORKS, REFERENCE_MAXPOOL):
        raise ValueError(f"network {network!r} is not one of {', '.join((*NETWORKS, REFERENCE_MAXPOOL))}.")
    blocks: list[nn.Module] = []
    for i in range(4):
        inputs = channels if i == 0 else filters
        if network == "strided":
            conv = SameConv2d(inputs, filters, 3, stride=2)
            nn.init.xavier_uniform_(conv.weight)
            nn.init.zeros_(conv.bias)
            norm = BatchNormOffset(filters) if per_step_bn is None else StepBatchNorm2d(filters, per_step_bn, eps=1e-3)
            blocks += [conv, norm, nn.ReLU()]
        elif network == REFERENCE_MAXPOOL:
            conv = nn.Conv2d(inputs, filters, 3, padding=1)  # 'SAME' at stride 1: one pixel each side
            nn.init.xavier_uniform_(conv.weight)
            nn.init.zeros_(conv.bias)
            norm = BatchNormOffset(filters) if per_step_bn is None else StepBatchNorm2d(filters, per_step_bn, eps=1e-3)
            blocks += [conv, norm, nn.ReLU(), nn.MaxPool2d(2)]
        else:
            blocks += [
                nn.Conv2d(inputs, filters, 3, padding=1),
                # per-task batch statistics, as in MAML
                nn.BatchNorm2d(filters, track_running_stats=False)
                if per_step_bn is None
                else StepBatchNorm2d(filters, per_step_bn),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
    pooled = side // 16  # four 2x2 pools, each rounding down ('VALID')
    head = nn.Linear(filters if network == "strided" else filters * pooled * pooled, ways)
    stack = nn.Sequential if per_step_bn is None else StepSequential
    if network == REFERENCE_MAXPOOL:
        nn.init.xavier_uniform_(head.weight)  # maml.py: w5 with xavier_initializer, b5 zeros
        nn.init.zeros_(head.bias)
    if network == "strided":
        nn.init.normal_(head.weight)  # tf.random_normal([dim_hidden, dim_output]): std 1
        nn.init.zeros_(head.bias)
        return stack(*blocks, MeanPool(), head)
    return stack(*blocks, nn.Flatten(), head)


def meta_only(model: nn.Module) -> set[str]:
    """Names of the parameters the inner loop leaves alone (the strided net's batch-norm offsets, per-step batch norms)."""
    return {
        f"{m}.{p}"
        for m, layer in model.named_modules()
        if isinstance(layer, META_ONLY)
        for p, _ in layer.named_parameters(recurse=False)
    }


def loss_function(loss: str, ways: int, shots: int | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-task classification loss ``(n, ways)`` logits, ``(n,)`` labels -> ``()``.

    ``"reference"``: the reference's ``xent``, ``softmax_cross_entropy_with_logits / K``, is a
    vector of per-example losses, and ``tf.gradients`` of a vector differentiates its sum: its
    loss is the cross-entropy summed over the task's ``ways * K`` examples over ``K``, i.e.
    ``ways`` times the mean, and its ``update_lr`` 0.4 is a step of 2.0 on the mean (5-way).
    Written as ``ways * mean``, which is that sum for ``K`` images per class, and stays the
    sum of the per-class means with another number of query images. ``"mean"``: ``F.cross_entropy``.

    ``shots``: the reference's reduction exactly, the summed cross-entropy over ``K = shots``, on
    any set: with ``Q`` query images per class (mini-ImageNet trains with 15 at K = 1), the query
    loss is ``ways * Q / K`` times the mean, the scale the reference's meta-gradient is clipped at.
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
