"""Layers for meta-learning models: ``maml.nn.StepBatchNorm2d`` (MAML++'s per-step batch-norm weights), and
``maml.nn.StepSequential``, which hands the inner step to the layers that take it."""

from ._src.layers import StepBatchNorm2d, StepSequential

__all__ = ["StepBatchNorm2d", "StepSequential"]
