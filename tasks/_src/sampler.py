"""N-way K-shot classification tasks over any labelled image tensor, a meta-batch at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, overload

import torch
from torch import Tensor

from maml import TaskBatch

from . import checks


@dataclasses.dataclass(frozen=True)
class FewShotIndices:
    """Which images a meta-batch is made of: indices into the sampler's ``images``.

    Attributes:
        support: ``(T, ways * shots)`` image indices of the support sets, grouped by label:
            positions ``[j * shots, (j + 1) * shots)`` hold label ``j``.
        query: ``(T, ways * query)`` image indices of the query sets, grouped the same way.
        classes: ``(T, ways)`` the original label value given label ``j`` in each task.
    """

    support: Tensor
    query: Tensor
    classes: Tensor


class FewShotSampler:
    """Draws meta-batches of N-way K-shot tasks from a labelled image tensor.

    Per task: ``ways`` distinct classes in random order (the class drawn ``j``-th gets label
    ``j``, so the label of a class is a random permutation over tasks), and for each class
    ``shots + query`` distinct images, the first ``shots`` for the support set and the rest for
    the query set, so no image is in both. The whole meta-batch is drawn with two
    ``torch.rand`` calls and gathered with one tensor index; there is no Python loop per task.

    Every class must hold ``shots + query`` images: a smaller one is refused, not left out, so that
    the classes drawn are the classes of the data (a class left out would go unreported).

    Args:
        images: ``(N, H, W)`` or ``(N, C, H, W)`` images; uint8 images are scaled to [0, 1],
            floating-point ones are used as they are.
        labels: ``(N,)`` integer class of each image (any values, not necessarily 0..C-1).
        ways: classes per task ``N``.
        shots: support images per class ``K``.
        query: query images per class ``Q``.
        class_names: the name of each label value ``0..C-1`` (e.g. a data set's ``classes``), for
            the messages only.

    Raises:
        ValueError: ``ways`` exceeds the classes, or a class holds fewer than ``shots + query``
            images (one line naming it, its count and the fix).

    Attributes:
        classes: ``(C,)`` the label values that can be drawn (sorted).
        num_classes: ``C``.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        ways: int,
        shots: int,
        query: int,
        *,
        class_names: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(images, Tensor) or images.ndim not in (3, 4):
            got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise TypeError(f"images must be a tensor of shape (N, H, W) or (N, C, H, W), got {got}.")
        if images.dtype != torch.uint8 and not images.is_floating_point():
            raise TypeError(
                f"images has dtype {images.dtype}; pass uint8 images (scaled to [0, 1] when sampled) "
                f"or floating-point ones."
            )
        if not isinstance(labels, Tensor) or labels.ndim != 1 or labels.is_floating_point() or labels.is_complex():
            got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, Tensor) else type(labels).__name__
            raise TypeError(f"labels must be an integer tensor of shape (N,), got {got}.")
        if labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"images has {images.shape[0]} images but labels has {labels.shape[0]} labels; "
                f"every image needs exactly one label."
            )
        self.ways = checks.positive_int("ways", ways)
        self.shots = checks.positive_int("shots", shots)
        self.query = checks.positive_int("query", query)
        self.images = images if images.ndim == 4 else images.unsqueeze(1)
        self.labels = labels

        per_task = shots + query
        values, inverse, counts = torch.unique(labels.cpu(), sorted=True, return_inverse=True, return_counts=True)
        if values.numel() < ways:
            raise ValueError(
                f"ways={ways} but the labels hold only {values.numel()} classes; lower ways to at most "
                f"{values.numel()} or use a data set with more classes (Omniglot with rotations=True has "
                f"4 classes per character)."
            )
        short = (counts < per_task).nonzero().squeeze(1)
        if short.numel():
            need = f"shots + query = {shots} + {query} = {per_task} distinct images are needed per class"
            most = int(counts.max())
            if most < per_task:
                raise ValueError(
                    f"{need}, and no class has that many (the largest has {most}; Omniglot has 20 drawers per "
                    f"character); lower shots or query."
                )
            smallest = short[counts[short].argmin()]
            value = int(values[smallest])
            name = class_names[value] if class_names is not None and 0 <= value < len(class_names) else None
            which = f"class {name} (label {value})" if name is not None else f"class {value}"
            raise ValueError(
                f"{need}, but {which} has {int(counts[smallest])}, the smallest of {short.numel()} classes (of "
                f"{values.numel()}) with fewer; lower shots or query, or leave those classes out of the images and "
                f"labels (a class too small to draw would go unreported)."
            )

        # A (C, M) table of image indices per class, padded where a class has fewer than M
        # images; sampling then is one gather instead of a loop over classes.
        order = torch.argsort(inverse, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        sorted_class = inverse[order]
        position = torch.arange(order.numel()) - starts[sorted_class]
        table = torch.zeros(values.numel(), int(counts.max()), dtype=torch.int64)
        table[sorted_class, position] = order
        self.classes = values
        self._table = table
        self._counts = counts
        self._uniform = bool((self._counts == self._table.shape[1]).all())
        self._cache: dict[tuple[str, torch.device], Tensor] = {}

    @property
    def num_classes(self) -> int:
        """The number of classes that can be drawn."""
        return self.classes.numel()

    def __repr__(self) -> str:
        return (
            f"FewShotSampler({self.images.shape[0]} images, {self.num_classes} classes, ways={self.ways}, "
            f"shots={self.shots}, query={self.query})"
        )

    def _on(self, name: str, device: torch.device) -> Tensor:
        """``self.<name>`` on ``device``, moved once and kept."""
        key = (name, device)
        if key not in self._cache:
            self._cache[key] = getattr(self, name).to(device)
        return self._cache[key]

    def sample_indices(self, tasks: int, generator: torch.Generator | None = None) -> FewShotIndices:
        """Draws which images make up ``tasks`` tasks, without gathering them.

        Args:
            tasks: the number of tasks ``T``.
            generator: the random source (default: torch's global generator). The indices
                are drawn on its device; a seeded CPU generator gives the same tasks on any machine.

        Returns:
            The support and query indices and the classes of every task (see :class:`FewShotIndices`).
        """
        checks.positive_int("tasks", tasks)
        checks.generator("generator", generator)
        where = generator.device if generator is not None else torch.device("cpu")
        table, counts = self._on("_table", where), self._on("_counts", where)
        n = self.shots + self.query
        # float64 keys make ties, whose order top-k does not define, practically impossible.
        class_keys = torch.rand(tasks, table.shape[0], generator=generator, dtype=torch.float64, device=where)
        chosen = class_keys.topk(self.ways, dim=1).indices  # (T, ways): a uniform random ordered subset
        image_keys = torch.rand(
            tasks, self.ways, table.shape[1], generator=generator, dtype=torch.float64, device=where
        )
        if not self._uniform:
            slots = torch.arange(table.shape[1], device=where)
            image_keys = image_keys.masked_fill(slots >= counts[chosen].unsqueeze(-1), -1.0)
        picked = image_keys.topk(n, dim=2).indices  # (T, ways, n): distinct images of each class
        index = table[chosen.unsqueeze(-1), picked]
        return FewShotIndices(
            support=index[:, :, : self.shots].reshape(tasks, -1),
            query=index[:, :, self.shots :].reshape(tasks, -1),
            classes=self._on("classes", where)[chosen],
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
        """Draws a meta-batch of ``tasks`` N-way K-shot tasks.

        Args:
            tasks: the number of tasks ``T``.
            generator: the random source (default: torch's global generator).
            dtype: floating-point dtype of the images.
            device: where the batch lives (default: where ``images`` are). The images are
                copied there once and gathered there.
            return_indices: also return which images were drawn.

        Returns:
            A ``maml.TaskBatch``: ``support_x (T, ways * shots, C, H, W)``, ``support_y
            (T, ways * shots)`` int64 labels in ``0..ways-1`` grouped by label, and
            ``query_x (T, ways * query, C, H, W)``, ``query_y (T, ways * query)`` likewise;
            uint8 images scaled to [0, 1]. With ``return_indices=True`` the pair
            ``(batch, FewShotIndices)``.
        """
        checks.float_dtype("dtype", dtype)
        indices = self.sample_indices(tasks, generator)
        device = torch.device(device) if device is not None else self.images.device
        images = self._on("images", device)
        n_support = self.ways * self.shots
        # One gather for support and query together: index_select copies whole images (advanced indexing
        # copies them element by element: 17 against 0.7 ms for a mini-ImageNet meta-batch of 4 tasks).
        index = torch.cat([indices.support, indices.query], dim=1).to(device)
        x = images.index_select(0, index.flatten()).view(*index.shape, *images.shape[1:])
        if x.dtype == torch.uint8:
            # Converted, then scaled in place: float(x) / 255 in the target dtype, as one division would give.
            x = torch.empty(x.shape, dtype=dtype, device=device).copy_(x).div_(255)
        else:
            x = x.to(dtype)
        labels = torch.arange(self.ways, device=device)
        support_y = labels.repeat_interleave(self.shots).repeat(tasks, 1)
        query_y = labels.repeat_interleave(self.query).repeat(tasks, 1)
        batch = TaskBatch(x[:, :n_support], support_y, x[:, n_support:], query_y)
        if return_indices:
            return batch, indices
        return batch
