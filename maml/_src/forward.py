"""The per-task forward pass: losses and outputs at stacked fast weights (vmap or a loop), and the NaN/Inf check.

Fast weights are a ``dict[str, Tensor]`` keyed by ``named_parameters()`` names, each tensor
stacked on a leading task dimension: ``(T, *param.shape)``. Only the forward pass is batched
over tasks; every gradient is taken outside ``vmap`` by ``torch.autograd`` on the batched
graph. That is what keeps second order exact with batch, layer and instance norm, whose
reverse-over-reverse batching rules under ``vmap`` are wrong (pytorch/functorch#534).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
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
# "auto" takes the loop only when it times this much faster than vmap; measured ratios are far from it
# both ways (CPU, Omniglot 32 tasks: max-pool net loop 2-2.5x faster, strided net vmap 2x faster).
LOOP_MARGIN = 1.5
_CHOICES: dict[tuple[object, ...], str] = {}  # what "auto" timed, by configuration (TaskForward.choose)
TIMED_TASKS = 16  # "auto" times at most this many tasks of its first batch (the cost grows with them, the ratio little)


def time_batchings(
    forward: TaskForward, fast: Params, consts: Params, data: Sequence[tuple[Tensor, Tensor]]
) -> dict[str, float]:
    """Seconds of forward and backward passes over ``data`` for each batching, ``{"vmap": s, "loop": s}``.

    Which is faster depends on the model, the sizes and the device, not on layer types: under
    ``vmap`` a convolution with per-task weights becomes one grouped convolution. Measured on the
    CPU (one thread, 32 Omniglot tasks, forward and backward): the reference's strided net, 5
    support and 5 query images a task, 209 + 292 ms batched against 340 + 373 ms in a loop; the
    max-pool net with 15 query images a class, 0.7 + 15.9 s batched against 0.8 + 8.0 s in a
    loop. So ``batching="auto"`` times both on the learner's first batch, support and query sets
    alike (the query set can decide, as there), on at most :data:`TIMED_TASKS` of its tasks:
    one warm-up pass (allocations, kernel choice), then the better of two.

    Args:
        fast: ``(T, *shape)`` per-task parameters.
        data: ``(x, y)`` pairs of ``(T, n, ...)`` inputs and targets, e.g. the support and query sets.
    """
    tasks = min(next(iter(data))[0].shape[0], TIMED_TASKS)
    weights = {k: v[:tasks].detach().requires_grad_() for k, v in fast.items()}
    sync = torch.cuda.synchronize if data[0][0].is_cuda else (lambda: None)
    devices = [data[0][0].device.index] if data[0][0].is_cuda else []
    seconds: dict[str, float] = {}

    with torch.random.fork_rng(devices=devices), torch.enable_grad():  # dropout draws leave the stream alone
        for batching in ("vmap", "loop"):
            times = []
            for _ in range(3):
                sync()
                began = time.perf_counter()
                for x, y in data:
                    losses, _ = forward(weights, consts, x[:tasks], y[:tasks], batching=batching)
                    torch.autograd.grad(losses.sum(), list(weights.values()))
                sync()
                times.append(time.perf_counter() - began)
            seconds[batching] = min(times[1:])
    return seconds


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
            the first batch there (:meth:`choose`; ``"vmap"`` until then).
        chunk_size: with ``"vmap"``, at most this many tasks per batched call (``None``: all).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, batching: Batching, chunk_size: int | None) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.batching = batching
        self.chunk_size = chunk_size
        self.takes_step = takes_step(model)
        self._call = Reparametrized(model)
        self._chosen: dict[torch.device, str] = {}

    def stale(self) -> bool:
        """Whether the model's structure changed since this pass mapped it (:meth:`Reparametrized.stale`)."""
        return self._call.stale()

    def refresh(self) -> None:
        """Maps the model anew, as it is now."""
        self._call.refresh()

    def resolve(self, device: torch.device) -> str:
        """The batching used for tensors on ``device``: ``"vmap"`` or ``"loop"``."""
        if self.batching != "auto":
            return self.batching
        return self._chosen.get(device, "vmap")

    def settled(self, device: torch.device) -> bool:
        """Whether ``"auto"`` has chosen a batching on ``device`` (a fixed batching always has)."""
        return self.batching != "auto" or device in self._chosen

    def use_loop(self, device: torch.device) -> None:
        """Runs the tasks on ``device`` one after another from now on (vmap cannot batch the model)."""
        self._chosen[device] = "loop"

    def choose(self, fast: Params, consts: Params, data: Sequence[tuple[Tensor, Tensor]], prefer: str = "vmap") -> None:
        """With ``"auto"``, settles the batching on the device of ``data``: the other where it is clearly faster on it.

        "Clearly": by :data:`LOOP_MARGIN` (:func:`time_batchings`); otherwise ``prefer`` (``"vmap"``;
        a memory plan prefers the loop, whose tasks hold less each), so that where the two are
        close, timing noise rarely decides. A configuration (device, model
        architecture, loss, shapes) is timed once per process: its learners batch alike and agree
        to the bit. Across processes a choice near the margin can differ (``cudnn.benchmark``'s
        caveat): an explicit ``"vmap"`` or ``"loop"`` makes two runs agree to the bit.
        """
        device = data[0][0].device
        if self.batching != "auto" or device in self._chosen or data[0][0].shape[0] == 1:
            return  # settled, or one task, which runs unbatched whatever is chosen: a larger batch decides
        # One timing per configuration and process: learners of one architecture on equal sizes batch alike.
        shapes = lambda tensors: tuple((tuple(t.shape), t.dtype) for t in tensors)  # noqa: E731
        key = (
            device,
            repr(self.model),
            getattr(self.loss_fn, "__qualname__", repr(self.loss_fn)),
            shapes(fast.values()),
            shapes(consts.values()),
            shapes(t for pair in data for t in pair),
            prefer,
        )
        if key not in _CHOICES:
            seconds = time_batchings(self, fast, consts, data)
            other = "loop" if prefer == "vmap" else "vmap"
            _CHOICES[key] = other if seconds[other] * LOOP_MARGIN < seconds[prefer] else prefer
        self._chosen[device] = _CHOICES[key]

    @property
    def chosen(self) -> dict[str, str]:
        """What ``"auto"`` settled, by device: ``{"cpu": "vmap"}``; a checkpoint keeps it, so a resumed run batches alike."""
        return {str(device): batching for device, batching in self._chosen.items()}

    @chosen.setter
    def chosen(self, chosen: dict[str, str]) -> None:
        self._chosen.update({torch.device(device): batching for device, batching in chosen.items()})

    def _one(self, fast: Params, consts: Params, x: Tensor, y: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """One task: ``x (n, *x_shape)``, ``y (n, *y_shape)`` -> loss ``()``, output ``(n, ...)``."""
        kwargs = {"step": step} if self.takes_step else None
        out = self._call({**fast, **consts}, (x,), kwargs)
        if not isinstance(out, Tensor):  # MetaOutput stacks the outputs of the tasks: one tensor each
            raise TypeError(
                f"the model returned a {type(out).__name__}; the learner needs one tensor, the output loss_fn "
                f"scores: return it alone, or wrap the model (e.g. nn.Sequential(model, Pick()) with a module "
                f"whose forward returns out[0])."
            )
        loss = self.loss_fn(out, y)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn returned {got} for one task; it must return a scalar tensor, the mean loss "
                f"over the task's examples (e.g. F.cross_entropy(out, y), or nn.MSELoss() with its "
                f"default reduction='mean')."
            )
        return loss, out

    def __call__(
        self, fast: Params, consts: Params, x: Tensor, y: Tensor, batching: str | None = None, *, step: int = 0
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
                return self._one(dict(zip(names, values)), shared, xt, yt, step)

            # randomness="different": dropout draws independent masks for every task, as a loop would.
            batched = torch.func.vmap(one, randomness="different", chunk_size=self.chunk_size)
            return batched(tuple(v.contiguous() for v in fast.values()), x, y)
        # unbind has one backward node that stacks the task gradients; indexing p[t] would
        # build T full-size zero tensors per parameter in the backward pass.
        per_task = [dict(zip(fast, values)) for values in zip(*(v.unbind(0) for v in fast.values()))]
        tasks = zip(per_task, x.unbind(0), y.unbind(0))
        losses, outs = zip(*(self._one(f, consts, xt, yt, step) for f, xt, yt in tasks))
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
