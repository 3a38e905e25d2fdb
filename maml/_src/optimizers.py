"""``torch.optim``'s optimizers as differentiable inner-loop update rules, any float option learnable.

Each class is the ``torch.optim`` optimizer of its name, step for step: the same buffers started
as ``torch.optim`` starts them, the same bias corrections and ``eps`` placement, its first step
included, so the fast weights equal ``torch.optim``'s to float rounding. Written by hand because
``torch.optim(differentiable=True)`` updates its buffers in place and keys its state by the
parameter object, so it runs neither under ``vmap`` nor over the flat tensors the checkpointed
mode restores; higher and TorchOpt rewrite it for the same reason.

Every tensor is a function of its inputs, so the meta-gradient flows through the rule, its state
and its learned options (:mod:`hyperparameters`: ``learn=``); ``rates`` is ``lr``, per parameter
tensor and step as ``learn_inner_lr`` lays it out. Where a derivative is undefined the rule takes
one that keeps the meta-gradient finite, and says which in its docstring:

- a square root at 0 (a second moment whose gradients were all 0): derivative 0 (:func:`_safe_sqrt`);
- ``torch.maximum`` (amsgrad, Adamax): the larger argument's derivative, half each at a tie;
- ``sign`` and ``abs`` at 0 (Rprop, Adamax): derivative 0; ``sign`` elsewhere: 0.

The step index ``step`` is 0-based; ``torch.optim``'s is 1-based (``t = step + 1``). Options that
change over steps in ``torch.optim`` (ASGD's ``eta``, NAdam's ``mu_product``) are computed in
closed form from the step index, so the state holds only tensors shaped like the parameters.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import namedtuple
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from .hyperparameters import HyperparameterRule, Learn, Range
from .rules import Params, StepRates

__all__ = [
    "ASGD",
    "INNER_OPTIMIZERS",
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamState",
    "AdamW",
    "Adamax",
    "Momentum",
    "MomentumState",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "make_rule",
]

Value = float | Tensor


def _axpy(x: Tensor, a: Value, y: Tensor) -> Tensor:
    """``x + a * y``, one fused kernel where ``a`` is a float."""
    return x + a * y if isinstance(a, Tensor) else torch.add(x, y, alpha=a)


def _scaled(p: Tensor, rate: Value, d: Tensor) -> Tensor:
    """``p - rate * d``, one fused kernel where ``rate`` is a float."""
    return p - rate * d if isinstance(rate, Tensor) else torch.add(p, d, alpha=-rate)


def _ema_sq(v: Tensor, beta: Value, g: Tensor) -> Tensor:
    """``beta * v + (1 - beta) * g * g``, as ``v.mul_(beta).addcmul_(g, g, value=1 - beta)``."""
    return v * beta + (1 - beta) * g * g if isinstance(beta, Tensor) else torch.addcmul(v * beta, g, g, value=1 - beta)


def _addcdiv(p: Tensor, rate: Value, num: Tensor, den: Tensor) -> Tensor:
    """``p - rate * num / den``: ``torch.optim``'s ``param.addcdiv_(num, den, value=-rate)``, one kernel for a float rate."""
    return p - rate * num / den if isinstance(rate, Tensor) else torch.addcdiv(p, num, den, value=-rate)


def _safe_sqrt(v: Tensor) -> Tensor:
    """``sqrt(v)`` where ``v > 0``, else ``sqrt(tiny)`` (the dtype's smallest normal number), with derivative 0 at
    ``v == 0`` instead of ``inf``.

    A second moment is 0 exactly where every gradient so far was 0; there the numerator it divides
    is 0 too, so the update does not depend on ``sqrt(v)`` to first order, and a zero derivative
    gives the true value where autograd's ``inf * 0`` would give NaN. Its value there,
    ``sqrt(tiny)`` (1e-154 in float64, 1e-19 in float32), vanishes beside any ``eps`` it is added to.
    Plain ops (no ``autograd.Function``), so ``torch.func`` transforms and double backward see through it;
    ``where`` keeps a boolean mask for the backward pass, where ``clamp_min`` would keep ``v`` itself.
    """
    return torch.where(v > 0, v, torch.finfo(v.dtype).tiny).sqrt()


def _state_type(name: str, fields: tuple[str, ...]) -> type:
    """A named state type with ``fields`` (one per configuration of a rule whose buffers depend on its options)."""
    return _STATE_TYPES.setdefault((name, fields), namedtuple(name, fields))  # type: ignore[misc]


_STATE_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}


class MomentumState(NamedTuple):
    """:class:`SGD`'s state with momentum: the momentum buffer of every parameter."""

    buffer: Params


class AdamState(NamedTuple):
    """The first and second moments of every parameter (``torch.optim.Adam``'s names)."""

    exp_avg: Params
    exp_avg_sq: Params


class _Rule(HyperparameterRule):
    """What every ``torch.optim`` rule shares: ``maximize`` and weight decay as ``torch.optim`` applies them."""

    linear: ClassVar[bool] = False

    def __init__(
        self, values: Mapping[str, Any], flags: Mapping[str, bool], learn: Learn, model: nn.Module | None, steps: int
    ) -> None:
        """``values``: the float options as the constructor takes them, a pair (``betas``) as one entry."""
        super().__init__()
        floats: dict[str, float] = {}
        for option, value in values.items():
            if option in self.PAIRS:
                for i, (name, v) in enumerate(zip(self.PAIRS[option], _pair(type(self).__name__, option, value))):
                    floats[name] = _checked_float(type(self).__name__, name, f"{option}[{i}]", v, self.RANGES[name])
            else:
                floats[option] = _checked_float(type(self).__name__, option, option, value, self.RANGES[option])
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{type(self).__name__}: {name} must be True or False, got {flag!r}.")
        self._flag_values = dict(flags)
        self._options(floats, learn, model, steps)

    def _flags(self) -> dict[str, Any]:
        return self._flag_values

    def _decayed(self, g: Tensor, p: Tensor, rate: Value, wd: Value) -> tuple[Tensor, Tensor]:
        """``torch.optim``'s ``grad`` and ``param`` before its step: the gradient negated under ``maximize``, then
        weight decay, coupled (``grad + weight_decay * param``) or, with ``decoupled_weight_decay``, decoupled
        (``param * (1 - lr * weight_decay)``, AdamW's)."""
        g = -g if self._flag_values.get("maximize") else g
        if isinstance(wd, float) and wd == 0:
            return g, p
        if self._flag_values.get("decoupled_weight_decay"):
            return g, p * (1 - rate * wd)
        return _axpy(g, wd, p), p

    def init(self, params: Params) -> tuple[Params, ...]:
        return self._state(*({k: torch.zeros_like(p) for k, p in params.items()} for _ in self._state._fields))

    _state: ClassVar[Any] = _state_type("NoState", ())


# Each option's allowed fixed values as torch.optim allows them: (low, high, low allowed, high allowed), by its range
# and, where one option differs from its range's, by its name (eps 0 would divide by zero; etaminus 0 freeze a step).
_FIXED: dict[str, tuple[float, float, bool, bool]] = {
    "unit": (0.0, 1.0, True, False),
    "positive": (0.0, math.inf, True, False),
    "above_one": (1.0, math.inf, False, False),
    "real": (0.0, math.inf, True, False),  # torch.optim refuses a negative weight decay; learned, any real
    "eps": (0.0, math.inf, False, False),
    "etaminus": (0.0, 1.0, False, False),
    "dampening": (0.0, 1.0, True, True),
}


def _checked_float(rule: str, name: str, shown: str, value: Any, kind: Range) -> float:
    """``value`` of the option ``name`` (``shown`` as the caller wrote it: ``betas[1]``), in its fixed range."""
    low, high, with_low, with_high = _FIXED.get(name, _FIXED[kind])
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (
        (low <= value if with_low else low < value) and (value <= high if with_high else value < high)
    ):
        interval = f"{'[' if with_low else '('}{low:g}, {high:g}{']' if with_high else ')'}"
        raise ValueError(f"{rule}: {shown}={value!r} is out of range; it must be a float in {interval}.")
    return float(value)


class SGD(_Rule):
    """``torch.optim.SGD(momentum, dampening, weight_decay, nesterov, maximize=...)``; plain MAML by default.

    With momentum, the first step's buffer is the gradient itself (``torch.optim``'s
    ``grad.clone()``: no dampening on it). Linear in (params, state, grads) at fixed options.
    """

    linear: ClassVar[bool] = True
    RANGES: ClassVar[dict[str, Range]] = {"momentum": "unit", "dampening": "unit", "weight_decay": "real"}

    def __init__(
        self,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"momentum": momentum, "dampening": dampening, "weight_decay": weight_decay}
        super().__init__(values, {"nesterov": nesterov, "maximize": maximize}, learn, model, steps)
        with_momentum = self.is_learned("momentum") or self._values["momentum"] != 0
        if nesterov and (not with_momentum or self._values["dampening"] != 0 or self.is_learned("dampening")):
            raise ValueError(
                f"{type(self).__name__}: Nesterov momentum needs a momentum > 0 and zero dampening (torch.optim.SGD "
                f"refuses it too); pass a momentum in (0, 1) and dampening=0, or nesterov=False."
            )
        self._state = MomentumState if with_momentum else _state_type("NoState", ())

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new, buffers = {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            if self._state is MomentumState:
                buf = g if step == 0 else _axpy(state[0][k] * o["momentum"], 1 - o["dampening"], g)
                buffers[k] = buf
                g = _axpy(g, o["momentum"], buf) if self._flag_values["nesterov"] else buf
            new[k] = _scaled(p, rates[k], g)
        return new, (MomentumState(buffers) if self._state is MomentumState else self._state())


class Momentum(SGD):
    """``torch.optim.SGD`` with momentum 0.9 by default: the ``"momentum"`` rule (:class:`SGD`'s options)."""

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, **options: Any) -> None:
        super().__init__(momentum=momentum, nesterov=nesterov, **options)


class Adam(_Rule):
    """``torch.optim.Adam(betas, eps, weight_decay, amsgrad, maximize=..., decoupled_weight_decay=...)``.

    Both moments start at zero and are bias-corrected with the step index; ``eps`` is added to
    ``sqrt(v) / sqrt(1 - beta2^t)``. amsgrad's running maximum is differentiated as
    ``torch.maximum``: the larger argument's derivative, half each at a tie. A square root at 0
    has derivative 0 (:func:`_safe_sqrt`), so a parameter whose gradient is 0 gets no NaN.
    """

    RANGES: ClassVar[dict[str, Range]] = {"beta1": "unit", "beta2": "unit", "eps": "positive", "weight_decay": "real"}
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {"betas": ("beta1", "beta2")}
    _DECOUPLED: ClassVar[bool] = False

    def __init__(
        self,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        decoupled = self._DECOUPLED if decoupled_weight_decay is None else decoupled_weight_decay
        values = {"betas": betas, "eps": eps, "weight_decay": weight_decay}
        flags = {"amsgrad": amsgrad, "maximize": maximize, "decoupled_weight_decay": decoupled}
        super().__init__(values, flags, learn, model, steps)
        self._state = _state_type("AMSGradState", (*AdamState._fields, "max_exp_avg_sq")) if amsgrad else AdamState

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        t, flags = step + 1, self._flag_values
        new: Params = {}
        parts: tuple[Params, ...] = tuple({} for _ in self._state._fields)
        for k, p in params.items():
            o = self.options(k, step)
            b1, b2, wd = o["beta1"], o["beta2"], o["weight_decay"]
            g, p = self._decayed(grads[k], p, rates[k], wd)
            m = torch.lerp(state[0][k], g, 1 - b1)
            v = _ema_sq(state[1][k], b2, g)
            parts[0][k], parts[1][k] = m, v
            if flags["amsgrad"]:
                v = parts[2][k] = torch.maximum(state[2][k], v)
            denom = _safe_sqrt(v) / (1 - b2**t) ** 0.5 + o["eps"]
            new[k] = _addcdiv(p, rates[k] / (1 - b1**t), m, denom)
        return new, self._state(*parts)


class AdamW(Adam):
    """``torch.optim.AdamW``: :class:`Adam` with decoupled weight decay, 0.01 by default."""

    _DECOUPLED: ClassVar[bool] = True

    def __init__(
        self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, **options: Any
    ) -> None:
        if "decoupled_weight_decay" in options:
            raise TypeError(
                "AdamW's weight decay is decoupled by definition; use maml.Adam(decoupled_weight_decay=...)."
            )
        super().__init__(betas, eps, weight_decay, **options)


class RMSprop(_Rule):
    """``torch.optim.RMSprop(alpha, eps, weight_decay, momentum, centered, maximize=...)``.

    ``eps`` is added to the square root of the (centered) second moment; the momentum buffer
    starts at zero. A square root at 0 has derivative 0 (:func:`_safe_sqrt`).
    """

    RANGES: ClassVar[dict[str, Range]] = {
        "alpha": "unit",
        "eps": "positive",
        "weight_decay": "real",
        "momentum": "unit",
    }

    def __init__(
        self,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"alpha": alpha, "eps": eps, "weight_decay": weight_decay, "momentum": momentum}
        super().__init__(values, {"centered": centered, "maximize": maximize}, learn, model, steps)
        self._momentum = self.is_learned("momentum") or self._values["momentum"] > 0
        fields = ("square_avg", *(("grad_avg",) if centered else ()), *(("momentum_buffer",) if self._momentum else ()))
        self._state = _state_type("RMSpropState", fields)

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        was = dict(zip(self._state._fields, state, strict=True))
        out: dict[str, Params] = {f: {} for f in self._state._fields}
        new = {}
        for k, p in params.items():
            o = self.options(k, step)
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            square_avg = out["square_avg"][k] = _ema_sq(was["square_avg"][k], o["alpha"], g)
            if "grad_avg" in was:
                grad_avg = out["grad_avg"][k] = torch.lerp(was["grad_avg"][k], g, 1 - o["alpha"])
                avg = _safe_sqrt(torch.addcmul(square_avg, grad_avg, grad_avg, value=-1))
            else:
                avg = _safe_sqrt(square_avg)
            avg = avg + o["eps"]
            if self._momentum:
                buf = out["momentum_buffer"][k] = torch.addcdiv(was["momentum_buffer"][k] * o["momentum"], g, avg)
                new[k] = _scaled(p, rates[k], buf)
            else:
                new[k] = _addcdiv(p, rates[k], g, avg)
        return new, self._state(**out)


class Adagrad(_Rule):
    """``torch.optim.Adagrad(lr_decay, weight_decay, initial_accumulator_value, eps, maximize=...)``.

    The step is ``lr / (1 + (t - 1) lr_decay)``; the sum of squares starts at
    ``initial_accumulator_value`` (added at the first step, so that a learned one is threaded as
    every learned option is). A square root at 0 has derivative 0 (:func:`_safe_sqrt`).
    """

    RANGES: ClassVar[dict[str, Range]] = {
        "lr_decay": "positive",
        "weight_decay": "real",
        "initial_accumulator_value": "positive",
        "eps": "positive",
    }

    def __init__(
        self,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
        }
        super().__init__(values, {"maximize": maximize}, learn, model, steps)
        self._state = _state_type("AdagradState", ("sum",))

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new, sums = {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            start = state[0][k] + o["initial_accumulator_value"] if step == 0 else state[0][k]
            total = sums[k] = torch.addcmul(start, g, g)
            clr = rates[k] / (1 + step * o["lr_decay"])
            new[k] = _addcdiv(p, clr, g, _safe_sqrt(total) + o["eps"])
        return new, self._state(sums)


class Adadelta(_Rule):
    """``torch.optim.Adadelta(rho, eps, weight_decay, maximize=...)``; ``rates`` is its ``lr`` (1.0 in torch.optim)."""

    RANGES: ClassVar[dict[str, Range]] = {"rho": "unit", "eps": "positive", "weight_decay": "real"}

    def __init__(
        self,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        super().__init__(
            {"rho": rho, "eps": eps, "weight_decay": weight_decay}, {"maximize": maximize}, learn, model, steps
        )
        self._state = _state_type("AdadeltaState", ("square_avg", "acc_delta"))

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new, square_avgs, acc_deltas = {}, {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            rho, eps = o["rho"], o["eps"]
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            square_avg = square_avgs[k] = _ema_sq(state[0][k], rho, g)
            delta = (state[1][k] + eps).sqrt() / (square_avg + eps).sqrt() * g
            acc_deltas[k] = _ema_sq(state[1][k], rho, delta)
            new[k] = _scaled(p, rates[k], delta)
        return new, self._state(square_avgs, acc_deltas)


class Adamax(_Rule):
    """``torch.optim.Adamax(betas, eps, weight_decay, maximize=...)``.

    The infinity norm ``max(beta2 * u, |g| + eps)`` is differentiated as ``torch.maximum``: the
    larger argument's derivative, half each at a tie; ``|g|`` has derivative 0 at ``g == 0``.
    """

    RANGES: ClassVar[dict[str, Range]] = {"beta1": "unit", "beta2": "unit", "eps": "positive", "weight_decay": "real"}
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {"betas": ("beta1", "beta2")}

    def __init__(
        self,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(values, {"maximize": maximize}, learn, model, steps)
        self._state = _state_type("AdamaxState", ("exp_avg", "exp_inf"))

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new, exp_avgs, exp_infs = {}, {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            m = exp_avgs[k] = torch.lerp(state[0][k], g, 1 - o["beta1"])
            u = exp_infs[k] = torch.maximum(state[1][k] * o["beta2"], g.abs() + o["eps"])
            new[k] = _addcdiv(p, rates[k] / (1 - o["beta1"] ** (step + 1)), m, u)
        return new, self._state(exp_avgs, exp_infs)


class NAdam(_Rule):
    """``torch.optim.NAdam(betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize=...)``.

    The momentum schedule ``mu_t = beta1 (1 - 0.96^(t psi) / 2)`` and its running product
    (``torch.optim``'s ``mu_product``) are computed from the step index, each ``mu_t`` with step
    ``t``'s options (as ``torch.optim`` with options changed between steps). A square root at 0
    has derivative 0 (:func:`_safe_sqrt`).
    """

    RANGES: ClassVar[dict[str, Range]] = {
        "beta1": "unit",
        "beta2": "unit",
        "eps": "positive",
        "weight_decay": "real",
        "momentum_decay": "positive",
    }
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {"betas": ("beta1", "beta2")}

    def __init__(
        self,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum_decay": momentum_decay}
        flags = {"decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize}
        super().__init__(values, flags, learn, model, steps)
        self._state = AdamState

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        t = step + 1
        new, exp_avgs, exp_avg_sqs = {}, {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            b1, b2, wd, psi, lr = o["beta1"], o["beta2"], o["weight_decay"], o["momentum_decay"], rates[k]
            g, p = self._decayed(grads[k], p, lr, wd)
            # mu_1 .. mu_t, each with its own step's beta1 and psi (torch.optim multiplies mu_product by each
            # step's mu in turn), and mu_{t+1} with this step's.
            mus = [self._mu(k, i) for i in range(t)]
            mu, mu_next = mus[-1], b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * psi))
            mu_product = functools.reduce(lambda a, b: a * b, mus)
            m = exp_avgs[k] = torch.lerp(state[0][k], g, 1 - b1)
            v = exp_avg_sqs[k] = _ema_sq(state[1][k], b2, g)
            denom = _safe_sqrt(v / (1 - b2**t)) + o["eps"]
            p = _addcdiv(p, lr * (1.0 - mu) / (1.0 - mu_product), g, denom)
            new[k] = _addcdiv(p, lr * mu_next / (1.0 - mu_product * mu_next), m, denom)
        return new, AdamState(exp_avgs, exp_avg_sqs)

    def _mu(self, param: str, step: int) -> Value:
        """The momentum ``mu`` of the 0-based step ``step``, with that step's options."""
        b1, psi = self.option("beta1", param, step), self.option("momentum_decay", param, step)
        return b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * psi))


class RAdam(_Rule):
    """``torch.optim.RAdam(betas, eps, weight_decay, decoupled_weight_decay, maximize=...)``.

    The variance rectification applies at the steps where ``rho_t > 5`` (the step index decides
    where ``beta2`` is fixed; where it is learned, ``torch.where`` on its value, with the branch not
    taken kept finite). A square root at 0 has derivative 0 (:func:`_safe_sqrt`).
    """

    RANGES: ClassVar[dict[str, Range]] = {"beta1": "unit", "beta2": "unit", "eps": "positive", "weight_decay": "real"}
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {"betas": ("beta1", "beta2")}

    def __init__(
        self,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"betas": betas, "eps": eps, "weight_decay": weight_decay}
        flags = {"decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize}
        super().__init__(values, flags, learn, model, steps)
        self._state = AdamState

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        t = step + 1
        new, exp_avgs, exp_avg_sqs = {}, {}, {}
        for k, p in params.items():
            o = self.options(k, step)
            b1, b2, wd, lr = o["beta1"], o["beta2"], o["weight_decay"], rates[k]
            g, p = self._decayed(grads[k], p, lr, wd)
            m = exp_avgs[k] = torch.lerp(state[0][k], g, 1 - b1)
            v = exp_avg_sqs[k] = _ema_sq(state[1][k], b2, g)
            corrected = m / (1 - b1**t)
            correction2 = 1 - b2**t
            rho_inf = 2 / (1 - b2) - 1
            rho_t = rho_inf - 2 * t * b2**t / correction2
            if isinstance(rho_t, float):
                if rho_t > 5.0:
                    new[k] = _scaled(
                        p, 1.0, corrected * lr * _adaptive(v, correction2, o["eps"]) * _rect(rho_t, rho_inf)
                    )
                else:
                    new[k] = _scaled(p, 1.0, corrected * lr)
            else:
                rectified = rho_t > 5.0
                # Inside the branch not taken the rectification's square root would be of a negative number,
                # and where's zero cotangent times its NaN derivative is NaN: give it values it is finite at.
                safe_t, safe_inf = torch.where(rectified, rho_t, 6.0), torch.where(rectified, rho_inf, 6.0)
                scale = torch.where(rectified, _rect(safe_t, safe_inf) * _adaptive(v, correction2, o["eps"]), 1.0)
                new[k] = _scaled(p, 1.0, corrected * lr * scale)
        return new, AdamState(exp_avgs, exp_avg_sqs)


def _rect(rho_t: Value, rho_inf: Value) -> Value:
    """RAdam's variance rectification term."""
    return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


def _adaptive(v: Tensor, correction2: Value, eps: Value) -> Tensor:
    """RAdam's adaptive learning rate ``sqrt(1 - beta2^t) / (sqrt(v) + eps)``."""
    return correction2**0.5 / (_safe_sqrt(v) + eps)


class Rprop(_Rule):
    """``torch.optim.Rprop(etas, step_sizes, maximize=...)``: each step size starts at ``rates`` (its ``lr``).

    The step is ``-sign(g) * step_size``: ``sign`` has derivative 0, so the meta-gradient reaches
    the initial parameters only through the identity and reaches ``lr`` and the etas through the
    step sizes (the clamp to ``step_sizes`` has derivative 0 outside it). The etas can be learned;
    ``step_sizes``, the clamp's bounds, are fixed.
    """

    RANGES: ClassVar[dict[str, Range]] = {"etaminus": "unit", "etaplus": "above_one"}
    PAIRS: ClassVar[dict[str, tuple[str, str]]] = {"etas": ("etaminus", "etaplus")}

    def __init__(
        self,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50.0),
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        lo, hi = _pair(type(self).__name__, "step_sizes", step_sizes)
        if not 0 <= lo <= hi:
            raise ValueError(f"Rprop: step_sizes={step_sizes!r} must be (min, max) with 0 <= min <= max.")
        self._bounds = (float(lo), float(hi))
        super().__init__({"etas": etas}, {"maximize": maximize}, learn, model, steps)
        self._state = _state_type("RpropState", ("prev", "step_size"))

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new, prevs, step_sizes = {}, {}, {}
        lo, hi = self._bounds
        for k, p in params.items():
            o = self.options(k, step)
            g = -grads[k] if self._flag_values["maximize"] else grads[k]
            if step == 0:  # the previous gradient is 0: every factor is 1
                size = torch.clamp(torch.zeros_like(p) + rates[k], lo, hi)
                backtrack = None
            else:
                sign = (g * state[0][k]).sign()
                factor = torch.where(sign > 0, o["etaplus"], torch.where(sign < 0, o["etaminus"], 1.0))
                size = torch.clamp(state[1][k] * factor, lo, hi)
                backtrack = sign < 0  # torch.optim's sign.eq(etaminus), as etaminus < 1 < etaplus
            g = g if backtrack is None else torch.where(backtrack, 0.0, g)
            prevs[k], step_sizes[k] = g, size
            new[k] = p - g.sign() * size
        return new, self._state(prevs, step_sizes)

    def _flags(self) -> dict[str, Any]:
        return {"step_sizes": self._bounds, **self._flag_values}


class ASGD(_Rule):
    """``torch.optim.ASGD(lambd, alpha, weight_decay, maximize=...)``: the parameters it steps.

    Step ``t`` uses ``eta = lr / (1 + lambd lr (t - 1))^alpha`` (``torch.optim``'s ``eta``, from the
    step index), with step ``t``'s options and rate (``torch.optim`` computes it at the end of step
    ``t - 1`` from that step's: the same where they are fixed). The running average ``ax`` (and its ``t0``), which ``torch.optim.ASGD`` keeps but
    never steps with, is not kept: the fast weights are the iterates. Linear in (params, grads).
    """

    linear: ClassVar[bool] = True
    RANGES: ClassVar[dict[str, Range]] = {"lambd": "positive", "alpha": "positive", "weight_decay": "real"}

    def __init__(
        self,
        lambd: float = 1e-4,
        alpha: float = 0.75,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        learn: Learn = None,
        model: nn.Module | None = None,
        steps: int = 1,
    ) -> None:
        values = {"lambd": lambd, "alpha": alpha, "weight_decay": weight_decay}
        super().__init__(values, {"maximize": maximize}, learn, model, steps)

    def update(self, grads: Params, state: tuple, params: Params, step: int, rates: StepRates) -> tuple[Params, tuple]:
        new = {}
        for k, p in params.items():
            o = self.options(k, step)
            lr, lambd = rates[k], o["lambd"]
            eta = lr if step == 0 else _asgd_eta(lr, lambd, step, o["alpha"])
            g, p = self._decayed(grads[k], p, rates[k], o["weight_decay"])
            new[k] = _scaled(p * (1 - lambd * eta), eta, g)
        return new, self._state()


def _asgd_eta(lr: Value, lambd: Value, step: int, alpha: Value) -> Value:
    """ASGD's ``eta = lr / (1 + lambd lr step)^alpha`` (``torch.optim``'s) at the 0-based step ``step >= 1``.

    A learned ``alpha`` takes the form ``lr exp(-alpha log1p(lambd lr step))``, equal to rounding: the
    power overflows to inf at a large ``alpha`` (the top of its range), where its derivative, inf times
    the zero that eta's divides it by, is NaN; the exp underflows to 0, with derivative 0.
    """
    x = lambd * lr * step
    if not isinstance(alpha, Tensor):
        return lr / ((1 + x) ** alpha)
    return lr * torch.exp(-alpha * (torch.log1p(x) if isinstance(x, Tensor) else math.log1p(x)))


def _pair(rule: str, name: str, value: Any) -> tuple[float, float]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{rule}: {name}={value!r} must be a pair of floats, e.g. {name}={_EXAMPLES[name]}.")
    return float(value[0]), float(value[1])


_EXAMPLES = {"betas": "(0.9, 0.999)", "etas": "(0.5, 1.2)", "step_sizes": "(1e-6, 50)"}

_BY_NAME: dict[str, type[_Rule]] = {
    "sgd": SGD,
    "momentum": Momentum,
    "adam": Adam,
    "adamw": AdamW,
    "rmsprop": RMSprop,
    "adagrad": Adagrad,
    "adadelta": Adadelta,
    "adamax": Adamax,
    "nadam": NAdam,
    "radam": RAdam,
    "rprop": Rprop,
    "asgd": ASGD,
}
INNER_OPTIMIZERS: tuple[str, ...] = tuple(_BY_NAME)


def options_of(name: str) -> tuple[str, ...]:
    """The options the rule ``name`` takes (its constructor's, less those the learner gives it)."""
    cls = _BY_NAME[name]
    found: list[str] = []
    for klass in cls.__mro__:  # Momentum and AdamW pass the rest on to SGD's and Adam's
        if klass in (_Rule, HyperparameterRule):
            break
        for n, param in inspect.signature(klass.__init__).parameters.items():
            if n != "self" and param.kind is not param.VAR_KEYWORD and n not in found:
                found.append(n)
    return tuple(
        n for n in found if n not in ("model", "steps") and not (cls is AdamW and n == "decoupled_weight_decay")
    )


def make_rule(name: str, options: Mapping[str, Any] | None, model: nn.Module, steps: int) -> _Rule:
    """The rule ``name`` built from ``options`` for ``model`` (whose trainable parameters shape a learned option's
    per-parameter layouts) and ``steps`` (of a per-step one), validated, its errors naming ``inner_optimizer_options``."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"inner_optimizer_options must be a mapping of option names to values, e.g. {{'momentum': 0.9}}, "
            f"got {type(options).__name__} {options!r}."
        )
    options = dict(options or {})
    allowed = options_of(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"inner_optimizer_options has {', '.join(map(repr, unknown))}, which inner_optimizer={name!r} "
            f"does not take; its options are {', '.join(map(repr, allowed))}."
        )
    try:
        return _BY_NAME[name](**options, model=model, steps=max(steps, 1))
    except (TypeError, ValueError) as error:
        raise type(error)(f"inner_optimizer_options for inner_optimizer={name!r}: {error}") from None
