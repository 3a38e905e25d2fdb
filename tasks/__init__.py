"""Task distributions for meta-learning, as ``maml.TaskBatch``es.

import tasks
sine = tasks.Sine()
batch = sine.sample(25, shots=10, query=10, generator=g)          # (T, n, 1) regression tasks
omni = tasks.Omniglot(root, rotations=False)                       # the real data set, cached
sampler = tasks.FewShotSampler(omni.images, omni.labels, ways=5, shots=1, query=15)
batch = sampler.sample(32, generator=g)       # support_x (32, 5, 1, 28, 28), query_x (32, 75, 1, 28, 28)
mini = tasks.MiniImageNet(root, "train")                           # any layout it is held in, cached
batch = mini.sampler(ways=5, shots=1, query=15).sample(4, generator=g)  # support_x (4, 5, 3, 84, 84), query_x (4, 75, ...)
draw = tasks.QuickDraw(root, "train")                             # one memory-mapped .npy per class
batch = draw.sampler(ways=5, shots=1, query=15).sample(4, generator=g)  # support_x (4, 5, 1, 28, 28)
"""

from ._src.aircraft import Aircraft
from ._src.cub import CUB200
from ._src.flowers import Flowers102
from ._src.image_data import (
    CIFARFS,
    FC100,
    IMAGE_DATASETS,
    DescribableTextures,
    FewShotImages,
    FGVCFungi,
    ImageSplits,
    MiniImageNet,
    TieredImageNet,
)
from ._src.image_layouts import DATASETS as IMAGE_LAYOUTS
from ._src.interop import batches, collate, from_learn2learn, split_task
from ._src.omniglot import LAYOUT_HELP, OMNIGLOT_URL, SPLIT_BY, Omniglot, OmniglotSplits
from ._src.quickdraw import QuickDraw, QuickDrawSampler
from ._src.sampler import FewShotIndices, FewShotSampler
from ._src.sine import Sine, SineTasks

__all__ = [
    "CIFARFS",
    "FC100",
    "IMAGE_DATASETS",
    "IMAGE_LAYOUTS",
    "FewShotImages",
    "ImageSplits",
    "MiniImageNet",
    "TieredImageNet",
    "DescribableTextures",
    "FGVCFungi",
    "LAYOUT_HELP",
    "OMNIGLOT_URL",
    "SPLIT_BY",
    "FewShotIndices",
    "FewShotSampler",
    "Omniglot",
    "OmniglotSplits",
    "Sine",
    "SineTasks",
    "batches",
    "collate",
    "from_learn2learn",
    "split_task",
    "QuickDraw",
    "QuickDrawSampler",
    "CUB200",
    "Aircraft",
    "Flowers102",
]
