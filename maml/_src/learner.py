"""MetaLearner: MAML's inner and outer loop over a model's parameters as a dict of tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import checks
from .batch import TaskBatch
from .checkpoint import checkpointed_segment
from .compiled import compile_step, meta_step, with_gradient
from .inner import LossFn, Params, TaskForward, check_finite, sgd_step

Mode = Literal["second_order", "first_order", "checkpointed"]
Batching = Literal["auto", "vmap", "loop"]
LearnInnerLr = Literal["scalar", "per_parameter"] | None

MODES: tuple[str, ...] = ("second_order", "first_order", "checkpointed")
BATCHINGS: tuple[str, ...] = ("auto", "vmap", "loop")
LEARN_INNER_LR: tuple[str | None, ...] = (None, "scalar", "per_parameter")


@dataclasses.dataclass(frozen=True)
class MetaOutput:
    """Everything one pass over a meta-batch computes.

    Attributes:
        loss: ``()`` mean query loss over the tasks at their fast weights; differentiable
            with respect to the model's parameters and the learnable inner rates.
        query_losses: ``(T,)`` each task's query loss (detached).
        query_out: ``(T, n_query, ...)`` the model's outputs on the query inputs at the fast
            weights (detached), e.g. logits for accuracy.
        support_losses: ``(steps, T)`` support loss before each inner step (detached); row
            0 is the loss before adaptation.
        fast: ``(T, *shape)`` per-task fast weights of the adapted parameters.
    """

    loss: Tensor
    query_losses: Tensor
    query_out: Tensor
    support_losses: Tensor
    fast: Params


class MetaLearner:
    """MAML (Finn et al., 2017) over any ``nn.Module``, with exact second-order meta-gradients.

    The inner loop takes ``steps`` SGD steps on each task's support loss, starting from the
    model's current parameters, through ``torch.func.functional_call``; the model's own
    parameters are never modified. The meta-loss is the mean query loss at the fast weights.

    Args:
        model: any network of ordinary layers. Parameters with ``requires_grad=False`` are
            used as they are and not adapted. Norm layers in training mode must not track
            running statistics (``track_running_stats=False``), or the model must be in eval mode.
        loss_fn: ``loss_fn(output, y) -> scalar`` for one task (mean over its examples).
        inner_lr: the inner SGD learning rate (the initial value if learned).
        steps: inner SGD steps per task (0: no adaptation).
        mode: ``"second_order"`` (exact), ``"first_order"`` (FOMAML: inner gradients are
            constants) or ``"checkpointed"`` (exact, keeps only every ``checkpoint_every``-th
            fast weights and recomputes the rest in the backward pass).
        batching: ``"vmap"`` (tasks as one batched forward pass), ``"loop"`` (one task after
            another) or ``"auto"``: ``"loop"`` for a model with convolutions on the CPU (where
            ``vmap`` turns them into slow grouped convolutions), else ``"vmap"``; with a
            ``chunk_size`` outside the checkpointed mode, chunked ``"vmap"``. All give the same
            meta-gradients.
        chunk_size: tasks processed together: with ``"vmap"``, at most this many tasks per
            batched call; with ``"checkpointed"``, per recomputed segment (default: every task
            with ``"vmap"``, one with ``"loop"``, where it costs no speed), so ``chunk_size=1``
            holds one task's activations at a time (the least memory).
        learn_inner_lr: ``None`` (fixed), ``"scalar"`` (one learnable rate) or
            ``"per_parameter"`` (Meta-SGD: a learnable rate tensor shaped like each parameter).
            Learnable rates are in :meth:`parameters` and receive meta-gradients.
        checkpoint_every: with ``"checkpointed"``, inner steps per recomputed segment. Every
            step is recomputed exactly once whatever this is, so the default 1 (keep every
            parameter-sized iterate, hold one step's activations) uses the least memory unless
            the parameters outweigh a step's activations; raise it to keep fewer iterates.
        check_finite: raise if an inner loss is NaN/Inf, naming the task and step (costs one
            device synchronisation per inner step).
        compile: compute the meta-loss and its meta-gradient together, in one ``torch.compile``'d
            function of ``torch.func.grad`` transforms (second and first order), when grad mode is
            on. Exact like the eager engine, several times faster where eager operator calls
            dominate (small models), at a one-off compile of seconds to minutes per input shape
            and step count. The returned loss carries its gradient as a constant: ``backward()``
            works, differentiating the meta-gradient again does not, and ``MetaOutput.fast``
            is detached. Under ``torch.no_grad()`` (evaluation) the eager engine runs.
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
        check_finite: bool = True,
        compile: bool = False,
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
        checks.integer("chunk_size", chunk_size, 1, optional=True)
        checks.integer("checkpoint_every", checkpoint_every, 1, optional=True)
        if chunk_size is not None and batching == "loop" and mode != "checkpointed":
            raise ValueError(
                f"chunk_size={chunk_size} only applies to batching='vmap' or mode='checkpointed'; drop it."
            )
        if checkpoint_every is not None and mode != "checkpointed":
            raise ValueError(
                f"checkpoint_every={checkpoint_every} only applies to mode='checkpointed' (mode is {mode!r})."
            )
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r} ({type(compile).__name__}).")
        if compile and mode == "checkpointed":
            raise ValueError(
                "compile=True applies to mode='second_order' or 'first_order': the checkpointed mode "
                "recomputes its segments in a backward pass of its own, which torch.compile cannot trace. "
                "Use mode='second_order' with compile=True for speed, or mode='checkpointed' without it for memory."
            )
        adapted = [name for name, p in model.named_parameters() if p.requires_grad]
        if not adapted:
            raise ValueError("model has no parameter with requires_grad=True: there is nothing to adapt.")

        self.model = model
        self.loss_fn = loss_fn
        self.inner_lr = float(inner_lr)
        self.steps = steps
        self.mode = mode
        self.batching = batching
        self.chunk_size = chunk_size
        self.learn_inner_lr = learn_inner_lr
        self.checkpoint_every = checkpoint_every or 1
        self.check_finite = check_finite
        self.compile = compile
        self._compiled: Any = None
        self._names = {name for name, _ in model.named_parameters()}
        self._adapted = adapted
        self._integer_inputs = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
        # A chunk_size outside the checkpointed mode asks for chunked vmap, so "auto" honours it.
        chunked = chunk_size is not None and mode != "checkpointed"
        self._forward = TaskForward(model, loss_fn, "vmap" if batching == "auto" and chunked else batching, chunk_size)

        # Learnable rates, keyed "inner_lr" (scalar) or by parameter name (per_parameter).
        self.rate_parameters: dict[str, nn.Parameter] = {}
        params = dict(model.named_parameters())
        if learn_inner_lr == "scalar":
            p = params[adapted[0]]
            self.rate_parameters["inner_lr"] = nn.Parameter(torch.tensor(self.inner_lr, dtype=p.dtype, device=p.device))
        elif learn_inner_lr == "per_parameter":
            for name in adapted:
                self.rate_parameters[name] = nn.Parameter(torch.full_like(params[name], self.inner_lr))

    # ------------------------------------------------------------------ public API

    def parameters(self) -> Iterator[nn.Parameter]:
        """The meta-parameters: the model's parameters, then the learnable inner rates."""
        yield from self.model.parameters()
        yield from self.rate_parameters.values()

    @property
    def resolved_batching(self) -> str:
        """The batching used on the model's current device: ``"vmap"`` or ``"loop"`` (resolves ``"auto"``)."""
        return self._forward.resolve(next(self.model.parameters()).device)

    @property
    def inner_lrs(self) -> dict[str, float | Tensor]:
        """The inner learning rate of every adapted parameter (a float, or a learnable tensor)."""
        if self.learn_inner_lr == "scalar":
            return {name: self.rate_parameters["inner_lr"] for name in self._adapted}
        if self.learn_inner_lr == "per_parameter":
            return dict(self.rate_parameters)
        return {name: self.inner_lr for name in self._adapted}

    def meta_loss(self, batch: TaskBatch) -> Tensor:
        """The mean query loss over the tasks of ``batch`` after adaptation: a scalar tensor.

        ``meta_loss(batch).backward()`` leaves the meta-gradient in ``.grad`` of the model's
        parameters and of the learnable inner rates.
        """
        return self.run(batch).loss

    def run(self, batch: TaskBatch, params: Params | None = None, steps: int | None = None) -> MetaOutput:
        """Adapts to every task of ``batch`` and scores the fast weights on its query set.

        Args:
            batch: ``T`` tasks.
            params: the initial parameters, keyed like ``dict(model.named_parameters())``;
                default: the model's current parameters.
            steps: inner steps for this call (default: the learner's ``steps``), e.g. more
                steps at test time than in training.

        Returns:
            The meta-loss and what was computed on the way (see :class:`MetaOutput`).
        """
        if not isinstance(batch, TaskBatch):
            raise TypeError(f"batch must be a maml.TaskBatch, got {type(batch).__name__}.")
        params, consts = self._split(params, batch.support_x, batch.query_x)
        if self.mode == "checkpointed" and torch.is_grad_enabled():
            return self._run_checkpointed(params, consts, batch, steps)
        if self.compile and torch.is_grad_enabled():
            return self._run_compiled(params, consts, batch, steps)
        fast, support_losses = self._adapt(params, consts, batch.support_x, batch.support_y, steps)
        query_losses, query_out = self._forward(fast, consts, batch.query_x, batch.query_y)
        return MetaOutput(
            loss=query_losses.mean(),
            query_losses=query_losses.detach(),
            query_out=query_out.detach(),
            support_losses=support_losses,
            fast=fast,
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
        return self._forward(fast, consts, x, y)

    def adapt(
        self, support_x: Tensor, support_y: Tensor, params: Params | None = None, steps: int | None = None
    ) -> Params:
        """One task's fast weights.

        Args:
            support_x: ``(n, *x_shape)`` support inputs of one task (no task dimension).
            support_y: ``(n, *y_shape)`` support targets.
            params: the initial parameters (default: the model's current parameters).
            steps: inner steps for this call (default: the learner's ``steps``).

        Returns:
            Every parameter of the model, name -> tensor, the adapted ones replaced by their
            fast weights; use them with ``torch.func.functional_call(model, fast, x)``.
            Differentiable with respect to the initial parameters when grad mode is on.
        """
        for name, t in (("support_x", support_x), ("support_y", support_y)):
            if not isinstance(t, Tensor) or t.ndim < 1:
                raise TypeError(f"{name} must be a tensor of one task's examples, (n, ...), got {t!r}.")
        if support_x.shape[0] != support_y.shape[0]:
            raise ValueError(
                f"support_x has {support_x.shape[0]} examples but support_y has {support_y.shape[0]}; "
                f"every input needs exactly one target."
            )
        params, consts = self._split(params, support_x)
        fast, _ = self._adapt(params, consts, support_x.unsqueeze(0), support_y.unsqueeze(0), steps)
        frozen = {k: v for k, v in consts.items() if k in self._names}
        return {**frozen, **{k: v[0] for k, v in fast.items()}}

    def state_dict(self) -> dict[str, Any]:
        """The model's and the learnable inner rates' state, for checkpoints."""
        return {
            "model": self.model.state_dict(),
            "inner_lrs": {k: v.detach().clone() for k, v in self.rate_parameters.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned."""
        self.model.load_state_dict(state["model"])
        if set(state["inner_lrs"]) != set(self.rate_parameters):
            raise ValueError(
                f"state['inner_lrs'] has rates {sorted(state['inner_lrs'])} but this learner learns "
                f"{sorted(self.rate_parameters)}; build it with the same learn_inner_lr as the saved one."
            )
        with torch.no_grad():
            for k, v in state["inner_lrs"].items():
                self.rate_parameters[k].copy_(v)

    def to(self, *args: Any, **kwargs: Any) -> MetaLearner:
        """Moves the model and the learnable inner rates, like ``nn.Module.to``."""
        self.model.to(*args, **kwargs)
        for p in self.rate_parameters.values():
            p.data = p.data.to(*args, **kwargs)
        return self

    def __repr__(self) -> str:
        return (
            f"MetaLearner({type(self.model).__name__}, inner_lr={self.inner_lr}, steps={self.steps}, "
            f"mode={self.mode!r}, batching={self.batching!r}, learn_inner_lr={self.learn_inner_lr!r})"
        )

    # ------------------------------------------------------------------ internals

    def _split(self, params: Params | None, *inputs: Tensor) -> tuple[Params, Params]:
        """Validates, then splits into adapted parameters and shared constants (frozen parameters, buffers)."""
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
        for name, rate in self.rate_parameters.items():
            if rate.device != first.device or rate.dtype != first.dtype:
                raise RuntimeError(
                    f"the learnable inner rate {name!r} is {rate.dtype} on {rate.device} but the model's "
                    f"parameters are {first.dtype} on {first.device}; move both with learner.to(...) "
                    f"instead of model.to(...)."
                )
        adapted = {k: params[k] for k in self._adapted}
        consts = {k: v for k, v in params.items() if k not in adapted}
        consts.update(self.model.named_buffers())
        return adapted, consts

    def _adapt(self, params: Params, consts: Params, x: Tensor, y: Tensor, steps: int | None) -> tuple[Params, Tensor]:
        """Runs the inner loop on ``T`` tasks: ``x (T, n, ...)`` -> fast weights ``(T, *shape)``, losses ``(steps, T)``."""
        if steps is None:
            steps = self.steps
        checks.integer("steps", steps, 0)
        tasks = x.shape[0]
        rates = self.inner_lrs
        mode = self.mode
        differentiable = torch.is_grad_enabled()
        with torch.enable_grad():  # the inner loop needs gradients even under torch.no_grad()
            fast = {k: p.unsqueeze(0).expand(tasks, *p.shape) for k, p in params.items()}
            if not differentiable:
                # Evaluation: no meta-gradient wanted, so the same values without a graph to keep.
                fast = {k: v.detach().requires_grad_() for k, v in fast.items()}
                rates = {k: r.detach() if isinstance(r, Tensor) else r for k, r in rates.items()}
                mode = "first_order"
            losses: list[Tensor] = []
            if mode == "checkpointed":
                fast, losses = self._checkpointed_steps(fast, consts, rates, x, y, steps)
            else:
                for step in range(steps):
                    fast, loss = self._step(fast, consts, rates, x, y, step, steps, create_graph=mode == "second_order")
                    losses.append(loss)
        if not differentiable:
            fast = {k: v.detach() for k, v in fast.items()}
        support_losses = torch.stack(losses) if losses else x.new_zeros((0, tasks), dtype=torch.float32)
        return fast, support_losses

    def _run_checkpointed(self, params: Params, consts: Params, batch: TaskBatch, steps: int | None) -> MetaOutput:
        """The checkpointed meta-loss, one chunk of tasks at a time.

        Each chunk's inner steps and its query loss are checkpointed segments, so the forward
        pass keeps only parameter-sized iterates and the backward pass recomputes one segment of
        one chunk at a time: peak memory is the iterates plus one chunk's step (or query) activations.
        """
        fast, support_losses = self._adapt(params, consts, batch.support_x, batch.support_y, steps)
        size = self._tasks_per_chunk(batch.num_tasks)
        losses, outs = [], []
        for lo in range(0, batch.num_tasks, size):
            chunk = batch[lo : lo + size]
            f = {k: v[lo : lo + size] for k, v in fast.items()}
            loss, out = self._checkpointed_query(f, consts, chunk.query_x, chunk.query_y)
            losses.append(loss)
            outs.append(out)
        query_losses = torch.cat(losses)
        return MetaOutput(
            loss=query_losses.mean(),
            query_losses=query_losses.detach(),
            query_out=torch.cat(outs),
            support_losses=support_losses,
            fast=fast,
        )

    def _run_compiled(self, params: Params, consts: Params, batch: TaskBatch, steps: int | None) -> MetaOutput:
        """The meta-loss with its meta-gradient computed now, by the compiled step, one chunk of tasks at a time.

        With the loop, each call is one task (no grouped convolutions, one task's activations);
        with vmap, all tasks (or ``chunk_size``). The loss and gradient are the chunks' means
        weighted by their sizes, which is the mean over the meta-batch.
        """
        if steps is None:
            steps = self.steps
        checks.integer("steps", steps, 0)
        if self._compiled is None:
            # inner_lrs names each parameter's rate; the compiled step takes the learnable ones by key.
            key = {id(p): k for k, p in self.rate_parameters.items()}
            rate_of = {k: key[id(r)] if isinstance(r, Tensor) else r for k, r in self.inner_lrs.items()}
            step = meta_step(self._forward, rate_of, first_order=self.mode == "first_order")
            self._compiled = compile_step(step)
        tasks = batch.num_tasks
        size = self._tasks_per_chunk(tasks)
        values = {k: v.detach() for k, v in params.items()}
        rate_values = {k: v.detach() for k, v in self.rate_parameters.items()}
        consts = {k: v.detach() for k, v in consts.items()}

        def call(chunk: TaskBatch) -> tuple[Tensor, list[Tensor], tuple[Tensor, Tensor, Tensor, Params]]:
            (g_params, g_rates), (loss, *rest) = self._compiled(
                values, rate_values, consts, chunk.support_x, chunk.support_y, chunk.query_x, chunk.query_y, steps
            )
            return loss, [*g_params.values(), *g_rates.values()], tuple(rest)  # type: ignore[return-value]

        if size >= tasks:
            loss, grads, (query_losses, query_out, support_losses, fast) = call(batch)
        else:  # the meta-batch's mean: the chunks' means weighted by their sizes
            parts = []
            for lo in range(0, tasks, size):
                chunk = batch[lo : lo + size]
                chunk_loss, chunk_grads, rest = call(chunk)
                weight = chunk.num_tasks / tasks
                if not parts:
                    loss, grads = chunk_loss * weight, [g * weight for g in chunk_grads]
                else:
                    loss, grads = loss + chunk_loss * weight, [a + g * weight for a, g in zip(grads, chunk_grads)]
                parts.append(rest)
            query_losses = torch.cat([p[0] for p in parts])
            query_out = torch.cat([p[1] for p in parts])
            support_losses = torch.cat([p[2] for p in parts], dim=1)  # (steps, T)
            fast = {k: torch.cat([p[3][k] for p in parts]) for k in values}
        if self.check_finite and not bool(torch.isfinite(support_losses).all()):  # one synchronisation
            for i in range(steps):
                check_finite(support_losses[i], i, steps, self._rate_hint)
        loss = with_gradient(loss, [*params.values(), *self.rate_parameters.values()], grads)
        return MetaOutput(loss=loss, query_losses=query_losses, query_out=query_out, support_losses=support_losses, fast=fast)

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

    def _checkpointed_steps(
        self, fast: Params, consts: Params, rates: dict[str, Any], x: Tensor, y: Tensor, steps: int
    ) -> tuple[Params, list[Tensor]]:
        """The checkpointed inner loop: each segment is ``checkpoint_every`` steps of one chunk of tasks.

        The segments run step by step, every chunk in turn, so with one step per segment (the
        default) the tasks draw their dropout masks in the same order as in second order.

        Returns:
            The fast weights ``(T, *shape)`` and each step's ``(T,)`` support losses.
        """
        tasks = x.shape[0]
        size = self._tasks_per_chunk(tasks)
        starts = range(0, tasks, size)
        chunks = [{k: v[lo : lo + size] for k, v in fast.items()} for lo in starts]
        losses: list[list[Tensor]] = [[] for _ in starts]
        for start in range(0, steps, self.checkpoint_every):
            count = min(self.checkpoint_every, steps - start)
            for i, lo in enumerate(starts):
                xs, ys = x[lo : lo + size], y[lo : lo + size]
                chunks[i] = self._checkpointed(chunks[i], consts, rates, xs, ys, count, losses[i])
            if self.check_finite:  # once every chunk took these steps, so that the task index is the batch's
                for step in range(start, start + count):
                    check_finite(torch.cat([chunk[step] for chunk in losses]), step, steps, self._rate_hint)
        if len(chunks) > 1:
            fast = {k: torch.cat([c[k] for c in chunks]) for k in fast}
        else:
            fast = chunks[0]
        return fast, [torch.cat(per_step) for per_step in zip(*losses)]

    def _checkpointed_query(self, fast: Params, consts: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(T,)`` query losses at ``fast`` whose activations are recomputed in the backward pass, and the outputs."""
        names = list(fast)
        outputs: list[Tensor] = []

        def run(fast_values: list[Tensor], rate_values: list[Tensor], replay: bool) -> tuple[Tensor, ...]:
            with torch.set_grad_enabled(replay):
                losses, out = self._forward(dict(zip(names, fast_values)), consts, x, y)
            if not replay:
                outputs.append(out)
            return (losses,)

        (losses,) = checkpointed_segment(run, [fast[n] for n in names], [], returns_fast=False)
        return losses, outputs[0]

    def _step(
        self,
        fast: Params,
        consts: Params,
        rates: dict[str, Any],
        x: Tensor,
        y: Tensor,
        step: int,
        steps: int,
        *,
        create_graph: bool,
    ) -> tuple[Params, Tensor]:
        new, losses = sgd_step(self._forward, fast, consts, rates, x, y, create_graph=create_graph)
        if self.check_finite:
            check_finite(losses, step, steps, self._rate_hint)
        return new, losses

    def _checkpointed(
        self,
        fast: Params,
        consts: Params,
        rates: dict[str, Any],
        x: Tensor,
        y: Tensor,
        count: int,
        losses: list[Tensor],
    ) -> Params:
        """One segment: ``count`` inner steps, appending their support losses to ``losses``."""
        names = list(fast)
        learned = [n for n in names if isinstance(rates[n], Tensor)]

        def run(fast_values: list[Tensor], rate_values: list[Tensor], replay: bool) -> tuple[Tensor, ...]:
            f = dict(zip(names, fast_values))
            r = {**rates, **dict(zip(learned, rate_values))}
            for _ in range(count):
                if not replay:  # values only: a fresh leaf per step keeps no graph across steps
                    f = {k: v.detach().requires_grad_() for k, v in f.items()}
                f, loss = sgd_step(self._forward, f, consts, r, x, y, create_graph=replay)
                if not replay:
                    losses.append(loss)
            return tuple(f.values())

        out = checkpointed_segment(run, [fast[n] for n in names], [rates[n] for n in learned])
        return dict(zip(names, out))
