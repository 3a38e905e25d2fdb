"""Layers for meta-learning models: ``maml.nn.StepBatchNorm2d`` (MAML++'s per-step batch-norm weights)."""

from ._src.layers import StepBatchNorm2d

__all__ = ["StepBatchNorm2d"]
