"""Argument checks shared by the public API: each error names the argument, the value and the fix."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn


def close_matches(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choices, or an empty string."""
    matches = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


def one_of(arg: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        hint = close_matches(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else ""
        raise ValueError(f"{arg}={value!r} is not supported{hint}; choose one of {', '.join(map(repr, choices))}.")


def integer(arg: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{arg}={value} is out of range; it must be >= {minimum}.")


def positive_number(arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{arg} must be a Python float, got {value!r} ({type(value).__name__}); to learn it, pass "
            f"the initial value as a float and learn_inner_lr='scalar' or 'per_parameter'."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{arg}={value} is out of range; it must be a finite number > 0.")


def input_dtype(arg: str, x: Tensor, dtype: torch.dtype, integer_ok: bool) -> None:
    """Inputs must be floating point in the parameters' dtype (integers only for embedding models)."""
    if x.is_floating_point() or x.is_complex():
        if x.dtype != dtype:
            raise TypeError(
                f"{arg} has dtype {x.dtype} but the model's parameters are {dtype}; convert the inputs "
                f"with {arg}.to({dtype}) (or TaskBatch.to({dtype})), or the model with model.to({x.dtype})."
            )
    elif not integer_ok:
        raise TypeError(
            f"{arg} has dtype {x.dtype}, but the model needs floating-point inputs ({dtype}); convert "
            f"them with {arg}.to({dtype}) (images stored as uint8 also need scaling, e.g. x.to({dtype}) / 255)."
        )


def parameter_names(arg: str, params: dict[str, Tensor], model: nn.Module) -> None:
    """``params`` must hold exactly the model's parameters, keyed by ``named_parameters()`` name."""
    expected = dict(model.named_parameters())
    unknown = [k for k in params if k not in expected]
    if unknown:
        hints = "; ".join(f"{k!r}{close_matches(k, expected)}" for k in unknown)
        raise ValueError(
            f"{arg} has keys that are not parameters of the model: {hints}. Key it by "
            f"dict(model.named_parameters()) names."
        )
    missing = [k for k in expected if k not in params]
    if missing:
        raise ValueError(
            f"{arg} lacks parameters of the model: {', '.join(map(repr, missing))}. Pass every parameter, "
            f"e.g. {{**dict(model.named_parameters()), **overrides}}."
        )
    for k, p in params.items():
        if p.shape != expected[k].shape:
            raise ValueError(
                f"{arg}[{k!r}] has shape {tuple(p.shape)} but the model's parameter has shape "
                f"{tuple(expected[k].shape)}; pass one task's parameters, without a task dimension."
            )


def no_running_stats(model: nn.Module) -> None:
    """Norm layers that update running statistics in training mode cannot be adapted functionally."""
    for name, m in model.named_modules():
        if m.training and getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None:
            raise ValueError(
                f"{type(m).__name__} {name!r} is in training mode and tracks running statistics: it would "
                f"overwrite them in place on every inner step of every task (and vmap cannot batch that). "
                f"Build it with track_running_stats=False, the MAML convention of normalizing every task "
                f"with its own batch statistics, or call model.eval() to normalize with the fixed running "
                f"statistics."
            )
