"""MetaLearner: the options, the state, and the dispatch of each call to its mode's path.

The inner loop is ``loop.py`` (the support gradient, then the update rule of ``rules.py`` at
the rates of ``rates.py``, over the per-task forward pass of ``forward.py``); each execution
path runs it in a module of its own and returns a :class:`MetaOutput`: ``eager.py`` (second and
first order, evaluation), ``checkpointed.py`` (with the Hessian-vector strategies of ``hvp.py``)
and ``compiled.py``, looked up by mode in ``modes.py``. Checks and state have modules of their
own: ``options.py``, ``split.py``, ``probe.py``, ``state.py``; ``chunked.py`` is :meth:`MetaLearner.backward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from . import checks, modes, options
from .batch import TaskBatch
from .chunked import backward_in_chunks
from .forward import LossFn, Params, TaskForward, check_finite
from .implicit import Implicit
from .loop import InnerLoop, MetaOutput, Problem
from .options import Batching, CheckpointHvp, InnerOptimizer, LearnInnerLr, Mode
from .probe import Probe
from .rates import InnerRates
from .rules import BoundRule, UpdateRule, rule_tensors
from .split import constants, split
from .state import load_state, move, save_state

__all__ = ["MetaLearner", "MetaOutput"]


class MetaLearner:
    """MAML (Finn et al., 2017) and its family over any ``nn.Module``, with exact meta-gradients.

    The inner loop takes ``steps`` steps of an update rule on each task's support loss,
    starting from the model's current parameters, through ``torch.func.functional_call``; the
    model's own parameters are never modified. The meta-loss is the mean query loss at the
    fast weights.

    Args:
        model: any network of ordinary layers. Parameters with ``requires_grad=False`` are
            used as they are. Norm layers in training mode must not track running statistics
            (``track_running_stats=False``), or the model must be in eval mode; a module that
            writes its buffers in the forward pass is refused.
        loss_fn: ``loss_fn(output, y) -> scalar`` for one task (mean over its examples).
        inner_lr: the inner step size of every rule (the initial value if learned).
        steps: inner steps per task (0: no adaptation).
        mode: ``"second_order"`` (exact), ``"first_order"`` (FOMAML: inner gradients are
            constants), ``"checkpointed"`` (exact; keeps every ``checkpoint_every``-th fast weights
            and replays the rest in the backward pass, with second order's dropout masks),
            ``"reptile"`` (Nichol et al. 2018: nothing differentiated; ``backward()`` leaves
            ``theta - mean_t phi_t`` in ``.grad``) or ``"implicit"`` (iMAML, Rajeswaran et al. 2019:
            the proximal inner problem, values only, and ``(I + H/lambda)^-1 g`` by conjugate
            gradient; memory flat in ``steps``). Settable on a live learner. Under
            ``torch.no_grad()`` every mode adapts as it trains. Inputs that require grad get their
            gradient in second and first order; the other modes and ``compile=True`` refuse them, and
            ``"reptile"`` and ``"implicit"`` refuse a trainable parameter outside ``adapt``
            (the Concepts page).
        batching: ``"vmap"`` (tasks as one batched call), ``"loop"`` (one task after another) or
            ``"auto"``: the loop where it is 1.5x faster on the first batch of more than one task on
            each device, else ``"vmap"`` (kept by :meth:`state_dict`); one task runs unbatched, the
            checkpointed mode takes the loop untimed (it holds less), and a model vmap cannot batch
            (recurrent layers) the loop. All give the same meta-gradients to float rounding; pass
            ``"vmap"`` or ``"loop"`` for bit-identical reruns.
        chunk_size: tasks processed together: with ``"vmap"``, at most this many tasks per
            batched call; with ``"checkpointed"``, per recomputed segment (default: every task
            with ``"vmap"``, one with ``"loop"``, where it costs no speed).
        learn_inner_lr: ``None`` (fixed), ``"scalar"`` (one learnable rate), ``"per_parameter"``
            (Meta-SGD: a learnable rate tensor shaped like each adapted parameter) or
            ``"per_layer_per_step"`` (MAML++'s LSLR: one learnable rate per adapted parameter
            tensor and inner step; more steps than ``steps`` reuse the last step's rate).
            Learnable rates are in :meth:`parameters` and receive meta-gradients.
        checkpoint_every: with ``"checkpointed"``, inner steps per recomputed segment (default
            ``round(sqrt(steps * tasks / chunk_size))``, which keeps the fewest fast weights).
        checkpoint_hvp: with ``"checkpointed"``, how the backward pass differentiates the replayed
            steps, both exact: ``"reverse_over_reverse"`` (default) or ``"forward_over_reverse"``
            (``torch.func.jvp`` over ``grad``, no second-order graph; it fails, naming this argument,
            on an operator without a forward-mode derivative of its backward, e.g. ``F.huber_loss``).
            Settable on a live learner.
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
            state)``), or a name: ``"sgd"``, ``"momentum"`` or ``"adam"``, following
            ``torch.optim.SGD(momentum=...)`` and ``torch.optim.Adam`` step for step, differentiable,
            with its state kept per task. A rule that is an ``nn.Module`` (e.g.
            :class:`~maml.MetaCurvature`) is meta-learned with the model: its parameters are in
            :meth:`parameters` and :meth:`state_dict` and get exact meta-gradients in every mode.
        implicit: iMAML's options (:class:`~maml.Implicit`: ``lam``, ``cg_iterations``,
            ``cg_tolerance``) for ``mode="implicit"`` (default: ``Implicit()``).
        inner_optimizer_options: a named rule's options: momentum ``{"momentum": 0.9, "nesterov": False}``,
            adam ``{"betas": (0.9, 0.999), "eps": 1e-8}``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inner_lr: float,
        steps: int = 1,
        *,
        mode: Mode = "second_order",
        batching: Batching = "auto",
        chunk_size: int | None = None,
        learn_inner_lr: LearnInnerLr = None,
        checkpoint_every: int | None = None,
        checkpoint_hvp: CheckpointHvp | None = None,
        check_finite: bool = True,
        compile: bool = False,
        adapt: Sequence[str] | Callable[[str], bool] | None = None,
        inner_optimizer: InnerOptimizer | UpdateRule = "sgd",
        inner_optimizer_options: Mapping[str, Any] | None = None,
        implicit: Implicit | None = None,
    ) -> None:
        rule, adapted = options.check_arguments(
            model,
            loss_fn,
            inner_lr,
            steps,
            mode=mode,
            batching=batching,
            chunk_size=chunk_size,
            learn_inner_lr=learn_inner_lr,
            checkpoint_every=checkpoint_every,
            checkpoint_hvp=checkpoint_hvp,
            compile=compile,
            adapt=adapt,
            inner_optimizer=inner_optimizer,
            inner_optimizer_options=inner_optimizer_options,
            implicit=implicit,
        )
        self.compile = compile
        self.model = model
        self.loss_fn = loss_fn
        self.inner_lr = float(inner_lr)
        self.steps = steps
        self._mode = mode
        self.batching = batching
        self.chunk_size = chunk_size
        self.learn_inner_lr = learn_inner_lr
        self.inner_optimizer = inner_optimizer
        self.rule = rule
        self.implicit = implicit or Implicit()
        self.checkpoint_every = checkpoint_every
        self._checkpoint_hvp: str = checkpoint_hvp or "reverse_over_reverse"
        self.check_finite = check_finite
        self._compiled: dict[str, Any] = {}  # each mode's compiled step (modes.compiled_path)
        self._example_shape: torch.Size | None = None  # of the inputs of earlier calls, to tell a batch from a task
        self._names = {name for name, _ in model.named_parameters()}
        self._adapted = adapted
        self._integer_inputs = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
        forward = TaskForward(model, loss_fn, options.forward_batching(batching, chunk_size, mode), chunk_size)
        self._forward = forward
        self._probe = Probe(model, forward)
        self._rates = rates = InnerRates(learn_inner_lr, self.inner_lr, tuple(adapted))
        self._loop = InnerLoop(forward, BoundRule(rule), rates, self._check)
        initial = rates.init(dict(model.named_parameters()), steps)
        self.rate_parameters: dict[str, nn.Parameter] = {k: nn.Parameter(v) for k, v in initial.items()}
        checks.warn_weight_norm(model, mode)

    # ------------------------------------------------------------------ public API

    @property
    def mode(self) -> str:
        """``"second_order"``, ``"first_order"``, ``"checkpointed"`` or ``"reptile"``; may be set between steps."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        options.check_new_mode(
            mode,
            compile=self.compile,
            learn_inner_lr=self.learn_inner_lr,
            rule=self.rule,
            chunk_size=self.chunk_size,
            batching=self.batching,
        )
        checks.warn_weight_norm(self.model, mode)
        self._mode = mode

    @property
    def checkpoint_hvp(self) -> str:
        """How the checkpointed mode's backward pass differentiates its replayed steps; may be set between steps."""
        return self._checkpoint_hvp

    @checkpoint_hvp.setter
    def checkpoint_hvp(self, value: str) -> None:
        checks.one_of("checkpoint_hvp", value, options.CHECKPOINT_HVPS)
        self._checkpoint_hvp = value

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
    def adapted(self) -> tuple[str, ...]:
        """The names of the parameters the inner loop updates."""
        return tuple(self._adapted)

    @property
    def inner_lrs(self) -> dict[str, float | Tensor]:
        """The inner rate of every adapted parameter: a float, or its learnable tensor (``(steps,)`` per step)."""
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
            chunk: tasks per backward pass (default: ``chunk_size`` if set, else one task with
                the loop batching and all of them with ``"vmap"``).
            return_output: return what :meth:`run` returns for the whole batch (the chunks'
                outputs joined along the task dimension, all detached) instead of the loss alone:
                a training loop's metrics come with the gradient.

        Returns:
            The meta-loss over all tasks, detached (or the :class:`MetaOutput` with it as ``loss``).
        """
        run = functools.partial(self.run, step_weights=step_weights)
        per_chunk = functools.partial(modes.tasks_per_chunk, self.chunk_size, self.resolved_batching)
        return backward_in_chunks(run, batch, chunk, per_chunk, return_output=return_output)

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
        params, consts, steps = self._prepare("run", params, steps, batch.support_x, batch.query_x)
        grad = torch.is_grad_enabled()
        like = params[self._adapted[0]]
        step_weights = modes.check_step_weights(self._mode, step_weights, steps, like, compiled=self.compile and grad)
        self._probe(params, consts, batch, batching=self.batching, mode=self._mode)
        self._example_shape = batch.support_x.shape[2:]
        if grad:
            modes.check_differentiable(self._mode, self.compile, batch, consts, self._names)
        call = self._call(params, consts, batch, steps, step_weights)
        with modes.attention(self._mode):
            if not grad:
                return modes.TABLE[self._mode].evaluate(call)
            if self.compile:  # compilation replaces the mode's training path (second or first order)
                return modes.compiled_path(call, self._mode, self._compiled, check_finite=self.check_finite)
            return modes.TABLE[self._mode].train(call)

    def task_losses(self, fast: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Each task's loss and outputs at its own fast weights, e.g. the support loss after adaptation.

        Args:
            fast: ``(T, *shape)`` per-task fast weights, as in :attr:`MetaOutput.fast`.
            x: ``(T, n, *x_shape)`` inputs.
            y: ``(T, n, *y_shape)`` targets.

        Returns:
            ``(T,)`` losses and ``(T, n, ...)`` outputs, differentiable when grad mode is on.
        """
        checks.no_running_stats(self.model)
        consts = constants(self.model, dict(self.model.named_parameters()), fast)
        one = {k: v[0] for k, v in fast.items()}
        self._probe(one, consts, TaskBatch(x, y, x, y), batching=self.batching, mode=self._mode)
        return self._forward(fast, consts, x, y)

    def adapt(
        self, support_x: Tensor, support_y: Tensor, params: Params | None = None, steps: int | None = None
    ) -> Params:
        """One task's fast weights.

        Args:
            support_x: ``(n, *x_shape)`` support inputs of one task (no task dimension); a batch
                ``(T, n, *x_shape)`` is refused once an earlier call showed the examples' shape.
            support_y: ``(n, *y_shape)`` support targets.
            params: the initial parameters (default: the model's current parameters).
            steps: inner steps for this call (default: the learner's ``steps``).

        Returns:
            Every parameter of the model, name -> tensor, the adapted ones replaced by their
            fast weights; use them with ``torch.func.functional_call(model, fast, x)``.
            Differentiable with respect to the initial parameters when grad mode is on (not with
            ``mode="implicit"``, which adapts on the proximal problem for values only, as it trains).
        """
        checks.one_task_support(support_x, support_y, self._example_shape)
        x, y = support_x.unsqueeze(0), support_y.unsqueeze(0)
        params, consts, steps = self._prepare("adapt", params, steps, x)
        task = TaskBatch(x, y, x, y)
        self._probe(params, consts, task, batching=self.batching, mode=self._mode)
        self._example_shape = support_x.shape[1:]
        with modes.attention(self._mode):
            fast = modes.TABLE[self._mode].adapt(self._call(params, consts, task, steps, None))
        frozen = {k: v for k, v in consts.items() if k in self._names}
        return {**frozen, **{k: v[0] for k, v in fast.items()}}

    def state_dict(self) -> dict[str, Any]:
        """The model's, the learnable inner rates' and a module rule's state, and what ``batching="auto"`` chose."""
        return save_state(self.model, self.rate_parameters, self.rule, self._forward)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned, after checking all of it: a mismatch loads nothing.

        Raises:
            ValueError: the state was saved by a learner built otherwise (another model's shapes,
                ``learn_inner_lr``, ``steps`` of per-step rates, or rule), naming the entry and both sides.
        """
        load_state(state, self.model, self.rate_parameters, self.rule, self.inner_optimizer, self._forward)

    def to(self, *args: Any, **kwargs: Any) -> MetaLearner:
        """Moves the model, the learnable inner rates and a module rule, like ``nn.Module.to``."""
        move(self.model, self.rate_parameters, self.rule, *args, **kwargs)
        return self

    def __repr__(self) -> str:
        return (
            f"MetaLearner({type(self.model).__name__}, inner_lr={self.inner_lr}, steps={self.steps}, "
            f"mode={self._mode!r}, batching={self.batching!r}, learn_inner_lr={self.learn_inner_lr!r}, "
            f"inner_optimizer={self.inner_optimizer!r})"
        )

    # ------------------------------------------------------------------ internals

    def _call(
        self, params: Params, consts: Params, batch: TaskBatch, steps: int, step_weights: Tensor | None
    ) -> modes.Call:
        """What the mode's paths get (:class:`modes.Call`)."""
        return modes.Call(
            Problem(self._loop, params, self._rate_values(), consts, batch, steps),
            step_weights,
            chunk=modes.tasks_per_chunk(self.chunk_size, self.resolved_batching, batch.num_tasks),
            checkpoint_every=self.checkpoint_every,
            checkpoint_hvp=self._checkpoint_hvp,
            implicit=self.implicit,
        )

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
        checks.grad_mode_possible(method)
        steps = self.steps if steps is None else steps
        checks.integer("steps", steps, 0)
        adapted, consts = split(self.model, self._adapted, params, self._rate_values(), self._integer_inputs, *inputs)
        checks.examples(inputs[0].shape[1], inputs[1].shape[1] if len(inputs) > 1 else None, steps)
        if params is None:  # the model's own: frozen since the learner was built?
            checks.still_trainable(adapted)
        return adapted, consts, steps
