"""The per-task forward pass: losses and outputs at stacked fast weights (vmap or a loop), and the NaN/Inf check.

Fast weights are a ``dict[str, Tensor]`` keyed by ``named_parameters()`` names, each tensor
stacked on a leading task dimension: ``(T, *param.shape)``. Only the forward pass is batched
over tasks; every gradient is taken outside ``vmap`` by ``torch.autograd`` on the batched
graph. That is what keeps second order exact with batch, layer and instance norm, whose
reverse-over-reverse batching rules under ``vmap`` are wrong (pytorch/functorch#534).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import Tensor, nn

from .functional import Reparametrized

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # older torch: the same switch under its earlier name (below)
    SDPBackend, sdpa_kernel = None, None

Params = dict[str, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
Batching = Literal["auto", "vmap", "loop"]
# The consts' keys under which the adapted parameters' initial values reach an inner loss that reads them
# (InnerLoss.initial): no parameter or buffer name starts so. Riding in the consts, they get their exact
# meta-gradient on every path that already gives one to the trained parameters outside the adapt set.
INITIAL = "<initial>."
INNER_LOSS_KEYWORDS = ("fast", "initial", "params", "step")


@dataclasses.dataclass(frozen=True)
class InnerLoss:
    """The inner (support) objective: ``fn(output, y)``, plus the keywords its signature names.

    Attributes:
        fn: the user's ``inner_loss_fn``, or ``loss_fn`` where none was given.
        keywords: which of :data:`INNER_LOSS_KEYWORDS` ``fn`` takes: ``fast`` (the task's fast
            weights of the adapted parameters, name -> tensor), ``initial`` (their initial values:
            the meta-parameters, differentiated through), ``params`` (every parameter and buffer
            of the model as the task's forward pass uses it: the fast weights, and the others'
            meta-learned values, e.g. per-example weights kept in the model outside ``adapt``) and
            ``step`` (the 0-based inner step).
    """

    fn: LossFn
    keywords: frozenset[str] = frozenset()

    @classmethod
    def of(cls, fn: Callable[..., Tensor]) -> InnerLoss:
        """``fn`` with the keywords of :data:`INNER_LOSS_KEYWORDS` its signature names."""
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a callable without a signature Python can read: the plain form
            return cls(fn)
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return cls(fn, frozenset(k for k in INNER_LOSS_KEYWORDS if k in parameters and parameters[k].kind in kinds))

    @property
    def initial(self) -> bool:
        """Whether the loss reads the initial weights (then the consts carry them: :func:`with_initial`)."""
        return "initial" in self.keywords

    def __call__(self, out: Tensor, y: Tensor, fast: Params, consts: Params, step: int) -> Tensor:
        kwargs: dict[str, object] = {}
        if "fast" in self.keywords:
            kwargs["fast"] = fast
        if "initial" in self.keywords:
            kwargs["initial"] = {k[len(INITIAL) :]: v for k, v in consts.items() if k.startswith(INITIAL)}
        if "params" in self.keywords:
            kwargs["params"] = {**{k: v for k, v in consts.items() if not k.startswith(INITIAL)}, **fast}
        if "step" in self.keywords:
            kwargs["step"] = step
        return self.fn(out, y, **kwargs)


def with_initial(consts: Params, params: Params, inner_loss: InnerLoss | None) -> Params:
    """``consts`` with the initial values ``params`` of the adapted parameters, where ``inner_loss`` reads them."""
    if inner_loss is None or not inner_loss.initial:
        return consts
    return {**consts, **{INITIAL + k: v for k, v in params.items()}}


@contextlib.contextmanager
def unfused_layers() -> Iterator[None]:
    """Runs ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` on their composite (differentiable) path.

    In eval mode they take a fused "fast path" (``aten::_transformer_encoder_layer_fwd``,
    ``aten::_native_multi_head_attention``) that has no derivative, when no input requires grad
    as they see it: under ``vmap`` the per-task weights look so to them, and the meta-gradient
    then fails. The composite path computes the same function with derivatives. The switch is
    process-wide (``torch.backends.mha``), so it is restored on exit.
    """
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def exact_attention() -> contextlib.AbstractContextManager[object]:
    """Runs attention on the math kernel, whose double backward exists, for steps differentiated twice.

    ``F.scaled_dot_product_attention`` (and ``nn.MultiheadAttention`` without weights, which
    calls it) otherwise picks a fused kernel with no derivative of its backward pass
    (``aten::_scaled_dot_product_flash_attention_for_cpu_backward`` on the CPU, flash and
    memory-efficient attention on GPUs), which the exact meta-gradient needs through every
    inner step. Entering the context costs about 11 microseconds, so callers enter it once per
    inner loop or replayed segment, not per step.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(unfused_layers())
    if sdpa_kernel is None:
        stack.enter_context(
            torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False)
        )
    else:
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


class TaskForward:
    """Per-task losses and outputs of ``model`` at per-task parameters.

    Args:
        model: the network; only its structure is used, its parameters are never read here.
        loss_fn: ``loss_fn(output, y) -> scalar`` for one task's examples.
        batching: ``"vmap"`` runs all tasks as one batched forward pass, ``"loop"`` runs
            them one after another, ``"auto"`` the faster of the two on each device, as timed on
            the first batch there (``planner.choose_batching``; ``"vmap"`` until then).
        chunk_size: with ``"vmap"``, at most this many tasks per batched call (``None``: all).
        inner_loss: the support passes' objective (``inner=True``); ``None``: ``loss_fn``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batching: Batching,
        chunk_size: int | None,
        inner_loss: InnerLoss | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.inner_loss = inner_loss
        self.batching = batching
        self.chunk_size = chunk_size
        self.takes_step = takes_step(model)
        self._call = Reparametrized(model)
        self._chosen: dict[torch.device, str] = {}
        # By inner step (one entry for all where the support pass cannot tell the steps apart): the adapted
        # parameters the support loss does not use, whose gradient autograd gives as None (Probe finds them).
        self.unused_by_step: dict[int, frozenset[str]] = {}

    @property
    def by_step(self) -> bool:
        """Whether the support pass sees the inner step (the model's ``forward`` or the inner loss takes ``step``),
        so that which parameters it uses may differ between steps."""
        return self.takes_step or (self.inner_loss is not None and "step" in self.inner_loss.keywords)

    def unused(self, step: int) -> frozenset[str]:
        """The adapted parameters the support loss of inner step ``step`` does not use, as the probe found them on the
        first task (``model_check.unused_parameters``); empty where none was found or none was probed.

        ``torch.optim`` skips a parameter whose ``.grad`` is None: no weight decay, no state. Every
        path takes the support gradient its own way (``torch.func.grad`` gives zeros where autograd
        gives None), so the rule is told by name (:meth:`rules.BoundRule.update`'s ``unused``).
        """
        return self.unused_by_step.get(step if self.by_step else 0, frozenset())

    def stale(self) -> bool:
        """Whether the model's structure changed since this pass mapped it (:meth:`Reparametrized.stale`)."""
        return self._call.stale()

    def refresh(self) -> None:
        """Maps the model anew, as it is now (which parameters its support loss uses is found anew)."""
        self._call.refresh()
        self.unused_by_step = {}

    def resolve(self, device: torch.device) -> str:
        """The batching used for tensors on ``device``: ``"vmap"`` or ``"loop"``."""
        if self.batching != "auto":
            return self.batching
        return self._chosen.get(device, "vmap")

    def settled(self, device: torch.device) -> bool:
        """Whether ``"auto"`` has chosen a batching on ``device`` (a fixed batching always has)."""
        return self.batching != "auto" or device in self._chosen

    def settle(self, device: torch.device, batching: str) -> None:
        """Runs the tasks on ``device`` by ``batching`` from now on: what ``"auto"`` chose (``planner.choose_batching``),
        or the loop for a model vmap cannot batch."""
        self._chosen[device] = batching

    @property
    def chosen(self) -> dict[str, str]:
        """What ``"auto"`` settled, by device: ``{"cpu": "vmap"}``; a checkpoint keeps it, so a resumed run batches alike."""
        return {str(device): batching for device, batching in self._chosen.items()}

    @chosen.setter
    def chosen(self, chosen: dict[str, str]) -> None:
        self._chosen.update({torch.device(device): batching for device, batching in chosen.items()})

    def with_batching(self, batching: Batching) -> TaskForward:
        """The same pass (model, losses) run by ``batching``, all tasks per call: what a probe times or measures."""
        return TaskForward(self.model, self.loss_fn, batching, None, self.inner_loss)

    def _one(self, fast: Params, consts: Params, x: Tensor, y: Tensor, step: int, inner: bool) -> tuple[Tensor, Tensor]:
        """One task: ``x (n, *x_shape)``, ``y (n, *y_shape)`` -> loss ``()``, output ``(n, ...)``."""
        kwargs = {"step": step} if self.takes_step else None
        out = self._call({**fast, **consts}, (x,), kwargs)
        if not isinstance(out, Tensor):  # MetaOutput stacks the outputs of the tasks: one tensor each
            raise TypeError(
                f"the model returned a {type(out).__name__}; the learner needs one tensor, the output loss_fn "
                f"scores: return it alone, or wrap the model (e.g. nn.Sequential(model, Pick()) with a module "
                f"whose forward returns out[0])."
            )
        own = inner and self.inner_loss is not None
        loss = self.inner_loss(out, y, fast, consts, step) if own else self.loss_fn(out, y)  # type: ignore[misc]
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"{'inner_loss_fn' if own else 'loss_fn'} returned {got} for one task; it must return a scalar "
                f"tensor, the mean loss "
                f"over the task's examples (e.g. F.cross_entropy(out, y), or nn.MSELoss() with its "
                f"default reduction='mean')."
            )
        return loss, out

    def __call__(
        self,
        fast: Params,
        consts: Params,
        x: Tensor,
        y: Tensor,
        batching: str | None = None,
        *,
        step: int = 0,
        inner: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """All tasks.

        Args:
            fast: ``(T, *shape)`` per-task parameters.
            consts: parameters and buffers shared by all tasks (no task dimension).
            x: ``(T, n, *x_shape)`` inputs.
            y: ``(T, n, *y_shape)`` targets.
            batching: ``"vmap"`` or ``"loop"`` for this call (default: :meth:`resolve`'s).
            step: the inner step the pass belongs to (0-based), for a model whose ``forward``
                takes ``step`` (:func:`takes_step`).
            inner: a support pass of the inner loop: scored by the inner loss (``inner_loss``).

        Returns:
            ``(T,)`` losses and ``(T, n, ...)`` model outputs.
        """
        if batching is None and self.batching == "auto" and x.shape[0] == 1:
            batching = "loop"  # one task: the plain call, without what vmap holds for a batch of one
        if (batching or self.resolve(x.device)) == "vmap":
            names = tuple(fast)
            # A channels_last model's weights would make its layers ask, inside vmap, whether a
            # tensor is channels_last, which vmap cannot answer: batched calls get contiguous ones.
            shared = {k: v.contiguous() for k, v in consts.items()}

            # Only tensors cross the vmap boundary (a tuple, not dicts): fewer pytree passes per call.
            def one(values: tuple[Tensor, ...], xt: Tensor, yt: Tensor) -> tuple[Tensor, Tensor]:
                return self._one(dict(zip(names, values)), shared, xt, yt, step, inner)

            # randomness="different": dropout draws independent masks for every task, as a loop would.
            batched = torch.func.vmap(one, randomness="different", chunk_size=self.chunk_size)
            return batched(tuple(v.contiguous() for v in fast.values()), x, y)
        if x.shape[0] == 1:  # one task (a chunk of one): views whose backward are views, no kernel per parameter
            loss, out = self._one({k: v.squeeze(0) for k, v in fast.items()}, consts, x[0], y[0], step, inner)
            return loss.unsqueeze(0), out.unsqueeze(0)
        # unbind has one backward node that stacks the task gradients; indexing p[t] would
        # build T full-size zero tensors per parameter in the backward pass.
        per_task = [dict(zip(fast, values)) for values in zip(*(v.unbind(0) for v in fast.values()))]
        tasks = zip(per_task, x.unbind(0), y.unbind(0))
        losses, outs = zip(*(self._one(f, consts, xt, yt, step, inner) for f, xt, yt in tasks))
        return torch.stack(losses), torch.stack(outs)


def takes_step(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes a keyword argument ``step``: then every pass gets the inner step's index.

    The support pass that computes update ``k`` and the query pass after update ``k`` both get
    ``step=k`` (MAML++'s per-step batch norm indexes its weights so); a query pass with no update
    before it gets ``step=0``.
    """
    try:
        parameter = inspect.signature(model.forward).parameters.get("step")
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def check_finite(losses: Tensor, step: int, steps: int, rates_hint: str) -> None:
    """Raises a FloatingPointError naming the first task and step whose inner loss is NaN/Inf."""
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    task = int((~finite).nonzero()[0, 0])
    raise FloatingPointError(
        f"the inner (support) loss is {losses[task].item()} for task {task} at inner step {step} "
        f"(0-based, of {steps}); the fast weights diverged or the task's data holds NaN/Inf. "
        f"Lower the inner learning rate ({rates_hint}), check support_x/support_y of task {task}, "
        f"or pass check_finite=False to MetaLearner to skip this check."
    )
