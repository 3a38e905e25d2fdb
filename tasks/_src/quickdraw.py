"""Quick Draw (Google Creative Lab's Quick, Draw!), Meta-Dataset's split, read from its numpy bitmaps as memory maps.

Google's ``numpy_bitmap`` files hold one class each, ``<class name>.npy``: an ``(N, 784)`` uint8
array of 28 x 28 grayscale drawings (white strokes on black), 345 classes and about 50 million
drawings in all (784 bytes each: about 39 GB). Nothing is decoded or cached: each file is mapped
(``np.load(mmap_mode="r")``) and a meta-batch reads the rows it draws, never a class whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from maml import TaskBatch

from . import checks
from .image_data import IMAGE_DATASETS, ImageSplits
from .image_layouts import DATASETS, SPLITS, DataSpec
from .sampler import FewShotIndices

SIDE = 28  # the drawings' side in the files
ROW = SIDE * SIDE  # 784 bytes a drawing
LAYOUT = "numpy-bitmap"
SUBFOLDER = "quickdraw"  # learn2learn keeps the files in <root>/quickdraw/

# Meta-Dataset's class split (Triantafillou et al. 2020) as learn2learn ships it
# (learn2learn/vision/datasets/quickdraw.py, SPLITS): 241 / 52 / 52 of the 345 classes, in its order.
# fmt: off
TRAIN_CLASSES = (
    "hedgehog", "swan", "police car", "castle", "horse", "stairs", "van", "screwdriver", "marker", "duck", "oven",
    "dolphin", "stove", "ambulance", "basket", "popsicle", "whale", "alarm clock", "crown", "teapot", "octagon",
    "school bus", "potato", "eyeglasses", "diamond", "bowtie", "cat", "The Eiffel Tower", "hurricane", "square",
    "river", "door", "triangle", "pear", "cup", "elephant", "compass", "tractor", "ladder", "pineapple", "bathtub",
    "tiger", "drums", "cake", "ceiling fan", "zigzag", "light bulb", "sheep", "flip flops", "sailboat", "sink",
    "necklace", "toothbrush", "snorkel", "trombone", "watermelon", "pliers", "camera", "cruise ship", "string bean",
    "raccoon", "rainbow", "fork", "fan", "fence", "microphone", "motorbike", "pool", "line", "bandage", "bracelet",
    "syringe", "windmill", "lollipop", "grass", "airplane", "sword", "boomerang", "telephone", "guitar", "bed",
    "paint can", "sandwich", "sock", "tent", "stop sign", "scorpion", "toothpaste", "squiggle",
    "The Great Wall of China", "hot tub", "bottlecap", "mug", "baseball bat", "belt", "sun", "rake", "pillow",
    "parachute", "foot", "pencil", "traffic light", "underwear", "calculator", "blackberry", "shark", "nail", "ear",
    "cloud", "lighthouse", "lightning", "rain", "The Mona Lisa", "apple", "shorts", "star", "clock", "sea turtle",
    "bicycle", "fireplace", "lighter", "squirrel", "chandelier", "cannon", "paintbrush", "tree", "jail", "pants",
    "envelope", "onion", "pizza", "sleeping bag", "lipstick", "dragon", "t-shirt", "snowflake", "hot air balloon",
    "cooler", "peas", "skull", "dresser", "harp", "garden", "leaf", "camouflage", "house plant", "see saw",
    "megaphone", "map", "penguin", "dog", "peanut", "keyboard", "strawberry", "truck", "car", "pig", "crayon",
    "headphones", "floor lamp", "hamburger", "wine glass", "beach", "ocean", "circle", "asparagus",
    "remote control", "moon", "rifle", "shovel", "hospital", "barn", "picture frame", "scissors", "crab",
    "moustache", "brain", "lion", "banana", "chair", "skateboard", "book", "mushroom", "shoe", "key", "passport",
    "broccoli", "elbow", "leg", "dumbbell", "bird", "cello", "hockey puck", "submarine", "canoe", "rhinoceros",
    "bush", "flying saucer", "arm", "frog", "train", "dishwasher", "washing machine", "swing set",
    "aircraft carrier", "vase", "crocodile", "monkey", "blueberry", "cell phone", "toe", "garden hose", "zebra",
    "hexagon", "owl", "postcard", "speedboat", "mosquito", "birthday cake", "pickup truck", "hand", "computer",
    "piano", "fish", "soccer ball", "bear", "mouth", "face", "violin", "bench", "stereo", "jacket", "spreadsheet",
    "power outlet", "knee", "mountain", "octopus", "laptop", "snail", "flamingo", "spoon",
)
VAL_CLASSES = (
    "ant", "anvil", "backpack", "baseball", "basketball", "binoculars", "bread", "bulldozer", "bus", "calendar",
    "camel", "candle", "carrot", "church", "clarinet", "coffee cup", "eye", "firetruck", "flower", "golf club",
    "grapes", "hat", "hot dog", "ice cream", "knife", "lobster", "matches", "mermaid", "microwave", "nose", "panda",
    "paper clip", "pond", "purse", "radio", "roller coaster", "skyscraper", "smiley face", "snake", "steak",
    "stethoscope", "suitcase", "teddy-bear", "television", "tennis racquet", "toaster", "toilet", "tooth",
    "tornado", "trumpet", "waterslide", "wristwatch",
)
TEST_CLASSES = (
    "angel", "animal migration", "axe", "bat", "beard", "bee", "bridge", "broom", "bucket", "butterfly", "cactus",
    "campfire", "cookie", "couch", "cow", "diving board", "donut", "drill", "eraser", "feather", "finger",
    "fire hydrant", "flashlight", "frying pan", "giraffe", "goatee", "hammer", "helicopter", "helmet",
    "hockey stick", "hourglass", "house", "kangaroo", "lantern", "mailbox", "mouse", "palm tree", "parrot",
    "rabbit", "rollerskates", "saw", "saxophone", "snowman", "spider", "stitches", "streetlight", "sweater",
    "table", "umbrella", "wheel", "wine bottle", "yoga",
)
# fmt: on
CLASSES = {"train": TRAIN_CLASSES, "val": VAL_CLASSES, "test": TEST_CLASSES}
_SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}

QUICKDRAW = DataSpec(
    "Quick Draw",
    "quickdraw",
    SIDE,
    (len(TRAIN_CLASSES), len(VAL_CLASSES), len(TEST_CLASSES)),
    "QUICKDRAW_DIR",
    "the numpy_bitmap files, one <class name>.npy per class, of github.com/googlecreativelab/quickdraw-dataset "
    "(gs://quickdraw_dataset/full/numpy_bitmap), in one folder or its quickdraw/ subfolder as learn2learn keeps them",
    (),
    channels=1,
)


class QuickDraw:
    """One split of Quick Draw, each class's drawings a memory map of its ``.npy`` file.

    The classes are Meta-Dataset's split (241 / 52 / 52, :data:`CLASSES`). The files are in
    ``root`` or in ``root/quickdraw/`` (learn2learn's layout); each is opened with
    ``np.load(mmap_mode="r")``, which reads its header only, and checked to be ``(N, 784)`` uint8.
    A meta-batch reads only the drawings it draws (:meth:`sampler`).

    Args:
        root: the folder holding the ``.npy`` files (default: ``$QUICKDRAW_DIR``).
        split: ``"train"``, ``"val"`` (or ``"validation"``) or ``"test"``.
        side: the side of the sampled images; other than 28, the drawings drawn are resized with
            Lanczos (as the other sets resize their images) when sampled.

    Attributes:
        arrays: the split's classes, each an ``(N_c, 784)`` uint8 ``np.memmap``, in :attr:`classes`' order.
        counts: ``(C,)`` int64 drawings of each class.
        classes: the classes' names (the files' names without ``.npy``).
        files: the files mapped.
        layout: ``"numpy-bitmap"``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: one line naming the file: a class's file missing (and how many are), a file numpy
            cannot map (not a ``.npy`` file, truncated), or one not ``(N, 784)`` uint8.
    """

    spec = QUICKDRAW
    arrays: list[np.memmap]
    counts: Tensor
    classes: list[str]
    files: list[Path]
    split: str
    root: Path
    side: int
    layout = LAYOUT

    def __init__(self, root: str | os.PathLike[str] | None = None, split: str = "train", *, side: int = SIDE) -> None:
        if split not in _SPLIT_NAMES:
            raise ValueError(f"split={split!r} is not one of 'train', 'val' ('validation') or 'test'.")
        self.side = checks.positive_int("side", side)
        self.split = _SPLIT_NAMES[split]
        self.root = _root(root)
        folder = _folder(self.root)
        self.classes = list(CLASSES[self.split])
        self.files = [folder / f"{name}.npy" for name in self.classes]
        missing = [p for p in self.files if not p.is_file()]
        if missing:
            raise ValueError(
                f"{folder} has no {missing[0].name}: {len(missing)} of the {len(self.files)} class files of the "
                f"{self.split} split of Quick Draw are missing; {self.spec.help()}"
            )
        self.arrays = [_open(p) for p in self.files]
        self.counts = torch.tensor([a.shape[0] for a in self.arrays], dtype=torch.int64)

    @classmethod
    def splits(cls, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> ImageSplits:
        """The train, validation and test splits under ``root`` (keyword arguments as the constructor's).

        The three class lists are disjoint (Meta-Dataset's split), so no check of the files can find a
        class in two splits.
        """
        return ImageSplits(*(cls(root, split, **kwargs) for split in SPLITS))  # type: ignore[arg-type]

    @property
    def num_classes(self) -> int:
        """The number of classes of this split."""
        return len(self.classes)

    @property
    def image_size(self) -> int:
        """The side of the sampled images in pixels."""
        return self.side

    def __len__(self) -> int:
        return int(self.counts.sum())

    def __repr__(self) -> str:
        return (
            f"QuickDraw({self.split}: {self.num_classes} classes, {len(self)} drawings of {self.side}x{self.side}, "
            f"memory-mapped)"
        )

    def sampler(self, ways: int, shots: int, query: int) -> QuickDrawSampler:
        """A :class:`QuickDrawSampler` of ``ways``-way ``shots``-shot tasks: ``(T, ways * n, 1, S, S)`` batches."""
        return QuickDrawSampler(self.arrays, ways, shots, query, class_names=self.classes, side=self.side)


class QuickDrawSampler:
    """Draws meta-batches of N-way K-shot tasks from classes held as memory maps, reading only what it draws.

    The classes of a task are drawn as :class:`tasks.FewShotSampler` draws them (the same ``torch.rand``
    call, so the same generator picks the same classes from the same number of classes); its drawings
    are ``shots + query`` distinct rows of each class, a uniform random subset drawn with Floyd's
    algorithm and put in uniform random order: ``FewShotSampler``'s key per image of the largest class
    would be ``tasks x ways x`` hundreds of thousands of numbers a meta-batch here. The first ``shots``
    are the support set, the rest the query set, so no drawing is in both. Only the drawn rows are read from the maps.

    Args:
        arrays: each class's drawings, ``(N_c, 784)`` uint8 (memory maps, or any array).
        ways, shots, query: classes per task, support and query drawings per class.
        class_names: the classes' names, for the messages.
        side: the side of the sampled images (other than 28: resized with Lanczos).

    Raises:
        ValueError: ``ways`` exceeds the classes, or a class holds fewer than ``shots + query`` drawings.
    """

    def __init__(
        self,
        arrays: Sequence[np.ndarray],
        ways: int,
        shots: int,
        query: int,
        *,
        class_names: Sequence[str] | None = None,
        side: int = SIDE,
    ) -> None:
        self.ways = checks.positive_int("ways", ways)
        self.shots = checks.positive_int("shots", shots)
        self.query = checks.positive_int("query", query)
        self.side = checks.positive_int("side", side)
        self.arrays = list(arrays)
        self.class_names = list(class_names) if class_names is not None else [str(c) for c in range(len(arrays))]
        self.counts = torch.tensor([a.shape[0] for a in self.arrays], dtype=torch.int64)
        self.offsets = torch.cumsum(self.counts, 0) - self.counts
        if len(self.arrays) < ways:
            raise ValueError(
                f"ways={ways} but the split holds only {len(self.arrays)} classes; lower ways to at most "
                f"{len(self.arrays)}."
            )
        per_task = shots + query
        short = (self.counts < per_task).nonzero().squeeze(1)
        if short.numel():
            smallest = int(short[self.counts[short].argmin()])
            raise ValueError(
                f"shots + query = {shots} + {query} = {per_task} distinct drawings are needed per class, but class "
                f"{self.class_names[smallest]} has {int(self.counts[smallest])}, the smallest of {short.numel()} "
                f"classes (of {len(self.arrays)}) with fewer; lower shots or query."
            )

    @property
    def num_classes(self) -> int:
        """The number of classes that can be drawn."""
        return len(self.arrays)

    def __repr__(self) -> str:
        return (
            f"QuickDrawSampler({int(self.counts.sum())} drawings, {self.num_classes} classes, ways={self.ways}, "
            f"shots={self.shots}, query={self.query})"
        )

    def sample_indices(self, tasks: int, generator: torch.Generator | None = None) -> FewShotIndices:
        """Draws which drawings make up ``tasks`` tasks, without reading them.

        Returns:
            :class:`tasks.FewShotIndices` on the CPU: ``support`` and ``query`` index the split's drawings
            numbered class after class (class ``c``'s row ``r`` is ``offsets[c] + r``), and ``classes``
            the class of label ``j`` in each task.
        """
        checks.positive_int("tasks", tasks)
        checks.generator("generator", generator)
        where = generator.device if generator is not None else torch.device("cpu")
        n = self.shots + self.query
        class_keys = torch.rand(tasks, self.num_classes, generator=generator, dtype=torch.float64, device=where)
        chosen = class_keys.topk(self.ways, dim=1).indices.cpu()  # (T, ways), as FewShotSampler draws them
        size = self.counts[chosen]  # (T, ways)
        # Floyd's algorithm: for j = size - n .. size - 1, a uniform t in [0, j], or j if t was taken;
        # the n rows are then a uniform random subset of the class's rows.
        rows = torch.empty(tasks, self.ways, n, dtype=torch.int64)
        for k in range(n):
            j = size - n + k
            u = torch.rand(tasks, self.ways, generator=generator, dtype=torch.float64, device=where).cpu()
            t = torch.minimum((u * (j + 1).to(torch.float64)).to(torch.int64), j)
            taken = (rows[:, :, :k] == t.unsqueeze(-1)).any(-1)
            rows[:, :, k] = torch.where(taken, j, t)
        order = torch.rand(tasks, self.ways, n, generator=generator, dtype=torch.float64, device=where).cpu()
        rows = rows.gather(2, order.argsort(dim=2))  # a uniform order: which rows are support, which query
        index = self.offsets[chosen].unsqueeze(-1) + rows
        return FewShotIndices(
            support=index[:, :, : self.shots].reshape(tasks, -1),
            query=index[:, :, self.shots :].reshape(tasks, -1),
            classes=chosen,
        )

    @overload
    def sample(
        self,
        tasks: int,
        generator: torch.Generator | None = ...,
        *,
        dtype: torch.dtype = ...,
        device: torch.device | str | None = ...,
        return_indices: Literal[False] = ...,
    ) -> TaskBatch: ...

    @overload
    def sample(
        self,
        tasks: int,
        generator: torch.Generator | None = ...,
        *,
        dtype: torch.dtype = ...,
        device: torch.device | str | None = ...,
        return_indices: Literal[True],
    ) -> tuple[TaskBatch, FewShotIndices]: ...

    def sample(
        self,
        tasks: int,
        generator: torch.Generator | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        return_indices: bool = False,
    ) -> TaskBatch | tuple[TaskBatch, FewShotIndices]:
        """Draws a meta-batch of ``tasks`` N-way K-shot tasks, as :meth:`tasks.FewShotSampler.sample` does.

        Returns:
            A ``maml.TaskBatch``: ``support_x (T, ways * shots, 1, S, S)`` in [0, 1] (uint8 / 255),
            ``support_y (T, ways * shots)`` int64 labels ``0..ways-1`` grouped by label, ``query_x
            (T, ways * query, 1, S, S)``, ``query_y`` likewise; with ``return_indices=True`` the pair
            ``(batch, FewShotIndices)``.
        """
        checks.float_dtype("dtype", dtype)
        indices = self.sample_indices(tasks, generator)
        device = torch.device(device) if device is not None else torch.device("cpu")
        index = torch.cat([indices.support, indices.query], dim=1)  # (T, ways * n)
        x = torch.from_numpy(self._read(indices.classes, index)).view(*index.shape, 1, self.side, self.side)
        x = torch.empty(x.shape, dtype=dtype, device=device).copy_(x).div_(255)
        labels = torch.arange(self.ways, device=device)
        support_y = labels.repeat_interleave(self.shots).repeat(tasks, 1)
        query_y = labels.repeat_interleave(self.query).repeat(tasks, 1)
        n_support = self.ways * self.shots
        batch = TaskBatch(x[:, :n_support], support_y, x[:, n_support:], query_y)
        if return_indices:
            return batch, indices
        return batch

    def _read(self, classes: Tensor, index: Tensor) -> np.ndarray:
        """The drawings ``index`` names, ``(T * ways * n, side * side)`` uint8: only those rows are read."""
        tasks, n = index.shape[0], self.shots + self.query
        out = np.empty((tasks, self.ways, n, self.side * self.side), dtype=np.uint8)
        # Each task's drawings of one class, in the order drawn: support rows first, then query rows.
        per_class = torch.cat(
            [
                index[:, : self.ways * self.shots].view(tasks, self.ways, self.shots),
                index[:, self.ways * self.shots :].view(tasks, self.ways, self.query),
            ],
            dim=2,
        )
        for t in range(tasks):
            for j in range(self.ways):
                c = int(classes[t, j])
                rows = (per_class[t, j] - self.offsets[c]).numpy()
                order = np.argsort(rows)  # ascending rows read the map front to back
                drawn = np.empty((n, ROW), dtype=np.uint8)
                drawn[order] = self.arrays[c][rows[order]]
                out[t, j] = drawn if self.side == SIDE else _resize(drawn, self.side)
        # Back to the batch's order: support (class by class), then query (class by class).
        support = out[:, :, : self.shots].reshape(tasks, -1, self.side * self.side)
        query = out[:, :, self.shots :].reshape(tasks, -1, self.side * self.side)
        return np.ascontiguousarray(np.concatenate([support, query], axis=1))


def _resize(drawings: np.ndarray, side: int) -> np.ndarray:
    """``(n, 784)`` drawings as ``(n, side * side)``, each resized with Lanczos as the other sets' images are."""
    return np.stack(
        [
            np.asarray(
                Image.fromarray(d.reshape(SIDE, SIDE), mode="L").resize((side, side), Image.Resampling.LANCZOS)
            ).reshape(-1)
            for d in drawings
        ]
    )


def _root(root: str | os.PathLike[str] | None) -> Path:
    spec = QUICKDRAW
    if root is None:
        if not os.environ.get(spec.env):
            raise ValueError(f"no {spec.name} folder: pass root= the folder or set ${spec.env}; {spec.help()}")
        root = os.environ[spec.env]
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file, not the folder holding the data"
        raise FileNotFoundError(f"{spec.name} folder {path} {what}; {spec.help()}")
    return path


def _folder(root: Path) -> Path:
    """Where the ``.npy`` files are: ``root/quickdraw/`` (learn2learn's layout) when it is there, else ``root``."""
    sub = root / SUBFOLDER
    return sub if sub.is_dir() else root


def _open(path: Path) -> np.memmap:
    """``path`` mapped read-only, checked to be ``(N, 784)`` uint8 drawings; numpy reads its header only."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy says a bad file with ValueError, EOFError, OSError, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"cannot map {path} as a .npy array ({reason}): the file is not a numpy file or is truncated; "
            f"{QUICKDRAW.help()}"
        ) from None
    if not isinstance(array, np.memmap) or array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != ROW:
        what = f"a {array.dtype} array of shape {array.shape}" if isinstance(array, np.ndarray) else "no array"
        raise ValueError(
            f"{path} holds {what}, not (N, 784) uint8 (a 28 x 28 drawing a row, as the numpy_bitmap files hold); "
            f"{QUICKDRAW.help()}"
        )
    return array


# The scripts' registries (--dataset quickdraw): a set they read by the same calls as the decoded ones.
DATASETS[QUICKDRAW.key] = QUICKDRAW
IMAGE_DATASETS[QUICKDRAW.key] = QuickDraw  # type: ignore[assignment]
