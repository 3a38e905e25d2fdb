"""A call's parameters as every path takes them: the adapted ones, and the constants beside them.

The inner loop differentiates the adapted parameters and threads the rest through unchanged:
the other parameters (trained or frozen) and the buffers, in one ``consts`` dict keyed like
``named_parameters()`` and ``named_buffers()``.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from torch import Tensor, nn

from . import checks
from .forward import Params
from .rules import RULE_PREFIX

__all__ = ["constants", "split"]


def constants(model: nn.Module, params: Params, adapted: Container[str]) -> Params:
    """The parameters of ``params`` not in ``adapted``, and the model's buffers."""
    consts = {k: v for k, v in params.items() if k not in adapted}
    consts.update(model.named_buffers())
    return consts


def split(
    model: nn.Module,
    adapted: Sequence[str],
    params: Params | None,
    rate_values: Params,
    integer_inputs: bool,
    *inputs: Tensor,
) -> tuple[Params, Params]:
    """Validates a call's parameters and inputs, then splits the parameters into adapted ones and constants.

    Args:
        model: the learner's network.
        adapted: the names of the parameters the inner loop updates.
        params: the initial parameters, keyed like ``dict(model.named_parameters())``; ``None``:
            the model's current ones.
        rate_values: the learnable rates and the rule's tensors, which must be placed like the parameters.
        integer_inputs: the model embeds integer inputs (``nn.Embedding``).
        inputs: ``(T, n, *x_shape)`` ``support_x`` (and ``query_x``), in that order, for their dtype.

    Returns:
        The adapted parameters and the constants (:func:`constants`).
    """
    if params is None:
        params = dict(model.named_parameters())
    else:
        if not isinstance(params, dict):
            raise TypeError(f"params must be a dict name -> Tensor, got {type(params).__name__}.")
        checks.parameter_names("params", params, model)
    checks.no_running_stats(model)
    first = params[adapted[0]]
    for name, x in zip(("support_x", "query_x"), inputs):
        checks.input_dtype(name, x, first.dtype, integer_inputs)
    checks.placed_like(rate_values, first, RULE_PREFIX)
    return {k: params[k] for k in adapted}, constants(model, params, adapted)
