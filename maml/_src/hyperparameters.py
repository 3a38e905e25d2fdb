"""An update rule's float options, each fixed or meta-learned: what ``maml.Adam(learn=...)`` builds on.

A learned option is a tensor the outer loop trains, as the inner rates are (``learn_inner_lr``),
in the same layouts and through the same code (:class:`~maml._src.rates.InnerRates`):

- ``"scalar"``: one value;
- ``"per_parameter"``: a tensor shaped like each parameter tensor (elementwise);
- ``"per_layer_per_step"``: one value per parameter tensor and inner step, ``(steps,)``; a call
  with more steps than that uses the last step's value, as the rates do.

An option whose update is defined only in a range is learned through a parametrisation, so it
stays in range whatever the outer step does (a clamp would stall it at the boundary with a zero
gradient). The tensor stored, saved and trained is the unconstrained one:

- ``"unit"`` (a beta, a momentum, ``rho``, RMSprop's ``alpha``, dampening, Rprop's ``etaminus``):
  ``value = sigmoid(raw)`` in (0, 1);
- ``"positive"`` (``eps``, ``lr_decay``, ASGD's ``lambd`` and ``alpha``, ``momentum_decay``,
  ``initial_accumulator_value``): ``value = exp(raw)`` in (0, inf);
- ``"above_one"`` (Rprop's ``etaplus``): ``value = 1 + exp(raw)``;
- ``"real"`` (weight decay): ``value = raw``.

So a learned option must start strictly inside its range (a learned momentum cannot start at 0);
the value is also clamped to the open range in floating point, where a sigmoid of 40 rounds to 1,
and ``exp`` continues as a logarithm past a knee below its overflow (:func:`_exp`), so that every
finite raw value maps to a finite value inside the open range with a finite derivative.
The rule's tensors are ``nn.Parameter``\\ s of the rule (an ``nn.Module``), so the engine threads
them beside the rates through every execution path (``rules.BoundRule``) and saves them with the
learner; :meth:`HyperparameterRule.extra_repr` shows the values in range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from .rates import InnerRates

__all__ = ["LAYOUTS", "HyperparameterRule", "Learn", "Range"]

Range = Literal["unit", "positive", "above_one", "real"]
Learn = str | Sequence[str] | Mapping[str, str] | None
LAYOUTS: tuple[str, ...] = ("scalar", "per_parameter", "per_layer_per_step")

# The open interval a learned option stays in, by its range.
_OPEN: dict[str, tuple[float, float]] = {
    "unit": (0.0, 1.0),
    "positive": (0.0, math.inf),
    "above_one": (1.0, math.inf),
    "real": (-math.inf, math.inf),
}


def _raw(value: float, kind: Range) -> float:
    """The unconstrained value whose image under ``kind``'s parametrisation is ``value``."""
    if kind == "unit":
        return math.log(value) - math.log1p(-value)
    if kind == "positive":
        return math.log(value)
    if kind == "above_one":
        return math.log(value - 1)
    return value


def _constrained(raw: Tensor, kind: Range) -> Tensor:
    """``raw``'s image under ``kind``'s parametrisation, inside the open range in ``raw``'s dtype, finite with a finite
    derivative for every finite ``raw``.

    Clamped to the open range in floating point: a sigmoid of 40 rounds to 1, an exp of -800 to 0 and a
    ``1 + exp(-40)`` to 1, where a bias correction or a division would be 0 or an open range closed (their
    derivatives there are 0 to float precision anyway). Past :func:`_exp`'s knee the value grows as a log.
    """
    finfo = torch.finfo(raw.dtype)
    if kind == "unit":
        return torch.sigmoid(raw).clamp(finfo.tiny, 1 - finfo.eps)
    if kind == "positive":
        return _exp(raw).clamp(finfo.tiny, finfo.max)
    if kind == "above_one":
        # 1 + eps is the float after 1: below exp(raw) = eps the sum would round to 1, outside (1, inf).
        return 1 + _exp(raw).clamp_min(finfo.eps)
    return raw


def _knee(dtype: torch.dtype) -> float:
    """Where :func:`_exp` leaves exp: its value past it, ``exp(knee) (1 + log1p(raw - knee))``, stays below the
    dtype's largest float over 16 for every finite raw (``log1p`` of the largest float is ``log(max)``), so an
    update may still add or multiply it by a few without overflowing."""
    log_max = math.log(torch.finfo(dtype).max)
    return log_max - math.log(16 * (1 + log_max))


def _exp(raw: Tensor) -> Tensor:
    """``exp(raw)``, exactly, up to a knee below the dtype's overflow; past it ``exp(knee) (1 + log1p(raw - knee))``:
    finite, increasing and once differentiable, where exp would be inf and its derivative NaN (inf times a zero).

    The knee (:func:`_knee`) is at raw 700.4 in float64 and 81.5 in float32 (5.8 in float16), far past any
    value an option is meant to take, so the value at every ordinary raw is ``exp(raw)``, and past the knee
    the derivative still points the outer step back.
    """
    knee = _knee(raw.dtype)
    below = raw.clamp(max=knee).exp()
    # where's branch not taken gets a zero cotangent: each branch is kept finite (clamped) so that 0 * it is 0.
    past = math.exp(knee) * (1 + torch.log1p((raw - knee).clamp(min=0)))
    return torch.where(raw > knee, past, below)


def _attribute(key: str) -> str:
    """The attribute of an :class:`InnerRates` key: ``value`` for the scalar's, ``/`` for ``.`` in a parameter's name."""
    return "value" if key == "inner_lr" else key.replace(".", "/")


class _Learned(nn.Module):
    """One learned option: its unconstrained tensors in an :class:`InnerRates` layout.

    Keyed ``value`` (a scalar) or by parameter name with ``/`` for ``.``: module attribute names
    cannot hold ``.``, which parameter names do (``"0.weight"``).
    """

    def __init__(self, kind: Range, layout: str, value: float, params: Mapping[str, Tensor], steps: int) -> None:
        super().__init__()
        self.kind = kind
        self.layout = InnerRates(layout, _raw(value, kind), tuple(params))
        for key, raw in self.layout.init(params, steps).items():
            self.register_parameter(_attribute(key), nn.Parameter(raw))

    def at(self, name: str, step: int) -> Tensor:
        """The option's value for the parameter ``name`` at inner step ``step``, in range."""
        key = "inner_lr" if self.layout.kind == "scalar" else name  # InnerRates' keys
        raw = self.layout.at({key: getattr(self, _attribute(key))}, step, [name])[name]
        return _constrained(raw, self.kind)  # type: ignore[arg-type]

    def values(self) -> Tensor:
        """Every value in range, flattened (for ``repr``)."""
        return torch.cat([_constrained(p.detach(), self.kind).flatten() for p in self.parameters()])


class HyperparameterRule(nn.Module):
    """An update rule whose float options may be meta-learned (the module docstring).

    A subclass lists its float options and their ranges in ``RANGES`` and calls
    :meth:`_options` from its ``__init__``; its ``update`` reads an option with :meth:`option`.

    Args of every subclass:
        learn: the float options the outer loop learns: a name or a list of names (each one
            learned scalar), or a mapping of names to layouts (``{"betas": "per_parameter"}``).
            A pair (``betas``, ``etas``) learns both of its values.
        model: the network whose parameters the inner loop adapts; needed by the
            ``"per_parameter"`` and ``"per_layer_per_step"`` layouts, which are shaped by its
            trainable parameters (build the rule after moving the model to its device and dtype).
        steps: the inner steps a ``"per_layer_per_step"`` option has a value for.
    """

    RANGES: ClassVar[dict[str, Range]] = {}  # each float option's range, by its scalar name (beta1, not betas)
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {}  # an option given as a pair: betas -> (beta1, beta2)

    def _options(
        self,
        values: Mapping[str, float],
        learn: Learn,
        model: nn.Module | None,
        steps: int,
    ) -> None:
        """Keeps the float options ``values`` (checked by the subclass) and builds the learned ones."""
        self._values = dict(values)
        layouts = self._layouts(learn)
        needs_model = sorted(n for n, layout in layouts.items() if layout != "scalar")
        if needs_model and not isinstance(model, nn.Module):
            raise ValueError(
                f"{type(self).__name__}(learn=...) learns {', '.join(needs_model)} per parameter tensor, which needs "
                f"the model the inner loop adapts: pass model=model (got {model!r})."
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r}: the inner steps of a per-step option must be an int >= 1.")
        if model is not None:
            params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        else:
            params = {"": torch.zeros(())}  # a scalar layout reads nothing of the parameters but their dtype
        self.learned = nn.ModuleDict()
        for name, layout in layouts.items():
            value, (low, high) = self._values[name], _OPEN[self.RANGES[name]]
            if not low < value < high:
                raise ValueError(
                    f"{type(self).__name__}: a learned {name} must start inside ({low:g}, {high:g}), where "
                    f"its parametrisation maps it, got {value!r}; start it inside (e.g. {name}=0.5 for a value in "
                    f"(0, 1)), or do not learn it."
                )
            self.learned[name] = _Learned(self.RANGES[name], layout, value, params, steps)

    def _layouts(self, learn: Learn) -> dict[str, str]:
        """``learn`` as ``{scalar option name: layout}``."""
        names = ", ".join(map(repr, [*self.PAIRS, *[n for n in self.RANGES if not self._paired(n)]]))
        if learn is None:
            return {}
        if isinstance(learn, str):
            learn = [learn]
        if not isinstance(learn, Mapping):
            if not isinstance(learn, Sequence) or not all(isinstance(n, str) for n in learn):
                raise TypeError(
                    f"learn={learn!r} must name the options to learn: a name, a list of names or a mapping of names "
                    f"to layouts ({', '.join(map(repr, LAYOUTS))}); {type(self).__name__} learns {names}."
                )
            learn = dict.fromkeys(learn, "scalar")
        layouts: dict[str, str] = {}
        for name, layout in learn.items():
            if layout not in LAYOUTS:
                raise ValueError(
                    f"learn[{name!r}]={layout!r} is not a layout; choose one of {', '.join(map(repr, LAYOUTS))}."
                )
            if name in self.PAIRS:
                layouts.update(dict.fromkeys(self.PAIRS[name], layout))
            elif name in self.RANGES and not self._paired(name):
                layouts[name] = layout
            else:
                raise ValueError(
                    f"learn names {name!r}, which is not a float option of {type(self).__name__}; it learns {names}."
                )
        return layouts

    def _paired(self, name: str) -> bool:
        return any(name in pair for pair in self.PAIRS.values())

    def is_learned(self, name: str) -> bool:
        """Whether the option ``name`` (a scalar name: ``beta1``) is meta-learned."""
        return name in self.learned

    def option(self, name: str, param: str, step: int) -> float | Tensor:
        """The option ``name``'s value for the parameter ``param`` at inner step ``step``: its float, or its
        learned tensor in range (a scalar, shaped like the parameter, or one step's value)."""
        if name in self.learned:
            return self.learned[name].at(param, step)  # type: ignore[operator]
        return self._values[name]

    def options(self, param: str, step: int) -> dict[str, Any]:
        """Every float option's value for ``param`` at ``step`` (:meth:`option` of each); read-only."""
        # Nothing learned: the floats themselves, no lookups per parameter and step (a small model's loop feels them).
        if not self.learned:
            return self._values
        return {name: self.option(name, param, step) for name in self.RANGES}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        parts = []
        for name, value in self._values.items():
            if name in self.learned:
                values = self.learned[name].values()  # type: ignore[operator]
                layout = self.learned[name].layout.kind  # type: ignore[union-attr]
                shown = f"{values.item():.6g}" if values.numel() == 1 else f"{values.min():.6g}..{values.max():.6g}"
                parts.append(f"{name}={shown} (learned, {layout})")
            else:
                parts.append(f"{name}={value!r}")
        return ", ".join(parts + [f"{k}={v!r}" for k, v in self._flags().items()])

    def _flags(self) -> dict[str, Any]:
        """The rule's options that are not floats (``nesterov``, ``maximize``), for ``repr``."""
        return {}
