"""A module's forward pass at given tensors, exact for modules used at several places of the model.

``torch.func.functional_call`` swaps the given tensors into the module for the call and swaps
the originals back after it. A module registered twice (``nn.Sequential(lin, nn.Tanh(), lin)``)
has one attribute under two names (``0.weight`` and ``2.weight``); with ``tie_weights=True``
functional_call swaps that attribute once per name, so the second swap takes the first one's
tensor for the "original", and restoring leaves a plain tensor in place of the ``nn.Parameter``:
the model loses its parameters and ``.grad`` stays ``None`` (pytorch/pytorch#164759).

:class:`Reparametrized` therefore swaps each attribute once: it maps every ``(module,
attribute)`` pair of the model, found under any of its names, to the name ``named_parameters()``
or ``named_buffers()`` gives its tensor, and calls functional_call with one name per pair and
``tie_weights=False``. Weights tied across different modules (an embedding and an output layer
sharing one ``nn.Parameter``) are two pairs mapped to one tensor, as ``tie_weights=True`` would.
The map is built once, at construction: per call it costs one dict, less than functional_call's
own untying, which walks every module at every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from .checks import close_matches, not_data_parallel

__all__ = ["Reparametrized", "call"]


class Reparametrized:
    """Calls ``module`` at tensors keyed like its ``named_parameters()`` and ``named_buffers()``.

    Args:
        module: the network (or a rule as a module); its structure, not its tensors, is read here,
            once: attach modules or tie weights before building.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._aliases = _aliases(module)

    def stale(self) -> bool:
        """Whether the module's structure changed since the map was built (weights tied or untied, a module added)."""
        return _aliases(self.module) != self._aliases

    def refresh(self) -> None:
        """Builds the map anew from the module as it is now."""
        self._aliases = _aliases(self.module)

    def __call__(
        self, tensors: Mapping[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Any:
        """``module(*args, **kwargs)`` with ``tensors`` in place of its parameters and buffers.

        Args:
            tensors: every parameter and buffer, keyed by its ``named_parameters()`` /
                ``named_buffers()`` name (a missing one raises ``KeyError``: none falls back
                silently to the module's own tensor).
        """
        swapped = {alias: tensors[name] for alias, name in self._aliases.items()}
        # Not strict: strict wants every alias of a twice-registered attribute, which is what breaks the
        # restore. Every (module, attribute) pair is in `swapped`, so none falls back to the module's own.
        return functional_call(self.module, swapped, args, kwargs, tie_weights=False, strict=False)


def call(model: nn.Module, params: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` at ``params``: how to use fast weights, e.g. ``maml.call(model, fast, x)``.

    ``torch.func.functional_call(model, fast, x)`` does the same on most models, but on a model
    that uses a module at two places (``nn.Sequential(lin, nn.Tanh(), lin)``) it replaces the
    model's ``nn.Parameter`` by a plain tensor (pytorch/pytorch#164759), and training then stops
    without a word: ``.grad`` stays ``None``. This call swaps each tensor once and leaves the
    model as it was, on any model the learner takes.

    Args:
        model: the network.
        params: tensors keyed by ``named_parameters()`` / ``named_buffers()`` names, e.g. what
            ``MetaLearner.adapt`` returns (or one task's slice of ``MetaOutput.fast``); a name
            left out takes the model's own tensor.
        *args: the model's positional inputs, e.g. ``x`` ``(n, *x_shape)``.
        **kwargs: the model's keyword inputs.

    Returns:
        What ``model`` returns; differentiable with respect to ``params``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    not_data_parallel("model", model)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict name -> Tensor (e.g. what learner.adapt returns), got {params!r}.")
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    unknown = [k for k in params if k not in own]
    if unknown:
        hints = "; ".join(f"{k!r}{close_matches(k, own)}" for k in unknown)
        raise ValueError(f"params has keys that are not parameters or buffers of the model: {hints}.")
    return Reparametrized(model)({**own, **params}, args, kwargs)


def _aliases(module: nn.Module) -> dict[str, str]:
    """One name per ``(module, attribute)`` pair of ``module`` -> the canonical name of its tensor."""
    canonical: dict[int, str] = {}  # id of a tensor -> the name it has in named_parameters()/named_buffers()
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        canonical.setdefault(id(t), name)
    seen: set[tuple[int, str]] = set()
    aliases: dict[str, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)):
            if (id(sub), attr) in seen:
                continue
            seen.add((id(sub), attr))
            aliases[f"{prefix}.{attr}" if prefix else attr] = canonical[id(t)]
    return aliases
