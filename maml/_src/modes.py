"""The modes as one table: how each trains (grad mode on) and evaluates (off), and which options go together.

Each entry of :data:`TABLE` names the mode's two paths, functions of one :class:`Call`, and what
the mode differentiates; ``MetaLearner.run`` looks the mode up and calls one path, and
``compile=True`` replaces the training path of the modes that compile. Evaluation adapts as
training does: the unrolled modes by the plain inner loop (values only), iMAML on its proximal
problem. :func:`check_options` and :func:`check_mode` hold every rule on which options go together.
A mode as a user names it is a :class:`Mode`: a name for the modes without options, and for the two
with, :class:`Checkpointed` and :class:`Implicit`, an object that checks its options when built. A
new mode is a row of :data:`TABLE`, and, if it has options, a class beside these and its entry of
:data:`OPTIONS` (``docs/extending.md`` adds one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor

from . import checkpointed, checks, compiled, eager, implicit, reptile
from .batch import TaskBatch
from .forward import Params, exact_attention, unfused_layers
from .loop import MetaOutput, Problem

__all__ = [
    "CHECKPOINT_HVPS",
    "COMPILED_MODES",
    "MODES",
    "UNROLLED_MODES",
    "TABLE",
    "Call",
    "Checkpointed",
    "Implicit",
    "Mode",
    "OPTIONS",
    "Paths",
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
    ``mode``: the mode with its options, a planned segment length filled in.
    """

    problem: Problem
    step_weights: Tensor | None
    chunk: int
    mode: Mode


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
    return implicit.proximal_adapt(c.problem, _options(c, Implicit)).fast


def _options(c: Call, kind: type[Mode]) -> Any:
    assert isinstance(c.mode, kind), c.mode  # the table's row and the mode's class go together
    return c.mode


def _checkpointed(c: Call) -> MetaOutput:
    m: Checkpointed = _options(c, Checkpointed)
    return checkpointed.run(c.problem, chunk=c.chunk, every=m.every, step_weights=c.step_weights, hvp=m.hvp)


def _reptile(c: Call) -> MetaOutput:
    return reptile.run(c.problem)


def _implicit(c: Call) -> MetaOutput:
    return implicit.run(c.problem, _options(c, Implicit))


def _implicit_evaluation(c: Call) -> MetaOutput:
    return implicit.evaluate(c.problem, _options(c, Implicit))


def compiled_path(c: Call, cache: dict[str, Any], *, check_finite: bool) -> MetaOutput:
    """The training path of ``compile=True``: the meta-loss and its gradient from the mode's compiled step.

    ``mode``'s step is compiled at its first call and kept in ``cache`` (the learner's, by mode), so
    that setting the mode between steps compiles each once. The step traces the problem's loop; with
    ``check_finite=False`` it runs the loop without the NaN/Inf check.
    """
    mode = c.mode.name
    if mode not in cache:
        cache[mode] = compiled.compile_step(compiled.meta_step(c.problem.loop, first_order=not TABLE[mode].twice))
    loop = c.problem.loop if check_finite else c.problem.loop.unchecked()
    return compiled.run(cache[mode], c.problem._replace(loop=loop), chunk=c.chunk, step_weights=c.step_weights)


@dataclasses.dataclass(frozen=True)
class Paths:
    """One mode's row: its training and evaluation paths, its adaptation (``adapt``), and what it differentiates.

    ``unrolled``: the meta-gradient differentiates the unrolled inner loop, so step weights,
    learned rates and a rule's tensors get gradients; ``twice``: the inner gradients are
    differentiated again (the math attention kernel, which has a double backward);
    ``compiles``: ``compile=True`` applies; ``inputs``: inputs that require grad get their gradient;
    ``plans``: what a memory budget decides (``planner.py``): ``"chunks"``, the tasks whose graphs
    ``backward`` holds at once; ``"segments"``, the tasks replayed together and the segment length
    (planned on a default budget too); ``None``, nothing (memory flat in the tasks' steps);
    ``hessian``: the meta-gradient takes second derivatives of the support loss (Hessian-vector
    products included), so an operator with a wrong one (``weight_norm``) makes it wrong.
    """

    train: Path
    evaluate: Path
    adapt: Callable[[Call], Params]
    unrolled: bool
    twice: bool
    compiles: bool
    inputs: bool
    plans: str | None
    hessian: bool


# fmt: off
TABLE: dict[str, Paths] = {
    "second_order": Paths(_eager(False), _eager(False), _adapt(False), True,
                          twice=True, compiles=True, inputs=True, plans="chunks", hessian=True),
    "first_order": Paths(_eager(True), _eager(False), _adapt(True), True,
                         twice=False, compiles=True, inputs=True, plans="chunks", hessian=False),
    "checkpointed": Paths(_checkpointed, _eager(False), _adapt(False), True,
                          twice=True, compiles=False, inputs=False, plans="segments", hessian=True),
    "reptile": Paths(_reptile, _eager(False), _adapt(True), False,
                     twice=False, compiles=False, inputs=False, plans=None, hessian=False),
    "implicit": Paths(_implicit, _implicit_evaluation, _implicit_adapt, False,
                      twice=False, compiles=False, inputs=False, plans=None, hessian=True),
}
# fmt: on
MODES: tuple[str, ...] = tuple(TABLE)
UNROLLED_MODES: tuple[str, ...] = tuple(m for m, spec in TABLE.items() if spec.unrolled)
COMPILED_MODES: tuple[str, ...] = tuple(m for m, spec in TABLE.items() if spec.compiles)


CHECKPOINT_HVPS: tuple[str, ...] = ("reverse_over_reverse", "forward_over_reverse")


@dataclasses.dataclass(frozen=True, eq=False)
class Mode:
    """How the meta-gradient is computed: ``MetaLearner(mode=...)`` and ``learner.mode``.

    A mode without options is ``Mode("second_order")`` (``mode="second_order"`` builds it); the modes
    with options subclass it (:class:`Checkpointed`, :class:`Implicit`). A mode compares equal to
    its name where its options are the defaults (``learner.mode == "checkpointed"``), and its
    properties say what it differentiates, as the learner's checks read them.

    Attributes:
        name: one of ``maml.MODES``.
    """

    name: str

    def __post_init__(self) -> None:
        checks.one_of("mode", self.name, tuple(TABLE))
        own = OPTIONS.get(self.name)
        if own is not None and not isinstance(self, own):
            raise ValueError(f"Mode({self.name!r}) has options: pass mode={self.name!r} or maml.{own.__name__}(...).")

    @staticmethod
    def of(mode: str | Mode) -> Mode:
        """``mode`` as an object: a name builds its mode with default options; an object is checked and kept."""
        if isinstance(mode, Mode):
            return mode
        if not isinstance(mode, str):
            raise TypeError(
                f"mode must be a name such as 'second_order' or a maml.Mode (maml.Checkpointed(...), "
                f"maml.Implicit(...)), got {mode!r} ({type(mode).__name__})."
            )
        checks.one_of("mode", mode, tuple(TABLE))
        own = OPTIONS.get(mode)
        return own() if own is not None else Mode(mode)

    @property
    def _row(self) -> Paths:
        return TABLE[self.name]

    @property
    def unrolled(self) -> bool:
        """The meta-gradient differentiates the unrolled inner loop: step weights, learned rates and a rule's tensors apply."""
        return bool(self._row.unrolled)

    @property
    def twice(self) -> bool:
        """The inner gradients are differentiated again (second derivatives)."""
        return bool(self._row.twice)

    @property
    def compiles(self) -> bool:
        """``compile=True`` applies."""
        return bool(self._row.compiles)

    @property
    def plans(self) -> str | None:
        """What a memory budget plans: ``"chunks"``, ``"segments"`` or ``None`` (:class:`Paths`)."""
        return self._row.plans

    @property
    def hessian(self) -> bool:
        """The meta-gradient takes second derivatives of the support loss (Hessian-vector products included)."""
        return self._row.hessian

    def options(self) -> dict[str, Any]:
        """The options that differ from their defaults."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "name" and getattr(self, f.name) != f.default
        }

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Mode.of(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, Mode):
            return NotImplemented
        return type(self) is type(other) and dataclasses.astuple(self) == dataclasses.astuple(other)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        if type(self) is Mode or not self.options():
            return repr(self.name)
        prefix = "maml." if type(self).__module__.startswith("maml.") else ""  # the engine's own, as users name them
        return f"{prefix}{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"

    __str__ = __repr__


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Checkpointed(Mode):
    """The exact meta-gradient in less memory: every ``every``-th fast weights kept, the steps between replayed.

    Attributes:
        every: inner steps per recomputed segment (default: planned, the shortest segments
            that fit the learner's ``memory_budget``; with ``tasks`` given,
            ``round(sqrt(steps * tasks_in_batch / tasks))``, which keeps the fewest fast weights).
        hvp: how the backward pass differentiates the replayed steps, both exact:
            ``"reverse_over_reverse"`` (a second-order graph per replayed step) or
            ``"forward_over_reverse"`` (``torch.func.jvp`` over ``grad``, no second-order graph;
            it fails, naming this option, on an operator without a forward-mode derivative of its
            backward, e.g. ``F.huber_loss``).
        tasks: tasks replayed together (default: planned, batched by ``vmap`` where faster; given,
            nothing is planned and they run in a loop under ``batching="auto"``).
    """

    name: str = dataclasses.field(default="checkpointed", init=False)
    every: int | None = None
    hvp: str = "reverse_over_reverse"
    tasks: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.integer("Checkpointed.every", self.every, 1, optional=True)
        checks.one_of("Checkpointed.hvp", self.hvp, CHECKPOINT_HVPS)
        checks.integer("Checkpointed.tasks", self.tasks, 1, optional=True)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Implicit(Mode):
    """iMAML (Rajeswaran et al. 2019): the proximal inner problem, and its implicit meta-gradient by conjugate gradient.

    Attributes:
        lam: the proximal regularisation's strength ``lambda`` (the paper's 0.5-2 on Omniglot).
        cg_iterations: conjugate-gradient iterations (the paper's 5).
        cg_tolerance: stop a task's CG once its residual's norm is at most ``cg_tolerance`` times
            the norm of that task's right-hand side, its query loss's gradient ``g``: relative, so
            that a task with a small gradient is solved as far as one with a large gradient
            (0: run every iteration; in ``[0, 1)``, as 1 would stop before the first).
    """

    name: str = dataclasses.field(default="implicit", init=False)
    lam: float = 1.0
    cg_iterations: int = 5
    cg_tolerance: float = 1e-10

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _finite(self.lam) or not self.lam > 0:
            raise ValueError(f"Implicit(lam={self.lam!r}): the regularisation must be a finite number > 0, e.g. 1.0.")
        if isinstance(self.cg_iterations, bool) or not isinstance(self.cg_iterations, int) or self.cg_iterations < 1:
            raise ValueError(f"Implicit(cg_iterations={self.cg_iterations!r}) must be an int >= 1, e.g. 5.")
        # NaN would stop no step of CG and inf (or, relative, anything >= 1) every task before its first:
        # either leaves a meta-gradient of exactly 0.
        if not _finite(self.cg_tolerance) or not 0 <= self.cg_tolerance < 1:
            raise ValueError(
                f"Implicit(cg_tolerance={self.cg_tolerance!r}) must be a finite number >= 0 and < 1, relative to "
                "the norm of each task's query gradient, e.g. 1e-10."
            )


# The modes that carry options, by name: their class (a name alone builds its defaults). A new mode with
# options adds its class here, beside its row of TABLE.
OPTIONS: dict[str, type[Mode]] = {"checkpointed": Checkpointed, "implicit": Implicit}


def _finite(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool) that is neither NaN nor infinite."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond a float's range
        return False


_WHY_NOT_UNROLLED = {
    "reptile": "Reptile moves the initialisation towards the adapted weights and differentiates nothing",
    "implicit": "iMAML's meta-gradient depends on the inner problem's solution alone, not on how it was reached",
}


def check_mode(mode: str, *, compile: bool, learned: str | None, reads_initial: bool = False) -> None:
    """The rules a mode must meet with the learner's other options: ``learned`` names learned rates or a rule's tensors;
    ``reads_initial``: the inner loss reads the initial weights (``inner_loss_fn``'s ``initial=``).

    Raises:
        ValueError: naming the option that does not go with ``mode`` and what to do.
    """
    spec = TABLE[mode]
    if not spec.unrolled and (compile or learned):
        what = "compile=True" if compile else learned
        raise ValueError(
            f"mode={mode!r} with {what}: {_WHY_NOT_UNROLLED.get(mode, 'it unrolls no inner loop')}, so it has no gradient for learned rates or rule "
            f"tensors and nothing to compile; drop it, or use mode='first_order'."
        )
    if reads_initial and mode == "implicit":
        raise ValueError(
            "mode='implicit' cannot take an inner_loss_fn that reads initial=: iMAML's meta-gradient "
            "(I + H/lam)^-1 g holds for an inner loss of the fast weights alone, and its inner problem already "
            "has the proximal term lam/2 |phi - theta|^2 (maml.Implicit(lam=...)). Drop initial= from the "
            "inner loss, or use mode='second_order' or 'checkpointed', which differentiate through it."
        )
    if compile and not spec.compiles:
        raise ValueError(
            "compile=True applies to mode='second_order' or 'first_order': the checkpointed mode "
            "recomputes its segments in a backward pass of its own, which torch.compile cannot trace. "
            "Use mode='second_order' with compile=True for speed, or mode='checkpointed' without it for memory."
        )


def check_options(mode: str, *, batching: str, chunk_size: int | None) -> None:
    """The rules on which of ``MetaLearner``'s options go with the mode named ``mode``, checked at construction.

    Raises:
        ValueError: an option that only applies to another mode or batching, naming it and the fix.
    """
    if chunk_size is not None and mode == "checkpointed":
        raise ValueError(
            f"chunk_size={chunk_size} is tasks per vmapped call; the checkpointed mode's tasks replayed together "
            f"are mode=maml.Checkpointed(tasks={chunk_size})."
        )
    if chunk_size is not None and batching == "loop":
        raise ValueError(f"chunk_size={chunk_size} only applies to batching='vmap' or 'auto'; drop it.")


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


_WHY_ALL_ADAPTED = {
    "reptile": "Reptile moves only what the inner loop moved, as its reference code interpolates every trainable "
    "variable after adapting all of them",
    "implicit": "iMAML's meta-gradient is that of the adapted weights",
}


def check_differentiable(
    mode: str, compile: bool, batch: TaskBatch, consts: Params, names: Collection[str], closes_over: bool = False
) -> None:
    """``checks.differentiable`` for ``mode``: what its meta-gradient reaches (inputs, unadapted parameters, and
    ``closes_over``: a tensor on a graph that the inner loss reads from outside its arguments)."""
    spec = TABLE[mode]
    why = _WHY_ALL_ADAPTED.get(mode, "its meta-gradient reaches the adapted weights alone")
    checks.differentiable(
        mode,
        compile,
        batch,
        consts,
        names,
        inputs=spec.inputs,
        all_adapted=None if spec.unrolled else why,
        closes_over=closes_over,
    )


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
