"""Exact, fast MAML meta-gradients for PyTorch, built on torch.func.

import maml
batch = maml.TaskBatch(support_x, support_y, query_x, query_y)
learner = maml.MetaLearner(model, loss_fn, inner_lr=0.4, steps=1)
learner.meta_loss(batch).backward()
"""

from . import nn
from ._src.batch import TaskBatch
from ._src.curvature import MetaCurvature
from ._src.distributed import all_reduce_grads, all_reduce_mean, shard, shard_size
from ._src.functional import call
from ._src.learner import MetaLearner
from ._src.loop import MetaOutput
from ._src.modes import CHECKPOINT_HVPS, COMPILED_MODES, MODES, UNROLLED_MODES, Checkpointed, Implicit, Mode
from ._src.optimizers import (
    ASGD,
    INNER_OPTIMIZERS,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamState,
    AdamW,
    Momentum,
    MomentumState,
    NAdam,
    RAdam,
    RMSprop,
    Rprop,
)
from ._src.options import BATCHINGS
from ._src.planner import MemoryBudgetWarning
from ._src.rates import LEARN_INNER_LR
from ._src.rules import UpdateRule

__all__ = [
    "BATCHINGS",
    "CHECKPOINT_HVPS",
    "COMPILED_MODES",
    "INNER_OPTIMIZERS",
    "Implicit",
    "LEARN_INNER_LR",
    "MODES",
    "ASGD",
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamState",
    "AdamW",
    "Adamax",
    "Checkpointed",
    "MemoryBudgetWarning",
    "MetaCurvature",
    "MetaLearner",
    "MetaOutput",
    "Mode",
    "Momentum",
    "MomentumState",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "TaskBatch",
    "UNROLLED_MODES",
    "UpdateRule",
    "all_reduce_grads",
    "call",
    "nn",
    "all_reduce_mean",
    "shard",
    "shard_size",
]
__version__ = "0.1.0"
