"""Few-shot sine regression (Finn et al., 2017): y = amplitude * sin(x - phase)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, overload

import torch
from torch import Tensor

from maml import TaskBatch

from . import checks


@dataclasses.dataclass(frozen=True)
class SineTasks:
    """The true functions of ``T`` sine tasks, ``y = amplitude * sin(x - phase)``.

    Attributes:
        amplitude: ``(T,)`` float64 amplitudes.
        phase: ``(T,)`` float64 phases, in radians.
    """

    amplitude: Tensor
    phase: Tensor

    @property
    def num_tasks(self) -> int:
        """The number of tasks ``T``."""
        return self.amplitude.shape[0]

    def true_y(self, x: Tensor) -> Tensor:
        """Evaluates every task's true function.

        Args:
            x: either ``(n,)``, one grid shared by all tasks (for plots), or ``(T, n, ...)``,
                per-task inputs such as ``batch.query_x`` of shape ``(T, n, 1)``.

        Returns:
            ``(T, n)`` for a shared grid, else the shape of ``x``; in the dtype and on the
            device of ``x`` (computed in float64 when ``x`` is float64).
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor, (n,) or (T, n, ...), got {type(x).__name__}.")
        if not x.is_floating_point():
            x = x.to(torch.float64)
        if x.ndim == 1:
            x = x.unsqueeze(0)
            amplitude, phase = self.amplitude[:, None], self.phase[:, None]
        else:
            if x.shape[0] != self.num_tasks:
                raise ValueError(
                    f"x has shape {tuple(x.shape)}: dimension 0 must be the {self.num_tasks} tasks, or pass "
                    f"one shared grid of shape (n,)."
                )
            view = (self.num_tasks,) + (1,) * (x.ndim - 1)
            amplitude, phase = self.amplitude.reshape(view), self.phase.reshape(view)
        amplitude = amplitude.to(device=x.device, dtype=x.dtype)
        phase = phase.to(device=x.device, dtype=x.dtype)
        return amplitude * torch.sin(x - phase)

    def to(self, device: torch.device | str) -> SineTasks:
        """The same tasks with their parameters on ``device``."""
        return SineTasks(self.amplitude.to(device), self.phase.to(device))


class Sine:
    """The few-shot sine-wave regression task distribution of MAML.

    Each task is ``y = amplitude * sin(x - phase)`` with amplitude, phase and inputs drawn
    uniformly from the given ranges (by default the paper's: amplitude in [0.1, 5.0], phase in
    [0, pi], x in [-5, 5]).

    Args:
        amplitude: ``(low, high)`` range of the amplitude.
        phase: ``(low, high)`` range of the phase, in radians.
        x_range: ``(low, high)`` range of the inputs.
    """

    def __init__(
        self,
        amplitude: tuple[float, float] = (0.1, 5.0),
        phase: tuple[float, float] = (0.0, math.pi),
        x_range: tuple[float, float] = (-5.0, 5.0),
    ) -> None:
        self.amplitude = checks.interval("amplitude", amplitude)
        self.phase = checks.interval("phase", phase)
        self.x_range = checks.interval("x_range", x_range)

    def __repr__(self) -> str:
        return f"Sine(amplitude={self.amplitude}, phase={self.phase}, x_range={self.x_range})"

    @overload
    def sample(
        self,
        tasks: int,
        shots: int = ...,
        query: int = ...,
        generator: torch.Generator | None = ...,
        *,
        dtype: torch.dtype = ...,
        device: torch.device | str | None = ...,
        return_params: Literal[False] = ...,
    ) -> TaskBatch: ...

    @overload
    def sample(
        self,
        tasks: int,
        shots: int = ...,
        query: int = ...,
        generator: torch.Generator | None = ...,
        *,
        dtype: torch.dtype = ...,
        device: torch.device | str | None = ...,
        return_params: Literal[True],
    ) -> tuple[TaskBatch, SineTasks]: ...

    def sample(
        self,
        tasks: int,
        shots: int = 10,
        query: int = 10,
        generator: torch.Generator | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        return_params: bool = False,
    ) -> TaskBatch | tuple[TaskBatch, SineTasks]:
        """Draws a meta-batch of ``tasks`` sine tasks in one vectorized call.

        Everything is drawn with a single ``torch.rand`` on ``generator`` in float64 and only
        then cast and moved, so a seeded CPU generator gives the same tasks on any machine,
        whatever ``dtype`` and ``device`` are.

        Args:
            tasks: the number of tasks ``T``.
            shots: support points per task ``K``.
            query: query points per task ``Q``.
            generator: the random source (default: torch's global generator).
            dtype: floating-point dtype of the returned tensors.
            device: where the returned tensors live (default: the CPU).
            return_params: also return the tasks' true functions.

        Returns:
            A ``maml.TaskBatch`` with ``support_x``, ``support_y`` of shape ``(T, K, 1)`` and
            ``query_x``, ``query_y`` of shape ``(T, Q, 1)``; with ``return_params=True`` the
            pair ``(batch, SineTasks)``.
        """
        checks.positive_int("tasks", tasks)
        checks.positive_int("shots", shots)
        checks.positive_int("query", query)
        checks.generator("generator", generator)
        checks.float_dtype("dtype", dtype)
        where = generator.device if generator is not None else torch.device("cpu")
        u = torch.rand(tasks, 2 + shots + query, generator=generator, dtype=torch.float64, device=where)
        (a_lo, a_hi), (p_lo, p_hi), (x_lo, x_hi) = self.amplitude, self.phase, self.x_range
        amplitude = a_lo + (a_hi - a_lo) * u[:, 0]
        phase = p_lo + (p_hi - p_lo) * u[:, 1]
        x = (x_lo + (x_hi - x_lo) * u[:, 2:]).unsqueeze(-1)
        y = amplitude[:, None, None] * torch.sin(x - phase[:, None, None])
        x = x.to(device=device, dtype=dtype)
        y = y.to(device=device, dtype=dtype)
        batch = TaskBatch(x[:, :shots], y[:, :shots], x[:, shots:], y[:, shots:])
        if return_params:
            return batch, SineTasks(amplitude, phase)
        return batch
