"""The modes as one table: how each trains (grad mode on) and evaluates (off), and which options go together.

Each entry of :data:`TABLE` names the mode's two paths, functions of one :class:`Call`, and what
the mode differentiates; ``MetaLearner.run`` looks the mode up and calls one path, and
``compile=True`` replaces the training path of the modes that compile. Evaluation adapts as
training does: the unrolled modes by the plain inner loop (values only), iMAML on its proximal
problem. :func:`check_options` and :func:`check_mode` hold every rule on which options go together.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor

from . import checkpointed, checks, compiled, eager, implicit, reptile
from .batch import TaskBatch
from .forward import Params, exact_attention, unfused_layers
from .implicit import Implicit
from .loop import MetaOutput, Problem

__all__ = [
    "COMPILED_MODES",
    "MODES",
    "UNROLLED_MODES",
    "TABLE",
    "Call",
    "Mode",
    "attention",
    "check_differentiable",
    "check_mode",
    "check_options",
    "check_step_weights",
    "compiled_path",
    "tasks_per_chunk",
]


@dataclasses.dataclass(frozen=True)
class Call:
    """What every path gets: the inner problem and the options.

    ``problem``: the inner loop, the meta-parameters as the paths take them, the tasks and the
    steps (:class:`~loop.Problem`). ``chunk``: tasks per checkpointed segment or compiled call.
    """

    problem: Problem
    step_weights: Tensor | None
    chunk: int
    checkpoint_every: int | None  # None: checkpointed.segment_steps
    checkpoint_hvp: str
    implicit: Implicit


Path = Callable[[Call], MetaOutput]


def _eager(first_order: bool) -> Path:
    def path(c: Call) -> MetaOutput:
        return eager.run(c.problem, first_order=first_order, step_weights=c.step_weights)

    return path


def _adapt(first_order: bool) -> Callable[[Call], Params]:
    def adapt(c: Call) -> Params:
        return eager.adapt(c.problem, first_order=first_order)[0]

    return adapt


def _implicit_adapt(c: Call) -> Params:  # iMAML's adaptation: the proximal problem, values only
    return implicit.proximal_adapt(c.problem, c.implicit).fast


def _checkpointed(c: Call) -> MetaOutput:
    return checkpointed.run(
        c.problem, chunk=c.chunk, every=c.checkpoint_every, step_weights=c.step_weights, hvp=c.checkpoint_hvp
    )


def _reptile(c: Call) -> MetaOutput:
    return reptile.run(c.problem)


def _implicit(c: Call) -> MetaOutput:
    return implicit.run(c.problem, c.implicit)


def _implicit_evaluation(c: Call) -> MetaOutput:
    return implicit.evaluate(c.problem, c.implicit)


def compiled_path(c: Call, mode: str, cache: dict[str, Any], *, check_finite: bool) -> MetaOutput:
    """The training path of ``compile=True``: the meta-loss and its gradient from the mode's compiled step.

    ``mode``'s step is compiled at its first call and kept in ``cache`` (the learner's, by mode), so
    that setting the mode between steps compiles each once. The step traces the problem's loop; with
    ``check_finite=False`` it runs the loop without the NaN/Inf check.
    """
    if mode not in cache:
        cache[mode] = compiled.compile_step(compiled.meta_step(c.problem.loop, first_order=mode == "first_order"))
    loop = c.problem.loop if check_finite else c.problem.loop.unchecked()
    return compiled.run(cache[mode], c.problem._replace(loop=loop), chunk=c.chunk, step_weights=c.step_weights)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode: its training and evaluation paths, its adaptation (``adapt``), and what it differentiates.

    ``unrolled``: the meta-gradient differentiates the unrolled inner loop, so step weights,
    learned rates and a rule's tensors get gradients; ``twice``: the inner gradients are
    differentiated again (the math attention kernel, which has a double backward);
    ``compiles``: ``compile=True`` applies; ``inputs``: inputs that require grad get their gradient;
    ``plans``: what a memory budget decides (``planner.py``): ``"chunks"``, the tasks whose graphs
    ``backward`` holds at once; ``"segments"``, the tasks replayed together and the segment length
    (planned on a default budget too); ``None``, nothing (memory flat in the tasks' steps).
    """

    train: Path
    evaluate: Path
    adapt: Callable[[Call], Params]
    unrolled: bool
    twice: bool
    compiles: bool
    inputs: bool
    plans: str | None


TABLE: dict[str, Mode] = {
    "second_order": Mode(
        _eager(False), _eager(False), _adapt(False), True, twice=True, compiles=True, inputs=True, plans="chunks"
    ),
    "first_order": Mode(
        _eager(True), _eager(False), _adapt(True), True, twice=False, compiles=True, inputs=True, plans="chunks"
    ),
    "checkpointed": Mode(
        _checkpointed, _eager(False), _adapt(False), True, twice=True, compiles=False, inputs=False, plans="segments"
    ),
    "reptile": Mode(
        _reptile, _eager(False), _adapt(True), False, twice=False, compiles=False, inputs=False, plans=None
    ),
    "implicit": Mode(
        _implicit, _implicit_evaluation, _implicit_adapt, False, twice=False, compiles=False, inputs=False, plans=None
    ),
}
MODES: tuple[str, ...] = tuple(TABLE)
UNROLLED_MODES: tuple[str, ...] = tuple(m for m, spec in TABLE.items() if spec.unrolled)
COMPILED_MODES: tuple[str, ...] = tuple(m for m, spec in TABLE.items() if spec.compiles)

_WHY_NOT_UNROLLED = {
    "reptile": "Reptile moves the initialisation towards the adapted weights and differentiates nothing",
    "implicit": "iMAML's meta-gradient depends on the inner problem's solution alone, not on how it was reached",
}


def check_mode(mode: str, *, compile: bool, learned: str | None) -> None:
    """The rules a mode set on a live learner must meet: ``learned`` names learned rates or a rule's tensors.

    Raises:
        ValueError: naming the option that does not go with ``mode`` and what to do.
    """
    spec = TABLE[mode]
    if not spec.unrolled and (compile or learned):
        what = "compile=True" if compile else learned
        raise ValueError(
            f"mode={mode!r} with {what}: {_WHY_NOT_UNROLLED[mode]}, so it has no gradient for learned rates or rule "
            f"tensors and nothing to compile; drop it, or use mode='first_order'."
        )
    if compile and not spec.compiles:
        raise ValueError(
            "compile=True applies to mode='second_order' or 'first_order': the checkpointed mode "
            "recomputes its segments in a backward pass of its own, which torch.compile cannot trace. "
            "Use mode='second_order' with compile=True for speed, or mode='checkpointed' without it for memory."
        )


def check_options(
    mode: str,
    *,
    batching: str,
    chunk_size: int | None,
    checkpoint_every: int | None,
    checkpoint_hvp: str | None,
    implicit: Implicit | None,
) -> None:
    """The rules on which of ``MetaLearner``'s options go with ``mode``, checked once at construction.

    Raises:
        ValueError: an option that only applies to another mode or batching, naming it and the fix.
    """
    if chunk_size is not None and batching == "loop" and mode != "checkpointed":
        raise ValueError(f"chunk_size={chunk_size} only applies to batching='vmap' or mode='checkpointed'; drop it.")
    if checkpoint_every is not None and mode != "checkpointed":
        raise ValueError(f"checkpoint_every={checkpoint_every} only applies to mode='checkpointed' (mode is {mode!r}).")
    if checkpoint_hvp is not None and mode != "checkpointed":
        raise ValueError(
            f"checkpoint_hvp={checkpoint_hvp!r} only applies to mode='checkpointed' (mode is {mode!r}); "
            f"drop it, or pass mode='checkpointed'."
        )
    if implicit is not None and not isinstance(implicit, Implicit):
        raise TypeError(f"implicit must be a maml.Implicit, e.g. maml.Implicit(lam=1.0), got {implicit!r}.")
    if implicit is not None and mode != "implicit":
        raise ValueError(f"implicit={implicit!r} only applies to mode='implicit' (mode is {mode!r}); drop it.")


def check_step_weights(mode: str, weights: Any, steps: int, like: Tensor, *, compiled: bool) -> Tensor | None:
    """``weights`` as ``checks.step_weights`` returns them, ``(steps,)`` like ``like``, where ``mode`` unrolls a loop.

    Step weights weigh the query losses of an unrolled inner loop: refused by the modes that unroll
    none. ``None`` (no weights) stays ``None``. ``compiled``: the call runs the compiled step.
    """
    if weights is None:
        return None
    if not TABLE[mode].unrolled:
        what = "differentiates none" if mode == "reptile" else "unrolls none"
        raise ValueError(
            f"step_weights weigh the query losses of {'a differentiated' if mode == 'reptile' else 'an unrolled'} "
            f"inner loop; mode={mode!r} {what}: drop step_weights."
        )
    return checks.step_weights(weights, steps, like, compiled=compiled)


def check_differentiable(mode: str, compile: bool, batch: TaskBatch, consts: Params, names: Collection[str]) -> None:
    """``checks.differentiable`` for ``mode``: what its meta-gradient reaches (inputs, unadapted parameters)."""
    spec = TABLE[mode]
    checks.differentiable(mode, compile, batch, consts, names, inputs=spec.inputs, adapts_all=not spec.unrolled)


def attention(mode: str) -> contextlib.AbstractContextManager[object]:
    """The math attention kernel where the inner steps are differentiated twice (``twice`` modes, grad on); else
    attention layers without their fused path, which has no derivative at all (:func:`forward.unfused_layers`)."""
    exact = torch.is_grad_enabled() and TABLE[mode].twice
    return exact_attention() if exact else unfused_layers()


def tasks_per_chunk(chunk_size: int | None, batching: str, tasks: int) -> int:
    """Tasks per checkpointed segment or compiled call (``Call.chunk``): ``chunk_size``, else all with vmap, one with a loop.

    A loop runs the tasks one after another anyway, so taking them one at a time costs no
    speed and holds one task's activations instead of every task's.
    """
    if chunk_size is not None:
        return chunk_size
    return 1 if batching == "loop" else tasks
