"""MetaLearner: validation, state and dispatch to the execution paths.

The inner loop is ``loop.py`` (the support gradient, then the update rule of ``rules.py`` at
the rates of ``rates.py``, over the per-task forward pass of ``forward.py``); each execution
path runs it in a module of its own and returns a :class:`MetaOutput`: ``eager.py`` (second and
first order, evaluation), ``checkpointed.py`` (with the Hessian-vector strategies of ``hvp.py``)
and ``compiled.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from . import checkpointed, checks, compiled, eager, implicit, reptile
from .batch import TaskBatch
from .forward import LossFn, Params, TaskForward, check_finite, exact_attention
from .implicit import Implicit
from .layers import check_step_layers
from .loop import InnerLoop, MetaOutput
from .model_check import check_model
from .rates import LEARN_INNER_LR, InnerRates
from .rules import INNER_OPTIMIZERS, RULE_PREFIX, BoundRule, UpdateRule, make_rule, rule_tensors

Mode = Literal["second_order", "first_order", "checkpointed", "reptile", "implicit"]
Batching = Literal["auto", "vmap", "loop"]
LearnInnerLr = Literal["scalar", "per_parameter", "per_layer_per_step"] | None
InnerOptimizer = Literal["sgd", "momentum", "adam"]
CheckpointHvp = Literal["reverse_over_reverse", "forward_over_reverse"]

MODES: tuple[str, ...] = ("second_order", "first_order", "checkpointed", "reptile", "implicit")
BATCHINGS: tuple[str, ...] = ("auto", "vmap", "loop")
CHECKPOINT_HVPS: tuple[str, ...] = ("reverse_over_reverse", "forward_over_reverse")

__all__ = ["BATCHINGS", "CHECKPOINT_HVPS", "INNER_OPTIMIZERS", "LEARN_INNER_LR", "MODES", "MetaLearner", "MetaOutput"]


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
            constants) or ``"checkpointed"`` (exact, keeps only every ``checkpoint_every``-th
            fast weights and recomputes the rest in the backward pass, with the same dropout
            masks as second order), or ``"reptile"`` (Nichol et al. 2018: the inner loop is not
            differentiated; ``meta_loss(batch).backward()`` leaves ``theta - mean_t phi_t``, the
            initial minus the adapted weights averaged over tasks, in ``.grad``, and the loss is the
            mean query loss at the adapted weights), or ``"implicit"`` (iMAML, Rajeswaran et al.
            2019: the inner loop solves the proximally regularised support problem, values only,
            and the meta-gradient ``(I + H/lambda)^-1 g`` comes from conjugate gradient on
            Hessian-vector products; memory does not grow with ``steps``; options in
            ``implicit``). Settable on a live learner (derivative-order annealing). Inputs that
            require grad (features of a trainable encoder upstream of the learner) get their
            gradient in second and first order; ``"checkpointed"``, ``"reptile"``, ``"implicit"``
            and ``compile=True`` do not backpropagate into inputs and refuse them. ``"reptile"``
            and ``"implicit"`` move only adapted parameters, so they refuse a trainable parameter
            outside ``adapt``.
        batching: ``"vmap"`` (tasks as one batched forward pass), ``"loop"`` (one task after
            another) or ``"auto"``: the faster of the two for this model, sizes and device, timed
            on the first batch on each device (forward and backward passes of its support and
            query losses on up to 16 tasks, about 3 steps' work; the loop only where it is 1.5x
            faster, else ``"vmap"``; a checkpoint keeps the choice through :meth:`state_dict`;
            ``"checkpointed"``, a mode chosen for memory, takes the loop untimed: timing vmap would
            hold more than its segments ever do, and the loop holds less than vmap),
            and ``"loop"`` for a model
            vmap cannot batch (recurrent layers); with a ``chunk_size`` outside the checkpointed
            mode, chunked ``"vmap"``. All give the same meta-gradients to float rounding, not to
            the bit: like ``torch.backends.cudnn.benchmark``, a timed choice close to the margin
            can differ between two runs; pass ``"vmap"`` or ``"loop"`` for bit-identical reruns.
        chunk_size: tasks processed together: with ``"vmap"``, at most this many tasks per
            batched call; with ``"checkpointed"``, per recomputed segment (default: every task
            with ``"vmap"``, one with ``"loop"``, where it costs no speed).
        learn_inner_lr: ``None`` (fixed), ``"scalar"`` (one learnable rate), ``"per_parameter"``
            (Meta-SGD: a learnable rate tensor shaped like each adapted parameter) or
            ``"per_layer_per_step"`` (MAML++'s LSLR: one learnable rate per adapted parameter
            tensor and inner step; more steps than ``steps`` reuse the last step's rate).
            Learnable rates are in :meth:`parameters` and receive meta-gradients.
        checkpoint_every: with ``"checkpointed"``, inner steps per recomputed segment (default 1).
        checkpoint_hvp: with ``"checkpointed"``, how the backward pass differentiates the replayed
            inner steps, both exact: ``"reverse_over_reverse"`` (default: replay with
            ``create_graph=True``, differentiate the replay again) or ``"forward_over_reverse"``
            (replay values only; the support loss's Hessian-vector products by ``torch.func.jvp``
            over ``torch.func.grad``, the update rule's Jacobian by autograd on the rule alone; no
            second-order graph). The latter needs forward-mode derivatives of the loss's backward,
            which PyTorch lacks for a few operators (``F.huber_loss``, ``F.soft_margin_loss``), and
            runs under ``torch.func``, which refuses custom ``autograd.Function``s without
            ``setup_context`` and saved-tensor hooks (``save_on_cpu``); such a call fails naming
            this argument. Settable on a live learner.
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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, y) -> scalar, got {loss_fn!r}.")
        checks.positive_number("inner_lr", inner_lr)
        checks.integer("steps", steps, 0)
        checks.one_of("mode", mode, MODES)
        checks.one_of("batching", batching, BATCHINGS)
        checks.one_of("learn_inner_lr", learn_inner_lr, LEARN_INNER_LR)
        if isinstance(inner_optimizer, str):
            checks.one_of("inner_optimizer", inner_optimizer, INNER_OPTIMIZERS)
        else:
            checks.update_rule(inner_optimizer, inner_optimizer_options)
        checks.integer("chunk_size", chunk_size, 1, optional=True)
        checks.integer("checkpoint_every", checkpoint_every, 1, optional=True)
        if checkpoint_hvp is not None:
            checks.one_of("checkpoint_hvp", checkpoint_hvp, CHECKPOINT_HVPS)
        if chunk_size is not None and batching == "loop" and mode != "checkpointed":
            raise ValueError(
                f"chunk_size={chunk_size} only applies to batching='vmap' or mode='checkpointed'; drop it."
            )
        if checkpoint_every is not None and mode != "checkpointed":
            raise ValueError(
                f"checkpoint_every={checkpoint_every} only applies to mode='checkpointed' (mode is {mode!r})."
            )
        if checkpoint_hvp is not None and mode != "checkpointed":
            raise ValueError(
                f"checkpoint_hvp={checkpoint_hvp!r} only applies to mode='checkpointed' (mode is {mode!r}); "
                f"drop it, or pass mode='checkpointed'."
            )
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r} ({type(compile).__name__}).")
        self.compile = compile
        rule = (
            make_rule(inner_optimizer, inner_optimizer_options) if isinstance(inner_optimizer, str) else inner_optimizer
        )
        adapted = checks.adapt_set(adapt, model)
        check_step_layers(model)

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
        if implicit is not None and not isinstance(implicit, Implicit):
            raise TypeError(f"implicit must be a maml.Implicit, e.g. maml.Implicit(lam=1.0), got {implicit!r}.")
        if implicit is not None and mode != "implicit":
            raise ValueError(f"implicit={implicit!r} only applies to mode='implicit' (mode is {mode!r}); drop it.")
        self.implicit = implicit or Implicit()
        self._check_mode(mode)
        self.checkpoint_every = checkpoint_every or 1
        self._checkpoint_hvp: str = checkpoint_hvp or "reverse_over_reverse"
        self.check_finite = check_finite
        self._compiled: dict[str, Any] = {}
        self._probed: set[Any] = set()
        self._example_shape: torch.Size | None = None  # of the inputs of earlier calls, to tell a batch from a task
        self._names = {name for name, _ in model.named_parameters()}
        self._adapted = adapted
        self._integer_inputs = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
        # A chunk_size outside the checkpointed mode asks for chunked vmap, so "auto" honours it.
        chunked = chunk_size is not None and mode != "checkpointed"
        forward = TaskForward(model, loss_fn, "vmap" if batching == "auto" and chunked else batching, chunk_size)
        self._forward = forward
        rates = InnerRates(learn_inner_lr, self.inner_lr, tuple(adapted))
        self._loop = InnerLoop(forward, BoundRule(rule), rates, self._check)
        params = dict(model.named_parameters())
        self.rate_parameters: dict[str, nn.Parameter] = {
            k: nn.Parameter(v) for k, v in rates.init(params, steps).items()
        }
        checks.warn_weight_norm(model, mode)

    # ------------------------------------------------------------------ public API

    @property
    def mode(self) -> str:
        """``"second_order"``, ``"first_order"``, ``"checkpointed"`` or ``"reptile"``; may be set between steps."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        checks.one_of("mode", mode, MODES)
        self._check_mode(mode)
        if mode == "checkpointed" and self.chunk_size is not None and self.batching == "auto":
            raise ValueError(
                f"mode='checkpointed' on a learner built with chunk_size={self.chunk_size} for chunked vmap; "
                f"build it with mode='checkpointed' to recompute chunk_size tasks at a time."
            )
        checks.warn_weight_norm(self.model, mode)
        self._mode = mode

    @property
    def checkpoint_hvp(self) -> str:
        """How the checkpointed mode's backward pass differentiates its replayed steps; may be set between steps."""
        return self._checkpoint_hvp

    @checkpoint_hvp.setter
    def checkpoint_hvp(self, value: str) -> None:
        checks.one_of("checkpoint_hvp", value, CHECKPOINT_HVPS)
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
        if self.learn_inner_lr == "scalar":
            return {name: self.rate_parameters["inner_lr"] for name in self._adapted}
        if self.learn_inner_lr is None:
            return {name: self.inner_lr for name in self._adapted}
        return dict(self.rate_parameters)

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
        step_weights: Tensor | None = None,
        *,
        chunk: int | None = None,
        return_output: Literal[False] = False,
    ) -> Tensor: ...

    @overload
    def backward(
        self,
        batch: TaskBatch,
        step_weights: Tensor | None = None,
        *,
        chunk: int | None = None,
        return_output: Literal[True],
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
        if not isinstance(batch, TaskBatch):
            raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
        tasks = batch.num_tasks
        checks.integer("chunk", chunk, 1, optional=True)
        size = self._tasks_per_chunk(tasks) if chunk is None else chunk
        total, outputs = None, []
        for lo in range(0, tasks, size):
            part = batch[lo : lo + size]
            out = self.run(part, step_weights=step_weights)
            loss = out.loss * (part.num_tasks / tasks)
            if not torch.is_grad_enabled():
                loss = checks.evaluation_loss(loss)  # whose backward() says why there is no graph
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            if return_output:
                outputs.append(out)
        assert total is not None
        return _joined(outputs, total) if return_output else total

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
        checks.grad_mode_possible("run")
        steps = self.steps if steps is None else steps
        checks.integer("steps", steps, 0)
        own = params is None
        params, consts = self._split(params, batch.support_x, batch.query_x)
        checks.examples(batch.support_x.shape[1], batch.query_x.shape[1], steps)
        if own:
            checks.still_trainable(params)
        if step_weights is not None:
            compiled_step = self.compile and torch.is_grad_enabled()
            step_weights = checks.step_weights(step_weights, steps, params[self._adapted[0]], compiled=compiled_step)
        self._probe(params, consts, batch)
        self._example_shape = batch.support_x.shape[2:]
        rate_values = self._rate_values()
        grad = torch.is_grad_enabled()
        if grad:
            checks.differentiable(self._mode, self.compile, batch, consts, self._names)
        with self._attention():
            if self.compile and grad:
                if self._mode not in self._compiled:
                    step = compiled.meta_step(self._loop, first_order=self._mode == "first_order")
                    self._compiled[self._mode] = compiled.compile_step(step)
                return compiled.run(
                    self._compiled[self._mode],
                    self._loop if self.check_finite else self._loop.unchecked(),
                    params,
                    rate_values,
                    consts,
                    batch,
                    steps,
                    chunk=self._tasks_per_chunk(batch.num_tasks),
                    step_weights=step_weights,
                )
            if self._mode == "reptile" and grad:
                if step_weights is not None:
                    raise ValueError(
                        "step_weights weigh the query losses of a differentiated inner loop; mode='reptile' "
                        "differentiates none: drop step_weights."
                    )
                return reptile.run(self._loop, params, rate_values, consts, batch, steps)
            if self._mode == "implicit" and not grad:  # evaluation adapts as training does: proximally
                return implicit.evaluate(self._loop, self.implicit, params, rate_values, consts, batch, steps)
            if self._mode == "implicit":
                if step_weights is not None:
                    raise ValueError(
                        "step_weights weigh the query losses of an unrolled inner loop; mode='implicit' "
                        "unrolls none: drop step_weights."
                    )
                return implicit.run(self._loop, self.implicit, params, rate_values, consts, batch, steps)
            if self._mode == "checkpointed" and grad:
                return checkpointed.run(
                    self._loop,
                    params,
                    rate_values,
                    consts,
                    batch,
                    steps,
                    chunk=self._tasks_per_chunk(batch.num_tasks),
                    every=self.checkpoint_every,
                    step_weights=step_weights,
                    hvp=self._checkpoint_hvp,
                )
            return eager.run(
                self._loop,
                params,
                rate_values,
                consts,
                batch,
                steps,
                first_order=self._mode == "first_order",
                step_weights=step_weights,
            )

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
        params = dict(self.model.named_parameters())
        consts = {k: v for k, v in params.items() if k not in fast}
        consts.update(self.model.named_buffers())
        self._probe({k: v[0] for k, v in fast.items()}, consts, TaskBatch(x, y, x, y))
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
        for name, t in (("support_x", support_x), ("support_y", support_y)):
            if not isinstance(t, Tensor) or t.ndim < 1:
                raise TypeError(f"{name} must be a tensor of one task's examples, (n, ...), got {t!r}.")
        if support_x.shape[0] != support_y.shape[0]:
            raise ValueError(
                f"support_x has {support_x.shape[0]} examples but support_y has {support_y.shape[0]}; "
                f"every input needs exactly one target."
            )
        checks.grad_mode_possible("adapt")
        checks.one_task(support_x, self._example_shape)
        steps = self.steps if steps is None else steps
        checks.integer("steps", steps, 0)
        own = params is None
        params, consts = self._split(params, support_x)
        if own:
            checks.still_trainable(params)
        x, y = support_x.unsqueeze(0), support_y.unsqueeze(0)
        checks.examples(support_x.shape[0], None, steps)
        self._probe(params, consts, TaskBatch(x, y, x, y))
        self._example_shape = support_x.shape[1:]
        if self._mode == "implicit":  # iMAML's adaptation: the proximal problem, values only
            done = implicit.proximal_adapt(self._loop, self.implicit, params, self._rate_values(), consts, x, y, steps)
            fast = done.fast
        else:
            with self._attention():
                fast, _, _ = eager.adapt(
                    self._loop,
                    params,
                    self._rate_values(),
                    consts,
                    x,
                    y,
                    steps,
                    first_order=self._mode == "first_order",
                )
        frozen = {k: v for k, v in consts.items() if k in self._names}
        return {**frozen, **{k: v[0] for k, v in fast.items()}}

    def state_dict(self) -> dict[str, Any]:
        """The model's, the learnable inner rates' and a module rule's state, and what ``batching="auto"`` chose."""
        state = {
            "model": self.model.state_dict(),
            "inner_lrs": {k: v.detach().clone() for k, v in self.rate_parameters.items()},
            "batching": self._forward.chosen,
        }
        if isinstance(self.rule, nn.Module):
            state["rule"] = self.rule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned, after checking all of it: a mismatch loads nothing.

        Raises:
            ValueError: the state was saved by a learner built otherwise (another model's shapes,
                ``learn_inner_lr``, ``steps`` of per-step rates, or rule), naming the entry and both sides.
        """
        if not isinstance(state, Mapping) or not {"model", "inner_lrs"} <= set(state):
            raise ValueError(
                f"state must be what MetaLearner.state_dict() returned (keys 'model', 'inner_lrs', 'batching'), "
                f"got {type(state).__name__}{f' with keys {sorted(state)}' if isinstance(state, Mapping) else ''}."
            )
        if set(state["inner_lrs"]) != set(self.rate_parameters):
            raise ValueError(
                f"state['inner_lrs'] has rates {sorted(state['inner_lrs'])} but this learner learns "
                f"{sorted(self.rate_parameters)}; build it with the same learn_inner_lr as the saved one."
            )
        rule = self.rule if isinstance(self.rule, nn.Module) else None
        if rule is None and "rule" in state:
            raise ValueError(
                f"state holds a rule's own tensors (state['rule']: {sorted(state['rule'])}), but this learner's "
                f"rule {self.inner_optimizer if isinstance(self.inner_optimizer, str) else type(self.rule).__name__!r} "
                f"has none; build it with the same inner_optimizer as the saved one (e.g. maml.MetaCurvature(model))."
            )
        if rule is not None and "rule" not in state:
            raise ValueError(
                f"state has no 'rule' entry, but this learner's rule {type(self.rule).__name__} is a module "
                f"with a state of its own; load a state_dict saved by a learner with the same rule."
            )
        hint = {"inner_lrs": "the same learn_inner_lr and steps", "model": "the same model", "rule": "the same rule"}
        parts = [("model", self.model.state_dict()), ("inner_lrs", dict(self.rate_parameters))]
        parts += [("rule", rule.state_dict())] if rule is not None else []
        for part, mine in parts:
            checks.same_tensors(f"state[{part!r}]", state[part], mine, hint[part])
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for k, v in state["inner_lrs"].items():
                self.rate_parameters[k].copy_(v)
        self._forward.chosen = state.get("batching", {})  # absent from checkpoints of earlier versions
        if rule is not None:
            rule.load_state_dict(state["rule"])

    def to(self, *args: Any, **kwargs: Any) -> MetaLearner:
        """Moves the model, the learnable inner rates and a module rule, like ``nn.Module.to``."""
        self.model.to(*args, **kwargs)
        if isinstance(self.rule, nn.Module):
            self.rule.to(*args, **kwargs)
        for p in self.rate_parameters.values():
            p.data = p.data.to(*args, **kwargs)
        return self

    def __repr__(self) -> str:
        return (
            f"MetaLearner({type(self.model).__name__}, inner_lr={self.inner_lr}, steps={self.steps}, "
            f"mode={self._mode!r}, batching={self.batching!r}, learn_inner_lr={self.learn_inner_lr!r}, "
            f"inner_optimizer={self.inner_optimizer!r})"
        )

    # ------------------------------------------------------------------ internals

    def _rate_values(self) -> Params:
        """The learnable rates and the rule's own tensors: the meta-parameters every path threads beside the model's."""
        return {**self.rate_parameters, **rule_tensors(self.rule)}

    def _check_mode(self, mode: str) -> None:
        if mode in ("reptile", "implicit") and (self.compile or self.learn_inner_lr or rule_tensors(self.rule)):
            what = (
                "compile=True"
                if self.compile
                else f"learn_inner_lr={self.learn_inner_lr!r}"
                if self.learn_inner_lr
                else f"the rule {type(self.rule).__name__}'s own tensors"
            )
            why = (
                "Reptile moves the initialisation towards the adapted weights and differentiates nothing"
                if mode == "reptile"
                else "iMAML's meta-gradient depends on the inner problem's solution alone, not on how it was reached"
            )
            raise ValueError(
                f"mode={mode!r} with {what}: {why}, so it has no gradient for learned rates or rule tensors and "
                f"nothing to compile; drop it, or use mode='first_order'."
            )
        if self.compile and mode == "checkpointed":
            raise ValueError(
                "compile=True applies to mode='second_order' or 'first_order': the checkpointed mode "
                "recomputes its segments in a backward pass of its own, which torch.compile cannot trace. "
                "Use mode='second_order' with compile=True for speed, or mode='checkpointed' without it for memory."
            )

    def _attention(self) -> contextlib.AbstractContextManager[object]:
        """The math attention kernel where the inner steps are differentiated twice (exact modes, grad on)."""
        exact = torch.is_grad_enabled() and self._mode not in ("first_order", "reptile", "implicit")
        return exact_attention() if exact else contextlib.nullcontext()

    def _check(self, losses: Tensor, step: int, steps: int) -> None:
        if self.check_finite:  # read at every call: a script may turn it off for evaluation
            check_finite(losses, step, steps, self._rate_hint)

    def _split(self, params: Params | None, *inputs: Tensor) -> tuple[Params, Params]:
        """Validates, then splits into adapted parameters and shared constants (other parameters, buffers)."""
        if params is None:
            params = dict(self.model.named_parameters())
        else:
            if not isinstance(params, dict):
                raise TypeError(f"params must be a dict name -> Tensor, got {type(params).__name__}.")
            checks.parameter_names("params", params, self.model)
        checks.no_running_stats(self.model)
        first = params[self._adapted[0]]
        for name, x in zip(("support_x", "query_x"), inputs):
            checks.input_dtype(name, x, first.dtype, self._integer_inputs)
        for name, rate in self._rate_values().items():
            if rate.device != first.device or rate.dtype != first.dtype:
                what = (
                    f"the rule's tensor {name!r}"
                    if name.startswith(RULE_PREFIX)
                    else f"the learnable inner rate {name!r}"
                )
                raise ValueError(
                    f"{what} is {rate.dtype} on {rate.device} but the model's parameters are {first.dtype} on "
                    f"{first.device}; move both with learner.to(...) instead of model.to(...)."
                )
        adapted = {k: params[k] for k in self._adapted}
        consts = {k: v for k, v in params.items() if k not in adapted}
        consts.update(self.model.named_buffers())
        return adapted, consts

    def _probe(self, params: Params, consts: Params, batch: TaskBatch) -> None:
        """Runs :func:`check_model` once per device and train/eval configuration of the model, and lets
        ``"auto"`` settle the batching on the first batch of more than one task."""
        device = batch.support_x.device
        key = (device, tuple(m.training for m in self.model.modules()))
        probed = key in self._probed
        if probed and (self.batching != "auto" or self._forward.settled(device)):
            return
        with torch.no_grad():
            one = {k: v.detach() for k, v in params.items()}
            shared = {k: v.detach() for k, v in consts.items()}
        if not probed:
            check_model(
                self._forward,
                one,
                shared,
                batch.support_x[:1],
                batch.support_y[:1],
                may_fall_back=self.batching == "auto",
            )
            self._probed.add(key)
        # The checkpointed mode is chosen for memory: "auto" takes the loop there, untimed. Timing vmap holds
        # several tasks' graphs at once, more than the mode's segments do, and the loop holds less than vmap
        # (a conv net of tests/test_memory_plan.py, 2 tasks a chunk: 7.0 MB of tensors against 9.8 MB).
        if self._mode == "checkpointed" and torch.is_grad_enabled() and self.batching == "auto":
            self._forward.use_loop(device)
        tasks = batch.num_tasks
        data = [(batch.support_x, batch.support_y), (batch.query_x, batch.query_y)]
        self._forward.choose({k: v.expand(tasks, *v.shape) for k, v in one.items()}, shared, data)

    @property
    def _rate_hint(self) -> str:
        """The inner-rate setting to name in a NaN/Inf error."""
        return f"learn_inner_lr={self.learn_inner_lr!r}" if self.learn_inner_lr else f"inner_lr={self.inner_lr}"

    def _tasks_per_chunk(self, tasks: int) -> int:
        """Tasks per checkpointed segment or compiled call: ``chunk_size``, else all of them with vmap and one with a loop.

        A loop runs the tasks one after another anyway, so taking them one at a time costs no
        speed and holds one task's activations instead of every task's.
        """
        if self.chunk_size is not None:
            return self.chunk_size
        return 1 if self.resolved_batching == "loop" else tasks


def _joined(outputs: list[MetaOutput], loss: Tensor) -> MetaOutput:
    """The chunks' outputs as one over all their tasks (detached), with the meta-loss ``loss``."""
    steps = outputs[0].step_query_losses
    return MetaOutput(
        loss=loss,
        query_losses=torch.cat([o.query_losses for o in outputs]).detach(),
        query_out=torch.cat([o.query_out for o in outputs]).detach(),
        support_losses=torch.cat([o.support_losses for o in outputs], dim=1).detach(),
        fast={k: torch.cat([o.fast[k] for o in outputs]).detach() for k in outputs[0].fast},
        step_query_losses=None if steps is None else torch.cat([o.step_query_losses for o in outputs], dim=1).detach(),  # type: ignore[misc]
    )
