"""MetaLearner: the options, the state, and the dispatch of each call to its mode's path.

The inner loop is ``loop.py`` (the support gradient, then the update rule of ``rules.py`` at
the rates of ``rates.py``, over the per-task forward pass of ``forward.py``); each execution
path runs it in a module of its own and returns a :class:`MetaOutput`: ``eager.py`` (second and
first order, evaluation), ``checkpointed.py`` (with the Hessian-vector strategies of ``hvp.py``)
and ``compiled.py``, looked up by mode in ``modes.py``. Checks and state have modules of their
own: ``options.py``, ``split.py``, ``probe.py``, ``state.py``; ``chunked.py`` is :meth:`MetaLearner.backward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from . import checks, modes, options
from .batch import TaskBatch
from .chunked import backward_in_chunks
from .forward import InnerLoss, LossFn, Params, TaskForward, check_finite, unfused_layers, with_initial
from .loop import InnerLoop, MetaOutput, Problem
from .modes import Checkpointed, Mode
from .options import Batching, InnerOptimizer, LearnInnerLr
from .planner import MemoryBudgetWarning, Plan, Planner, TooSmall, allowance, fmt, measure
from .probe import Probe
from .rates import InnerRates
from .rules import BoundRule, UpdateRule, rule_tensors
from .split import constants, split
from .state import load_state, move, save_state

__all__ = ["MetaLearner", "MetaOutput"]

# MetaLearner's construction arguments, as options.check_arguments takes them.
_ARGUMENTS = (
    "model",
    "loss_fn",
    "inner_lr",
    "steps",
    "mode",
    "batching",
    "chunk_size",
    "learn_inner_lr",
    "compile",
    "adapt",
    "inner_optimizer",
    "inner_optimizer_options",
    "memory_budget",
    "inner_loss_fn",
)
_MOVED = {  # options of one mode, now that mode's own (one release of help for code written before)
    "checkpoint_every": "maml.Checkpointed(every=...)",
    "checkpoint_hvp": "maml.Checkpointed(hvp=...)",
    "implicit": "maml.Implicit(lam=..., cg_iterations=...)",
}
_WAYS = {  # what to do instead of setting a read-only name
    "adapt": "the adapted parameters (learner.adapted) are fixed at construction: build a new MetaLearner(..., adapt=...)",
    "adapted": "build a new MetaLearner(..., adapt=...)",
    "inner_lrs": "set learner.inner_lr, or the learnable rates in learner.rate_parameters",
    "resolved_batching": "set learner.batching",
}


class _Option:
    """A construction option of :class:`MetaLearner` that a live learner takes: reading gives the value in use,
    setting reconfigures the learner as construction would (``MetaLearner._configure``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, learner: MetaLearner | None, owner: type | None = None) -> Any:
        return self if learner is None else learner._options[self.name]

    def __set__(self, learner: MetaLearner, value: Any) -> None:
        learner._configure(**{self.name: value})


class _Fixed(_Option):
    """A construction option fixed for the learner's life: reading gives it, setting raises naming the way."""

    def __init__(self, way: str) -> None:
        self.way = way

    def __set__(self, learner: MetaLearner, value: Any) -> None:
        raise AttributeError(f"MetaLearner.{self.name} is fixed at construction; {self.way}.")


class MetaLearner:
    """MAML (Finn et al., 2017) and its family over any ``nn.Module``, with exact meta-gradients.

    The inner loop takes ``steps`` steps of an update rule on each task's support loss,
    starting from the model's current parameters, through :func:`maml.call`; the
    model's own parameters are never modified. The meta-loss is the mean query loss at the
    fast weights.

    Options set on a live learner (``learner.inner_lr = 0.5``) act as in a learner built with
    them: ``loss_fn``, ``inner_loss_fn``, ``inner_lr`` (a fixed rate), ``steps``, ``mode`` (with its
    options), ``batching``, ``chunk_size``, ``check_finite``, ``compile`` and ``memory_budget``; the
    others are fixed and refuse to be set, naming the way. The model is read as
    it is at each call: weights tied or untied, and parameters unfrozen that ``adapt`` selects, since
    construction are followed.

    Args:
        model: any network of ordinary layers. Parameters with ``requires_grad=False`` are
            used as they are. Norm layers in training mode must not track running statistics
            (``track_running_stats=False``), or the model must be in eval mode; a module that
            writes its buffers in the forward pass is refused, and so is an ``nn.DataParallel``
            (pass its ``.module``; several devices take shares of the tasks, :func:`maml.shard`).
        loss_fn: ``loss_fn(output, y) -> scalar`` for one task (mean over its examples): the query
            (outer) loss, and the support (inner) loss unless ``inner_loss_fn`` is given.
        inner_lr: the inner step size of every rule (the initial value if learned).
        steps: inner steps per task (0: no adaptation).
        mode: ``"second_order"`` (exact), ``"first_order"`` (FOMAML: inner gradients are
            constants), ``"checkpointed"`` or :class:`~maml.Checkpointed` (exact; keeps some fast
            weights and replays the rest in the backward pass, with second order's dropout masks),
            ``"reptile"`` (Nichol et al. 2018: nothing differentiated; ``backward()`` leaves
            ``theta - mean_t phi_t`` in ``.grad``) or ``"implicit"`` or :class:`~maml.Implicit`
            (iMAML, Rajeswaran et al. 2019: the proximal inner problem, values only, and
            ``(I + H/lambda)^-1 g`` by conjugate gradient; memory flat in ``steps``). A name is its
            mode with default options; the objects carry the options (``maml.Checkpointed(every=4)``,
            ``maml.Implicit(lam=2.0)``). Settable on a live learner. Under
            ``torch.no_grad()`` every mode adapts as it trains. Inputs that require grad get their
            gradient in second and first order; the other modes and ``compile=True`` refuse them, and
            ``"reptile"`` and ``"implicit"`` refuse a trainable parameter outside ``adapt``
            (the Concepts page).
        batching: ``"vmap"`` (tasks as one batched call), ``"loop"`` (one task after another) or
            ``"auto"``: the loop where it is 1.5x faster (in the thread's CPU time, which a busy
            machine does not flip) on the first batch of more than one task on each device, else
            ``"vmap"`` (kept by :meth:`state_dict`); one task runs unbatched, the
            checkpointed mode follows its memory plan (``memory_budget``; given its ``tasks``,
            the loop, untimed: it holds less), and a model vmap cannot batch (recurrent layers) the loop. All give the same meta-gradients to float rounding; pass
            ``"vmap"`` or ``"loop"`` for bit-identical reruns.
        chunk_size: with ``"vmap"``, at most this many tasks per batched call (default: every
            task; the checkpointed mode's tasks replayed together are ``maml.Checkpointed(tasks=...)``).
        learn_inner_lr: ``None`` (fixed), ``"scalar"`` (one learnable rate), ``"per_parameter"``
            (Meta-SGD: a learnable rate tensor shaped like each adapted parameter) or
            ``"per_layer_per_step"`` (MAML++'s LSLR: one learnable rate per adapted parameter
            tensor and inner step; more steps than ``steps`` reuse the last step's rate).
            Learnable rates are in :meth:`parameters` and receive meta-gradients.
        check_finite: raise if an inner loss is NaN/Inf, naming the task and step.
        compile: compute the meta-loss and its meta-gradient together, in one ``torch.compile``'d
            function of ``torch.func.grad`` transforms (second and first order), when grad mode is
            on. The returned loss carries its gradient as a constant: ``backward()`` works,
            differentiating the meta-gradient again does not, and ``MetaOutput.fast`` is detached.
        adapt: the parameters the inner loop updates: a list of ``named_parameters()`` names or a
            predicate ``name -> bool`` (default: every trainable parameter). Trainable parameters
            outside it are not updated by the inner loop but are meta-learned, with the exact
            meta-gradient (ANIL: adapt the head; BOIL: adapt the body). A module used at several
            places of the model (``nn.Sequential(lin, act, lin)``) is one set of parameters, under
            the name ``named_parameters()`` gives it.
        inner_optimizer: the update rule: an object with the :class:`~maml.UpdateRule` contract
            (``init(params) -> state``, ``update(grads, state, params, step, rates) -> (params,
            state)``), or the name of one of ``torch.optim``'s optimizers (:data:`maml.INNER_OPTIMIZERS`:
            ``"sgd"``, ``"momentum"``, ``"adam"``, ``"adamw"``, ``"rmsprop"``, ``"adagrad"``,
            ``"adadelta"``, ``"adamax"``, ``"nadam"``, ``"radam"``, ``"rprop"``, ``"asgd"``), following it
            step for step (``inner_lr`` is its ``lr``), differentiable, with its state kept per task. A rule that is an ``nn.Module`` (e.g.
            :class:`~maml.MetaCurvature`) is meta-learned with the model: its parameters are in
            :meth:`parameters` and :meth:`state_dict` and get exact meta-gradients in every mode.
        memory_budget: the tensor bytes a training step may hold: an int of bytes, a string
            (``"6GiB"``, ``"500MB"``) or a fraction of the device's free memory (``0.8``). Within
            it the learner plans what would otherwise be guessed (:attr:`plan`): in second and
            first order the tasks whose graphs :meth:`backward` holds at once (:meth:`meta_loss`
            refuses a batch over it, naming ``backward``); in the checkpointed mode the most tasks
            replayed together (batched if faster), each a call of :meth:`backward`, then the shortest
            segments. It plans from what one inner step of one task holds, measured before the first
            training step of each configuration (no probe holds more than the budget). Default:
            none in second and first order (:meth:`meta_loss` runs every task at once;
            :meth:`backward` plans within the device's free memory); in the checkpointed mode one
            task's second-order step, at least 16 MiB (``docs/memory-and-speed.md``); with
            ``Checkpointed(tasks=...)`` it plans nothing and replays that many tasks in a loop.
        inner_loss_fn: the inner loop's objective on the support set, where it differs from
            ``loss_fn`` (learn2learn's ``adapt(loss)``, higher's ``diffopt.step(loss)``: any inner
            objective): ``inner_loss_fn(output, y) -> scalar``, plus any of the keywords ``fast`` (the
            task's fast weights of the adapted parameters, name -> ``(*shape)`` tensor), ``initial``
            (their initial values: the meta-parameters), ``params`` (every parameter and buffer of
            the model as the task's forward pass uses it: the fast weights and the other parameters,
            e.g. per-example weights kept in the model outside ``adapt``, which get their exact
            meta-gradient) and ``step`` (the 0-based inner step) that its signature names. A
            proximal term ``lam / 2 * sum((fast[k] - initial[k]).pow(2).sum() for k in fast)``, a
            weight penalty, an unlabelled objective that ignores ``y``: each is
            differentiated exactly in every mode (``"implicit"`` takes no ``initial``: its inner
            problem is proximal already). Default: ``loss_fn``. Settable on a live learner.
        inner_optimizer_options: a named rule's options, in ``torch.optim``'s keywords (``{"betas": (0.9, 0.99),
            "weight_decay": 0.01, "amsgrad": True}``), and ``"learn"``: the float options the outer loop
            learns, as the rule classes take it (``maml.Adam(learn=...)``: ``["betas"]``, or
            ``{"betas": "per_layer_per_step"}``, shaped by this model and ``steps``).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inner_lr: float,
        steps: int = 1,
        *,
        mode: str | Mode = "second_order",
        batching: Batching = "auto",
        chunk_size: int | None = None,
        learn_inner_lr: LearnInnerLr = None,
        check_finite: bool = True,
        compile: bool = False,
        adapt: Sequence[str] | Callable[[str], bool] | None = None,
        inner_optimizer: InnerOptimizer | UpdateRule = "sgd",
        inner_optimizer_options: Mapping[str, Any] | None = None,
        memory_budget: int | str | float | None = None,
        inner_loss_fn: Callable[..., Tensor] | None = None,
    ) -> None:
        self._options: dict[str, Any] = {}  # the construction arguments, as _Option reads them back
        self._fixed = False  # within one call of backward: the model is followed once (_model_fixed)
        # and its parameters split once, by its first chunk (_prepare), which alone probes the model
        self._prepared: tuple[Params, Params, int] | None = None
        self._example_shape: torch.Size | None = None  # of the inputs of earlier calls, to tell a batch from a task
        self._configure(
            model=model,
            loss_fn=loss_fn,
            inner_lr=inner_lr,
            steps=steps,
            mode=mode,
            batching=batching,
            chunk_size=chunk_size,
            learn_inner_lr=learn_inner_lr,
            check_finite=check_finite,
            compile=compile,
            adapt=adapt,
            inner_optimizer=inner_optimizer,
            inner_optimizer_options=inner_optimizer_options,
            memory_budget=memory_budget,
            inner_loss_fn=inner_loss_fn,
        )
        self._plan: Plan | None = None  # the last training call's
        self._asked: str | None = None  # what a backward call was asked, for its advice (_call)
        initial = self._rates.init(dict(model.named_parameters()), steps)
        self._options["rate_parameters"] = {k: nn.Parameter(v) for k, v in initial.items()}

    # Construction options read back as the learner uses them. Those that may be set on a live learner
    # (_Option) rebuild what depends on them as construction would; the others (_Fixed) refuse, naming the way.
    loss_fn = _Option()
    inner_lr = _Option()
    steps = _Option()
    mode = _Option()
    batching = _Option()
    chunk_size = _Option()
    check_finite = _Option()
    compile = _Option()
    memory_budget = _Option()
    inner_loss_fn = _Option()
    model = _Fixed("build a new MetaLearner around the other model")
    learn_inner_lr = _Fixed("build a new MetaLearner(..., learn_inner_lr=...); its rates are learner.rate_parameters")
    inner_optimizer = _Fixed("build a new MetaLearner(..., inner_optimizer=...)")
    rule = _Fixed("build a new MetaLearner(..., inner_optimizer=...)")
    rate_parameters = _Fixed(
        "set the rates in place (learner.rate_parameters[name].data.fill_(0.1)) or with load_state_dict"
    )

    def __setattr__(self, name: str, value: Any) -> None:
        """Private names as usual; a public one only through its setter, so that nothing set is silently ignored."""
        attribute = getattr(type(self), name, None)
        if name.startswith("_") or (hasattr(attribute, "__set__") and getattr(attribute, "fset", True) is not None):
            object.__setattr__(self, name, value)
            return
        settable = ", ".join(k for k, v in vars(MetaLearner).items() if type(v) is _Option)
        if name in _MOVED:
            raise AttributeError(f"MetaLearner.{name} is the mode's own now: set learner.mode = {_MOVED[name]}.")
        if attribute is None:
            raise AttributeError(f"MetaLearner has no option {name!r}; a live learner takes {settable}.")
        what = "a method" if callable(attribute) else "read-only"
        raise AttributeError(f"MetaLearner.{name} is {what}; {_WAYS.get(name, 'a live learner takes ' + settable)}.")

    # ------------------------------------------------------------------ public API

    @property
    def _mode(self) -> Mode:
        return self._options["mode"]  # type: ignore[no-any-return]

    def parameters(self) -> Iterator[nn.Parameter]:
        """The meta-parameters: the model's parameters, the learnable inner rates, then the rule's own tensors."""
        yield from self.model.parameters()
        yield from self.rate_parameters.values()
        yield from rule_tensors(self.rule).values()

    @property
    def resolved_batching(self) -> str:
        """The batching used on the model's current device: ``"vmap"`` or ``"loop"`` (resolves ``"auto"``).

        Settled by the first call: ``"auto"`` times both on its batch and keeps the faster, and
        moves a model whose forward pass vmap cannot batch (recurrent layers, ``.item()``) to the
        loop (see ``model_check.py``); before it, ``"vmap"``.
        """
        return self._forward.resolve(next(self.model.parameters()).device)

    @property
    def plan(self) -> Plan | None:
        """How the last training call fit its memory budget (``memory_budget``): tasks at once, segments, batching.

        ``None`` before the first training call and where nothing is planned (second and first
        order without a budget; ``"reptile"``, ``"implicit"``).
        """
        return self._plan

    def plan_for(self, batch: TaskBatch, *, return_output: bool = False) -> Plan | None:
        """The plan of a training step on ``batch`` (as :attr:`plan` will show it), without taking the step.

        Measures one task on a new configuration, as the first training call would; a budget too
        small for one task raises here, before any training. ``None`` where nothing is planned.
        ``return_output``: plan :meth:`backward` with it, which keeps the batch's fast weights.

        Raises:
            ValueError: ``memory_budget`` is below what one task holds, naming the smallest that runs.
        """
        if not isinstance(batch, TaskBatch):
            raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
        with torch.enable_grad():
            plan = self._planned(batch, return_output)
        self._plan = plan if plan is not None else self._plan
        return plan

    @property
    def adapted(self) -> tuple[str, ...]:
        """The names of the parameters the inner loop updates (of the model as it is now)."""
        self._follow_model()
        return tuple(self._adapted)

    @property
    def inner_lrs(self) -> dict[str, float | Tensor]:
        """The inner rate of every adapted parameter: a float, or its learnable tensor (``(steps,)`` per step)."""
        self._follow_model()
        return self._rates.reported(self.rate_parameters)

    def meta_loss(self, batch: TaskBatch, step_weights: Tensor | None = None) -> Tensor:
        """The meta-loss over the tasks of ``batch``: a scalar tensor.

        ``meta_loss(batch).backward()`` leaves the meta-gradient in ``.grad`` of the model's
        parameters and of the learnable inner rates.

        Args:
            batch: ``T`` tasks.
            step_weights: ``(steps,)`` MAML++'s multi-step loss: the sum over ``k`` of
                ``step_weights[k - 1]`` times the mean query loss after inner step ``k``.
                Default: the mean query loss after the last step.
        """
        loss = self.run(batch, step_weights=step_weights).loss
        return loss if torch.is_grad_enabled() else checks.evaluation_loss(loss)

    @overload
    def backward(
        self,
        batch: TaskBatch,
        step_weights: Tensor | None = ...,
        *,
        chunk: int | None = ...,
        return_output: Literal[False] = ...,
    ) -> Tensor: ...

    @overload
    def backward(
        self,
        batch: TaskBatch,
        step_weights: Tensor | None = ...,
        *,
        return_output: Literal[True],  # keyword-only: any order; the loss or the whole output
        chunk: int | None = ...,
    ) -> MetaOutput: ...

    def backward(
        self,
        batch: TaskBatch,
        step_weights: Tensor | None = None,
        *,
        chunk: int | None = None,
        return_output: bool = False,
    ) -> Tensor | MetaOutput:
        """``meta_loss(batch).backward()`` a few tasks at a time: the same ``.grad``, one chunk's graph in memory.

        Each chunk's meta-loss, weighted by its share of the tasks, is backpropagated as soon as
        it is computed, and the gradients accumulate in ``.grad``; so second order keeps one
        chunk's inner-loop graph at a time instead of the whole meta-batch's. The gradients equal
        ``meta_loss(batch).backward()``'s to float rounding, except for a model that draws random
        numbers (dropout), whose draws fall differently over chunks.

        Args:
            batch: ``T`` tasks.
            step_weights: as in :meth:`meta_loss`.
            chunk: tasks per backward pass (default: ``chunk_size`` if set, else what fits
                ``memory_budget`` (:attr:`plan`; the checkpointed mode's planned step: all); without
                a budget, in second and first order, what fits 90 % of the device's free memory,
                read at the first call and kept (:meth:`state_dict`): the whole batch where it fits,
                else chunks of it, down to one task a call (a per-task loop's memory, as measured);
                in the other modes one task with the loop batching and all of them with
                ``"vmap"``).
            return_output: return what :meth:`run` returns for the whole batch (the chunks'
                outputs joined along the task dimension, all detached) instead of the loss alone:
                a training loop's metrics come with the gradient.

        Returns:
            The meta-loss over all tasks, detached (or the :class:`MetaOutput` with it as ``loss``).
        """
        run = functools.partial(self.run, step_weights=step_weights)
        per_chunk = functools.partial(modes.tasks_per_chunk, self.chunk_size, self.resolved_batching)
        if chunk is None and self.chunk_size is None and isinstance(batch, TaskBatch) and torch.is_grad_enabled():
            plan = self._planned(batch, return_output)
            if plan is not None:  # a budget's calls (second and first order: its chunks; checkpointed: its replays)
                with self._model_fixed():
                    calls = functools.partial(
                        backward_in_chunks, run, batch, None, lambda tasks: plan.tasks, return_output=return_output
                    )
                    out = self._watched(calls, plan, batch.query_x.device)
                self._plan = plan  # the whole batch's, not its last call's
                return out
        self._asked = f"backward(chunk={chunk})" if chunk is not None else "chunk_size" if self.chunk_size else None
        try:
            with self._model_fixed():
                return backward_in_chunks(run, batch, chunk, per_chunk, return_output=return_output)
        finally:
            self._asked = None

    def run(
        self,
        batch: TaskBatch,
        params: Params | None = None,
        steps: int | None = None,
        step_weights: Tensor | None = None,
    ) -> MetaOutput:
        """Adapts to every task of ``batch`` and scores the fast weights on its query set.

        Args:
            batch: ``T`` tasks.
            params: the initial parameters, keyed like ``dict(model.named_parameters())``;
                default: the model's current parameters.
            steps: inner steps for this call (default: the learner's ``steps``), e.g. more
                steps at test time than in training.
            step_weights: ``(steps,)`` weights of the query loss after each inner step (the
                multi-step loss); see :meth:`meta_loss`.

        Returns:
            The meta-loss and what was computed on the way (see :class:`MetaOutput`).
        """
        if not isinstance(batch, TaskBatch):
            raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
        later_chunk = self._fixed and self._prepared is not None  # of backward: nothing new to see
        params, consts, steps = self._prepare("run", params, steps, batch.support_at(0)[0], batch.query_x)
        grad = torch.is_grad_enabled()
        like = params[self._adapted[0]]
        step_weights = modes.check_step_weights(
            self._mode.name, step_weights, steps, like, compiled=self.compile and grad
        )
        if not later_chunk:
            self._probe(
                params,
                consts,
                batch,
                batching=self.batching,
                lean=self._mode.plans == "segments",
                choose=not self._plans(grad),
                twice=grad and self._mode.twice,
                steps=steps,
            )
        self._example_shape = batch.query_x.shape[2:]
        if grad:
            modes.check_differentiable(
                self._mode.name, self.compile, batch, consts, self._names, closes_over=self._probe.closes_over
            )
        call = self._call(params, consts, batch, steps, step_weights)
        # Backward's chunks run in the attention context its call entered once (_model_fixed).
        with contextlib.nullcontext() if self._fixed else modes.attention(self._mode.name):
            if not grad:
                return modes.TABLE[self._mode.name].evaluate(call)
            if self.compile:  # compilation replaces the mode's training path (second or first order)
                return modes.compiled_path(call, self._compiled, check_finite=self.check_finite)
            return modes.TABLE[self._mode.name].train(call)

    def task_losses(self, fast: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Each task's loss and outputs at its own fast weights, e.g. the support loss after adaptation.

        Args:
            fast: ``(T, *shape)`` per-task fast weights, as in :attr:`MetaOutput.fast`.
            x: ``(T, n, *x_shape)`` inputs.
            y: ``(T, n, *y_shape)`` targets.

        Returns:
            ``(T,)`` losses and ``(T, n, ...)`` outputs, differentiable when grad mode is on.
        """
        self._follow_model()
        checks.no_running_stats(self.model)
        consts = constants(self.model, dict(self.model.named_parameters()), fast)
        one = {k: v[0] for k, v in fast.items()}
        self._probe(one, consts, TaskBatch(x, y, x, y), batching=self.batching, lean=self._mode.plans == "segments")
        with unfused_layers():
            return self._forward(fast, consts, x, y)

    def adapt(
        self,
        support_x: Tensor,
        support_y: Tensor,
        params: Params | None = None,
        steps: int | None = None,
        *,
        per_step: bool = False,
    ) -> Params:
        """One task's fast weights.

        Args:
            support_x: ``(n, *x_shape)`` support inputs of one task (no task dimension); a batch
                ``(T, n, *x_shape)`` is refused once an earlier call showed the examples' shape.
                With ``per_step``, ``(S, n, *x_shape)``: inner step ``k`` adapts on ``support_x[k % S]``.
            support_y: ``(n, *y_shape)`` support targets (``(S, n, *y_shape)`` with ``per_step``).
            params: the initial parameters (default: the model's current parameters).
            steps: inner steps for this call (default: the learner's ``steps``).
            per_step: one support set per inner step, as ``TaskBatch(..., per_step=True)`` holds them.

        Returns:
            Every parameter of the model, name -> tensor, the adapted ones replaced by their
            fast weights; use them with :func:`maml.call` (``maml.call(model, fast, x)``), not
            ``torch.func.functional_call``, which breaks a model that uses a module twice.
            Differentiable with respect to the initial parameters when grad mode is on (not with
            ``mode="implicit"``, which adapts on the proximal problem for values only, as it trains).
        """
        if not isinstance(per_step, bool):
            raise TypeError(f"per_step must be True or False, got {per_step!r}.")
        checks.one_task_support(support_x, support_y, self._example_shape, per_step)
        x, y = support_x.unsqueeze(0), support_y.unsqueeze(0)
        task = TaskBatch(x, y, *(x[:, 0], y[:, 0]) if per_step else (x, y), per_step=per_step)
        params, consts, steps = self._prepare("adapt", params, steps, task.query_x)
        with checks.batch_hint(support_x, self._example_shape):  # a first call given a batch fails in the model
            lean = self._mode.plans == "segments"
            self._probe(params, consts, task, batching=self.batching, lean=lean, steps=steps)
        self._example_shape = task.query_x.shape[2:]
        with modes.attention(self._mode.name):
            fast = modes.TABLE[self._mode.name].adapt(self._call(params, consts, task, steps, None))
        frozen = {k: v for k, v in consts.items() if k in self._names}
        return {**frozen, **{k: v[0] for k, v in fast.items()}}

    def state_dict(self) -> dict[str, Any]:
        """The model's, the learnable inner rates' and a module rule's state, and what ``batching="auto"`` chose."""
        return save_state(self.model, self.rate_parameters, self.rule, self._forward, self._planner)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned, after checking all of it: a mismatch loads nothing.

        Raises:
            ValueError: the state was saved by a learner built otherwise (another model's shapes,
                ``learn_inner_lr``, ``steps`` of per-step rates, or rule), naming the entry and both sides.
        """
        load_state(
            state, self.model, self.rate_parameters, self.rule, self.inner_optimizer, self._forward, self._planner
        )

    def to(self, *args: Any, **kwargs: Any) -> MetaLearner:
        """Moves the model, the learnable inner rates and a module rule, like ``nn.Module.to``."""
        move(self.model, self.rate_parameters, self.rule, *args, **kwargs)
        return self

    def __repr__(self) -> str:
        loss = getattr(self.loss_fn, "__qualname__", None) or type(self.loss_fn).__name__
        inner = self.inner_loss_fn
        if inner is not None:
            loss += f", inner_loss_fn={getattr(inner, '__qualname__', None) or type(inner).__name__}"
        extra = "".join(
            f", {k}={self._options[k]!r}" for k in ("chunk_size", "compile", "memory_budget") if self._options[k]
        )
        return (
            f"MetaLearner({type(self.model).__name__}, {loss}, inner_lr={self.inner_lr}, steps={self.steps}, "
            f"mode={self._mode!r}, batching={self.batching!r}, learn_inner_lr={self.learn_inner_lr!r}, "
            f"inner_optimizer={self.inner_optimizer!r}{extra}{f', plan={str(self._plan)!r}' if self._plan else ''})"
        )

    # ------------------------------------------------------------------ internals

    def _configure(self, **changes: Any) -> None:
        """Checks the options with ``changes`` as construction does, then rebuilds what depends on them.

        Construction and every option set on a live learner come here, so a learner reconfigured
        computes what one built with the new options computes. The forward pass (with what
        ``"auto"`` chose) and the compiled steps are rebuilt only when what they are built from
        changes: setting ``check_finite`` keeps both.
        """
        built = "rate_parameters" in self._options
        if "mode" in changes:
            changes["mode"] = Mode.of(changes["mode"])
        opts = {**self._options, **changes}
        if built and "inner_lr" in changes and opts["learn_inner_lr"]:
            raise AttributeError(
                f"MetaLearner.inner_lr is the initial value of the learnable rates (learn_inner_lr="
                f"{opts['learn_inner_lr']!r}); set the rates themselves, learner.rate_parameters (learner.inner_lrs "
                f"shows each parameter's), or build a new MetaLearner."
            )
        if built and "steps" in changes and opts["learn_inner_lr"] == "per_layer_per_step":
            raise AttributeError(
                f"MetaLearner.steps is fixed with learn_inner_lr='per_layer_per_step', whose rates are one per each "
                f"of its {self.steps} steps; pass steps= to run() or adapt() for one call (later steps take the "
                f"last rate), or build a new MetaLearner."
            )
        if "check_finite" in changes and not isinstance(opts["check_finite"], bool):
            raise TypeError(f"check_finite must be True or False, got {opts['check_finite']!r}.")
        rule, adapted = options.check_arguments(**{k: opts[k] for k in _ARGUMENTS})
        if built:
            rule = self.rule  # fixed: a module rule's tensors are meta-parameters
        if "mode" in changes:  # at construction, and each mode set since
            checks.warn_weight_norm(opts["model"], opts["mode"].name, opts["mode"].hessian)
        model = opts["model"]
        self._options = {**opts, "inner_lr": float(opts["inner_lr"]), "rule": rule}
        self._names = {name for name, _ in model.named_parameters()}
        self._adapted = adapted
        self._integer_inputs = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
        inner = None if opts["inner_loss_fn"] is None else InnerLoss.of(opts["inner_loss_fn"])
        forward = (opts["loss_fn"], options.forward_batching(opts["batching"], opts["chunk_size"]), inner)
        rates = InnerRates(opts["learn_inner_lr"], float(opts["inner_lr"]), tuple(adapted))
        if built and (forward, opts["chunk_size"], rates) == (self._built_from, self._forward.chunk_size, self._rates):
            return
        if not built or (forward, opts["chunk_size"]) != (self._built_from, self._forward.chunk_size):
            loss_fn, batching, inner = forward
            self._forward = TaskForward(model, loss_fn, batching, opts["chunk_size"], inner)
        self._built_from = forward
        self._probe = Probe(model, self._forward)
        self._rates = rates
        self._loop = InnerLoop(self._forward, BoundRule(rule), rates, self._check)
        self._compiled: dict[str, Any] = {}  # each mode's compiled step (modes.compiled_path)
        # What it measured holds for this loop only; the free-memory budget read before is kept.
        self._planner = Planner(self._forward, getattr(self, "_planner", None) and self._planner.measured)

    def _follow_model(self) -> None:
        """Follows the model as it is now: weights tied or untied, a module registered twice, or a parameter
        unfrozen that ``adapt`` selects, since the last call.

        Such a change alters which parameters exist or are adapted, so the learner is reconfigured as if
        built now (a walk of the model per call finds it); learnable rates kept per parameter cannot
        follow a change of the adapted parameters, and say so. A parameter frozen since is refused
        (``checks.still_trainable``).
        """
        if self._fixed or (not self._forward.stale() and not self._unfrozen()):
            return
        adapted = checks.adapt_set(self._options["adapt"], self.model)
        if adapted != self._adapted and self.learn_inner_lr not in (None, "scalar"):
            added = [k for k in adapted if k not in self._adapted] or ["none"]
            gone = [k for k in self._adapted if k not in adapted] or ["none"]
            raise ValueError(
                f"the model's parameters changed since the learner was built (adapted: added {', '.join(added)}, "
                f"gone {', '.join(gone)}), and its learnable rates (learn_inner_lr={self.learn_inner_lr!r}) are "
                f"one per adapted parameter: build a new MetaLearner on the model as it is."
            )
        self._forward.refresh()
        self._configure()
        self._probe = Probe(self.model, self._forward)  # a new structure is checked anew
        self._compiled = {}

    @contextlib.contextmanager
    def _model_fixed(self) -> Iterator[None]:
        """One call's chunks see one model: it is followed (:meth:`_follow_model`), split (:meth:`_prepare`) and probed
        once, by the first chunk, not at every chunk, whose walks of the model cost a small model's per-task loop a
        tenth of its time; and they run in one attention context."""
        self._follow_model()
        self._fixed, self._prepared = True, None
        try:
            with modes.attention(self._mode.name):
                yield
        finally:
            self._fixed, self._prepared = False, None

    def _unfrozen(self) -> bool:
        """Whether a parameter ``adapt`` selects was made trainable (``requires_grad_(True)``) since the learner was built."""
        adapt, adapted = self._options["adapt"], set(self._adapted)

        def selected(name: str) -> bool:
            return adapt is None or (adapt(name) if callable(adapt) else name in adapt)

        return any(p.requires_grad and k not in adapted and selected(k) for k, p in self.model.named_parameters())

    def _call(
        self, params: Params, consts: Params, batch: TaskBatch, steps: int, step_weights: Tensor | None
    ) -> modes.Call:
        """What the mode's paths get (:class:`modes.Call`), with the chunks and segments a plan chose for training."""
        problem = Problem(self._loop, params, self._rate_values(), consts, batch, steps)
        plan = self._plan_of(problem, steps != self.steps) if self._plans(torch.is_grad_enabled()) else None
        mode = self._mode
        if plan is not None and isinstance(mode, Checkpointed):  # planned: the tasks replayed together, the segments
            return modes.Call(
                problem, step_weights, plan.replayed, dataclasses.replace(mode, every=plan.checkpoint_every)
            )
        tasks = mode.tasks if isinstance(mode, Checkpointed) else None
        chunk = tasks or modes.tasks_per_chunk(self.chunk_size, self.resolved_batching, batch.num_tasks)
        return modes.Call(problem, step_weights, chunk, mode)

    def _plans(self, grad: bool) -> bool:
        """Whether a training call plans (``modes.TABLE``'s ``plans``): the checkpointed mode unless its ``tasks``
        are given (its segment length needs no measurement), the others with a budget."""
        kind = self._mode.plans
        segments = kind == "segments" and getattr(self._mode, "tasks", None) is None
        return grad and (segments or (kind == "chunks" and self.memory_budget is not None))

    def _watched(self, calls: Callable[[], Any], plan: Plan, device: torch.device) -> Any:
        """Runs a planned backward's ``calls``; for a model whose activations' size follows the data (``Probe``), measured:
        one past the budget (and ``planner.allowance``) is said with its figure, and the next call plans from it."""
        op = self._probe.data_dependent
        if op is None:
            return calls()
        out: list[Any] = []
        held = measure(lambda: out.append(calls()), device).peak
        if held > plan.budget + allowance(plan.budget):
            self._planner.exceeded(held, plan)
            warnings.warn(
                f"backward held {fmt(held)} of tensors, over its memory budget of {fmt(plan.budget)} (planned: "
                f"{plan}): the model's activations depend on the data ({op} in its forward pass), and this "
                f"batch's tasks hold more than the one the plan measured. The next call plans from this figure.",
                MemoryBudgetWarning,
                stacklevel=3,
            )
        return out[0]

    def _planned(self, batch: TaskBatch, outputs: bool) -> Plan | None:
        """The plan of :meth:`backward` on ``batch`` from the model's parameters: its calls, each within the budget
        (``outputs``: with its ``return_output``, which keeps the batch's fast weights across them). Second and first
        order without a budget plan within the device's free memory (``Planner.free_budget``)."""
        budget, free = self.memory_budget, False
        if budget is None and self._mode.plans == "chunks":
            budget, free = self._planner.free_budget(batch.query_x.device), True
        elif not self._plans(True):
            return None
        params, consts, steps = self._prepare("run", None, None, batch.support_at(0)[0], batch.query_x)
        lean = self._mode.plans == "segments"
        self._probe(params, consts, batch, batching=self.batching, lean=lean, choose=False, steps=steps)
        problem = Problem(self._loop, params, self._rate_values(), consts, batch, steps)
        try:
            plan = self._planner.plan(problem, mode=self._mode, memory_budget=budget, one_call=False, outputs=outputs)
        except TooSmall as e:
            if not free and not self._planner.outgrown():
                raise ValueError(str(e)) from None
            if not free:  # a data-dependent model's budget, which its tasks outgrew (_watched): said, not refused
                warnings.warn(f"{e} Until then, one task at a time.", MemoryBudgetWarning, stacklevel=3)
            # Not even one task fits the free memory as estimated: one task at a time, the least there is, as a
            # per-task loop would run (the estimate is an upper bound; the step may still fit).
            plan = self._planner.plan(problem, mode=self._mode, memory_budget=e.least, one_call=False, outputs=outputs)
        return plan

    def _plan_of(self, problem: Problem, own_steps: bool) -> Plan | None:
        """Plans one call of ``problem``'s tasks (:class:`planner.Planner`); refuses one over the budget, naming the
        call or argument that would fit (``own_steps``: the call was given ``steps``)."""
        try:
            made = self._planner.plan(problem, mode=self._mode, memory_budget=self.memory_budget, one_call=True)
        except TooSmall as e:
            if self._fixed and self._planner.outgrown():  # a chunk of backward's leanest plan (_planned said so)
                made = self._planner.plan(problem, mode=self._mode, memory_budget=e.least, one_call=True)
                self._plan = made
                return made
            if e.fits is None:
                raise ValueError(str(e)) from None
            k = e.fits.tasks
            if self._asked == "chunk_size":
                way = f"set learner.chunk_size = {k} (or None: backward(batch) then plans its calls within it)"
            elif self._asked is not None:
                way = f"{self._asked} asks for more: pass chunk={k}, or no chunk (backward(batch) plans its calls)"
            elif own_steps:
                way = (
                    f"learner.backward(batch) runs them {k} at a time within it, to the same .grad; it takes "
                    f"the learner's steps: set learner.steps = {problem.steps} first"
                )
            else:
                way = f"learner.backward(batch) runs them {k} at a time within it, to the same .grad"
            raise ValueError(f"{e}: {way}.") from None
        self._plan = made
        return made

    def _rate_values(self) -> Params:
        """The learnable rates and the rule's own tensors: the meta-parameters every path threads beside the model's."""
        return {**self.rate_parameters, **rule_tensors(self.rule)}

    def _check(self, losses: Tensor, step: int, steps: int) -> None:
        if self.check_finite:  # read at every call: a script may turn it off for evaluation
            check_finite(losses, step, steps, self._rates.hint)

    def _prepare(
        self, method: str, params: Params | None, steps: int | None, *inputs: Tensor
    ) -> tuple[Params, Params, int]:
        """What :meth:`run` and :meth:`adapt` (``method``) check first, on ``(T, n, *x_shape)`` support (and query) inputs.

        Returns the adapted parameters and the constants (:func:`split.split`), and the call's steps.
        """
        if self._fixed and self._prepared is not None and params is None and steps is None:
            return self._prepared  # a chunk of backward after its first: the same parameters, inputs alike
        checks.grad_mode_possible(method)
        self._follow_model()
        own_steps = steps is None
        steps = self.steps if steps is None else steps
        checks.integer("steps", steps, 0)
        adapted, consts = split(self.model, self._adapted, params, self._rate_values(), self._integer_inputs, *inputs)
        checks.examples(inputs[0].shape[1], inputs[1].shape[1] if len(inputs) > 1 else None, steps)
        if params is None:  # the model's own: frozen since the learner was built?
            checks.still_trainable(adapted)
        elif torch.is_grad_enabled():
            # Given constants (detached): the inner loop differentiates from them all the same.
            adapted = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in adapted.items()}
        prepared = adapted, with_initial(consts, adapted, self._forward.inner_loss), steps
        if self._fixed and params is None and own_steps:
            self._prepared = prepared
        return prepared
