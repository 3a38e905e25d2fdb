"""Argument checks: each error names the argument, the bad value and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def positive_int(arg: str, value: Any, *, minimum: int = 1) -> int:
    """Returns ``value`` if it is an int >= ``minimum`` (bools are rejected: ``True`` is no size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{arg}={value} is out of range; it must be an int >= {minimum}.")
    return value


def interval(arg: str, value: Any) -> tuple[float, float]:
    """Returns ``value`` as ``(low, high)`` floats with ``low <= high``, both finite."""
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise TypeError(f"{arg} must be a (low, high) pair of numbers, got {value!r}.")
    low, high = value
    for v in (low, high):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{arg}={value!r}: both ends must be finite numbers.")
    if low > high:
        raise ValueError(f"{arg}={value!r} has low > high; pass it as (low, high), e.g. ({high}, {low}).")
    return float(low), float(high)


def float_dtype(arg: str, dtype: Any) -> torch.dtype:
    """Returns ``dtype`` if it is a floating-point torch dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{arg} must be a floating-point torch.dtype such as torch.float32, got {dtype!r}.")
    return dtype


def generator(arg: str, value: Any) -> None:
    if value is not None and not isinstance(value, torch.Generator):
        raise TypeError(
            f"{arg} must be a torch.Generator or None, got {type(value).__name__}; "
            f"build one with torch.Generator().manual_seed(seed)."
        )


def one_of(arg: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{arg}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}.")
