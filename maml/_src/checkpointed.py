"""The checkpointed path: the exact meta-gradient with memory nearly flat in the number of inner steps.

The forward pass runs the inner loop for values only, step by step over every chunk of tasks,
in the order the eager path runs (so dropout draws the same masks), and keeps the fast weights
and the rule's state every ``every`` steps (``maml.Checkpointed(every=...)``), plus each step's random-number state.
The autograd graph is then one node per segment (``every`` steps of one chunk of
tasks) and one per chunk's query loss, whose gradient with respect to the last fast weights the
forward pass takes at once (the backward pass scales it by the losses' cotangents). A segment
node's backward replays its steps for values from its kept input, keeping that chunk's iterate
entering each step, then walks them backwards one step at a time, each replayed with
``create_graph=True`` under its recorded random-number state and pulled back with
``torch.autograd.grad``: peak memory is the kept iterates of every task, one segment's iterates
of one chunk and one step's activations of one chunk, instead of every step's activations of
every task.

Two levels of iterates make the peak nearly flat in the number of steps: with ``n`` steps, ``T``
tasks and chunks of ``c``, segments of ``e`` steps keep ``n T / e + e c`` iterates, fewest at
``e = sqrt(n T / c)`` (:func:`segment_steps`, the default where the learner plans nothing):
``2 sqrt(n T c)`` iterates instead of ``n T`` with ``e = 1``. But a segment replays ``e - 1`` of its
steps for values, so with ``e > 1`` each step's forward pass runs about once more than with
``e = 1``: the learner's plan (``planner.Planner``) takes the shortest segments that fit.

How a node's backward pulls the cotangents back through a step is the learner's
``maml.Checkpointed(hvp=...)``: ``"reverse_over_reverse"`` (the default) replays it with
``create_graph=True`` and differentiates the replay with ``torch.autograd.grad``, as above;
``"forward_over_reverse"`` takes the support loss's Hessian-vector products by
``torch.func.jvp`` over ``torch.func.grad`` and the update rule's Jacobian by autograd on the
rule alone (``hvp.py`` has the math and why both exist). Either way each replayed forward pass
restores its step's random-number state.

``torch.utils.checkpoint`` cannot do this: its saved-tensor hooks are not allowed under
torch.func transforms, and its reentrant variant refuses ``torch.autograd.grad``.

Every new iterate is written into a tensor allocated before the step's activations. Allocated
after them, while the activations are still alive, each kept iterate lands in the middle of the
memory those free and splits it, so the next step's activations no longer fit there and glibc's
heap grows by about one step's activations per step: a meta-training step of the Omniglot conv
net (8 tasks one at a time, 40 inner steps) peaked at 1 GiB of resident memory instead of 0.28 GiB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .batch import TaskBatch
from .forward import Params, TaskForward, exact_attention
from .hvp import HessianProducts, step_vjp, support_hvp
from .loop import (
    Adapted,
    InnerLoop,
    MetaOutput,
    Problem,
    autograd_support_grad,
    flatten_state,
    per_task,
    query_step,
    stacked,
    unflatten_state,
)
from .rules import State

__all__ = ["run", "segment_steps"]

# replay(kept inputs, other inputs) -> outputs, building the graph to differentiate
Replay = Callable[[list[Tensor], list[Tensor]], Sequence[Tensor]]
# pullback(inputs, kept outputs, cotangents of the outputs, which inputs need a cotangent)
#   -> a cotangent (or None) per input; runs in the backward pass
Pullback = Callable[[list[Tensor], list[Tensor], Sequence[Tensor], Sequence[bool]], list[Tensor | None]]
_RngState = tuple[Tensor, list[int], list[Tensor]]


def _rng_state(device: torch.device) -> _RngState:
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(state: _RngState) -> None:
    cpu, devices, cuda = state
    torch.set_rng_state(cpu)
    for device, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, device)


@contextlib.contextmanager
def _rng_forked(device: torch.device) -> Iterator[None]:
    """Leaves the global random-number state as it was, whatever the replay sets."""
    with torch.random.fork_rng(devices=_rng_state(device)[1]):
        yield


_NOT_AGAIN = (
    "mode='checkpointed' computes the meta-gradient from replayed steps, as values: it cannot be differentiated "
    "again (backward with create_graph=True, a gradient penalty, gradgradcheck); use mode='second_order', whose "
    "meta-gradient is differentiable (learner.backward(batch, chunk=1) holds one task's graph at a time)."
)


def _join(pieces: list[Tensor]) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _Segment(torch.autograd.Function):
    """Returns outputs computed already; its backward pulls the cotangents back from the inputs it keeps.

    ``keep_outputs``: how many leading outputs the pullback reads too (they are views of tensors
    kept anyway: the next segment's inputs).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, pullback: Pullback, keep_outputs: int, outputs: tuple[Tensor, ...], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.pullback, ctx.n_inputs = pullback, len(inputs)
        outs = tuple(t.detach() for t in outputs)
        ctx.save_for_backward(*inputs, *outs[:keep_outputs])
        return outs

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the pullback's cotangents are values, not functions
            raise RuntimeError(_NOT_AGAIN)
        saved = list(ctx.saved_tensors)
        grads = ctx.pullback(saved[: ctx.n_inputs], saved[ctx.n_inputs :], cotangents, ctx.needs_input_grad[3:])
        return (None, None, None, *grads)


@dataclasses.dataclass
class _Pass:
    """One checkpointed pass over a meta-batch: what its forward pass recorded, and how a node's inputs unpack.

    A segment node's inputs are the kept fast weights and state (``n_kept`` tensors), then
    ``others``: the learnable rates, then the trained parameters outside the adapt set.
    """

    loop: InnerLoop
    names: tuple[str, ...]
    parts: list[TaskBatch]  # the chunks of tasks
    bounds: list[tuple[int, int]]  # each chunk's tasks, [lo, hi)
    steps: int
    every_step: bool
    device: torch.device
    rate_keys: tuple[str, ...]
    trained: tuple[str, ...]
    plain: Params  # every const, detached
    rng: dict[tuple[str, int, int], _RngState] = dataclasses.field(default_factory=dict)  # (phase, chunk, step)

    def record_rng(self, phase: str, c: int, step: int) -> None:
        """Records the random-number state before chunk ``c``'s ``phase`` forward pass at ``step``.

        A state equal to the last one recorded (a model that draws no random numbers) is kept
        once: the CPU generator's state is 5 kB, two per chunk and step.
        """
        state, last = _rng_state(self.device), self._last_rng
        if last is not None and all(torch.equal(a, b) for a, b in zip([state[0], *state[2]], [last[0], *last[2]])):
            state = last
        self.rng[phase, c, step] = self._last_rng = state

    _last_rng: _RngState | None = None

    @property
    def forward(self) -> TaskForward:
        return self.loop.forward

    def unpack(self, other: Sequence[Tensor]) -> tuple[Params, Params]:
        """``(rate values, consts)`` from a node's other inputs."""
        return dict(zip(self.rate_keys, other)), {**self.plain, **dict(zip(self.trained, other[len(self.rate_keys) :]))}

    def chunk(self, tensors: Sequence[Tensor], c: int) -> list[Tensor]:
        """Chunk ``c``'s slices of ``(T, ...)`` tensors."""
        lo, hi = self.bounds[c]
        return [t[lo:hi] for t in tensors]

    def support_grad(self, c: int, consts: Params) -> Callable[[Params, int], tuple[Params, Tensor]]:
        """Chunk ``c``'s support gradient at given fast weights (values only), under each step's recorded random state."""
        part = self.parts[c]
        support = autograd_support_grad(self.forward, consts, part.support_at, create_graph=False)

        def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:
            _set_rng(self.rng["support", c, step])
            with torch.enable_grad():
                return support({k: v.detach().requires_grad_() for k, v in fast.items()}, step)

        return support_grad

    def entering(
        self,
        support_grad: Callable[[Params, int], tuple[Params, Tensor]],
        start: int,
        count: int,
        fast: Params,
        state: State,
        rates: Params,
    ) -> list[tuple[Params, State, Params | None]]:
        """A values-only replay of steps ``start .. start + count - 1`` from ``(fast, state)``.

        Args:
            support_grad: the chunk's :meth:`support_grad`.

        Returns:
            Per step, the fast weights and state entering it and the support gradient there
            (``None`` for the last step, whose gradient the replay does not compute).
        """
        grads: list[Params | None] = []
        visited = [(fast, state)]

        def record(fast: Params, step: int) -> tuple[Params, Tensor]:
            g, losses = support_grad(fast, step)
            grads.append(g)
            return g, losses

        def keep(step: int, fast: Params, state: State) -> tuple[Params, State]:
            visited.append((fast, state))
            return fast, state

        self.loop.unchecked().run(
            record, fast, state, rates, self.steps, start=start, stop=start + count - 1, keep=keep
        )
        return [(f, st, g) for (f, st), g in zip(visited, [*grads, None])]


def _values_pass(
    p: _Pass, params: Params, rate_values: Params, consts: Params, every: int
) -> tuple[dict[int, list[Tensor]], Adapted]:
    """The inner loop for values only, every chunk at each step in turn (the eager path's order: same dropout masks).

    Returns the iterates kept every ``every`` steps, ``step -> [fast weights, state]`` entering
    the step, all ``(T, *shape)``, and the loop's result. Records each chunk's random-number state
    before each forward pass in ``p.rng``.
    """
    names, forward = p.names, p.forward
    fast = per_task({k: v.detach() for k, v in params.items()}, sum(b.num_tasks for b in p.parts))
    state = p.loop.rule.init(fast)
    kept = {0: [*fast.values(), *flatten_state(state, names)]} if p.steps else {}
    buffers: list[Tensor] = []

    def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:
        # The new iterate's memory, before the activations (module docstring).
        buffers[:] = [torch.empty_like(t) for t in kept[0]]
        grads, losses = [], []
        for c, part in enumerate(p.parts):
            p.record_rng("support", c, step)
            leaves = {k: v.detach().requires_grad_() for k, v in zip(names, p.chunk(list(fast.values()), c))}
            g, loss = autograd_support_grad(forward, consts, part.support_at, create_graph=False)(leaves, step)
            grads.append(g)
            losses.append(loss)
        return {k: _join([g[k] for g in grads]) for k in names}, _join(losses)

    def score(fast: Params, step: int) -> Tensor:
        losses = []
        for c, part in enumerate(p.parts):
            p.record_rng("query", c, step)
            with torch.no_grad():
                chunk = dict(zip(names, p.chunk(list(fast.values()), c)))
                losses.append(forward(chunk, consts, part.query_x, part.query_y, step=step)[0])
        return _join(losses)

    def keep(step: int, fast: Params, state: State) -> tuple[Params, State]:
        out = [b.copy_(t.detach()) for b, t in zip(buffers, [*fast.values(), *flatten_state(state, names)])]
        if (step + 1) % every == 0 and step + 1 < p.steps:
            kept[step + 1] = out
        return dict(zip(names, out[: len(names)])), unflatten_state(out[len(names) :], names)

    done = p.loop.run(support_grad, fast, state, rate_values, p.steps, score=score if p.every_step else None, keep=keep)
    return kept, done


def _final_query(
    p: _Pass, fast: Params, consts: Params, grads_now: bool
) -> list[tuple[Tensor, Tensor, list[Tensor] | None]]:
    """Each chunk's query losses ``(T_c,)`` and outputs at the last fast weights, and with ``grads_now`` their gradients.

    The gradients with respect to the last fast weights are taken now, while the forward pass
    runs anyway, and the backward pass only scales them: replaying the query set would cost one
    more forward pass over it, often the larger set (75 images against 5 at 5-way 1-shot). Task
    t's loss depends on its own fast weights alone, so the gradient of the chunk's summed losses
    holds each task's own. Trained parameters outside the adapt set are shared by the tasks, so
    their per-task terms cannot be told apart in one summed gradient: then (``grads_now`` false)
    the query is replayed in the backward pass.
    """
    results = []
    for c, part in enumerate(p.parts):
        p.record_rng("query", c, p.steps)
        values = p.chunk(list(fast.values()), c)
        if grads_now:
            kept_grads = [torch.empty_like(v) for v in values]  # before the activations (module docstring)
            with torch.enable_grad():
                leaves = {k: v.detach().requires_grad_() for k, v in zip(p.names, values)}
                losses, out = p.forward(leaves, consts, part.query_x, part.query_y, step=query_step(p.steps))
                grads = torch.autograd.grad(
                    losses.sum(), list(leaves.values()), allow_unused=True, materialize_grads=True
                )
            results.append((losses.detach(), out.detach(), [k.copy_(g) for k, g in zip(kept_grads, grads)]))
        else:
            with torch.no_grad():
                fast_c = dict(zip(p.names, values))
                losses, out = p.forward(fast_c, consts, part.query_x, part.query_y, step=query_step(p.steps))
            results.append((losses, out, None))
    return results


def _by_autograd(replay: Replay, n_kept: int) -> Pullback:
    """Recomputes the outputs with a graph (``replay``), then pulls back with ``torch.autograd.grad``."""

    def pullback(
        inputs: list[Tensor], _: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
    ) -> list[Tensor | None]:
        # Kept inputs always need grad: the replayed inner steps differentiate with respect to them.
        leaves = [t.detach().requires_grad_(i < n_kept or needs[i]) for i, t in enumerate(inputs)]
        with torch.enable_grad():
            out = replay(leaves[:n_kept], leaves[n_kept:])
        wanted = [i for i, need in enumerate(needs) if need]
        # An output that does not depend on the inputs (the state of a parameter the loss never
        # reaches) has nothing to pull back.
        pairs = [(o, g) for o, g in zip(out, cotangents) if o.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True
        )
        result: list[Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, grads):
            result[i] = g
        return result

    return pullback


class _StepByStep:
    """A segment's pullback by autograd, one step at a time: values forwards, then each step replayed with a graph.

    Holds the chunk's iterate entering each step of the segment and one step's second-order
    graph, however long the segment (the module docstring).
    """

    def __init__(self, p: _Pass, c: int, start: int, count: int, n_kept: int) -> None:
        self.p, self.c, self.start, self.count, self.n_kept = p, c, start, count, n_kept

    def _entering(self, kept: list[Tensor], others: list[Tensor]) -> list[list[Tensor]]:
        """The kept tensors (fast weights, then state) entering each step of the segment, by a values-only replay."""
        p, names = self.p, self.p.names
        rates, consts = p.unpack([t.detach() for t in others])
        kept = [t.detach() for t in kept]
        fast, state = dict(zip(names, kept[: len(names)])), unflatten_state(kept[len(names) :], names)
        steps = p.entering(p.support_grad(self.c, consts), self.start, self.count, fast, state, rates)
        return [[*f.values(), *flatten_state(st, names)] for f, st, _ in steps]

    def __call__(
        self, inputs: list[Tensor], outputs: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
    ) -> list[Tensor | None]:
        p, n_kept = self.p, self.n_kept
        others = inputs[n_kept:]
        with _rng_forked(p.device), exact_attention():
            entering = self._entering(inputs[:n_kept], others) if self.count > 1 else [inputs[:n_kept]]
        cot, scores = list(cotangents[:n_kept]), cotangents[n_kept:]  # one score per step before the loop's last
        cot_others: list[Tensor | None] = [None] * len(others)
        for i in reversed(range(self.count)):
            step = self.start + i
            score = [scores[i]] if p.every_step and step < p.steps - 1 else []
            pull = _by_autograd(_replay_segment(p, self.c, step, 1), n_kept)
            # The kept tensors always get a cotangent: the earlier steps pull it further back.
            got = pull([*entering[i], *others], [], [*cot, *score], [True] * n_kept + list(needs[n_kept:]))
            cot = [torch.zeros_like(t) if g is None else g for g, t in zip(got[:n_kept], entering[i])]
            cot_others = [g if a is None else a if g is None else a + g for a, g in zip(cot_others, got[n_kept:])]
        return [*(g if need else None for g, need in zip(cot, needs)), *cot_others]


def _replay_segment(p: _Pass, c: int, start: int, count: int) -> Replay:
    """Steps ``start`` to ``start + count - 1`` of chunk ``c`` again, with a graph, each under its recorded random state."""
    part, names = p.parts[c], p.names

    def replay(kept_in: list[Tensor], other: list[Tensor]) -> list[Tensor]:
        seg_rates, seg_consts = p.unpack(other)
        support = autograd_support_grad(p.forward, seg_consts, part.support_at, create_graph=True)

        def support_grad(fast: Params, step: int) -> tuple[Params, Tensor]:
            _set_rng(p.rng["support", c, step])
            return support(fast, step)

        def score(fast: Params, step: int) -> Tensor:
            _set_rng(p.rng["query", c, step])
            return p.forward(fast, seg_consts, part.query_x, part.query_y, step=step)[0]

        fast, state = dict(zip(names, kept_in[: len(names)])), unflatten_state(kept_in[len(names) :], names)
        with _rng_forked(p.device), exact_attention():
            done = p.loop.unchecked().run(
                support_grad,
                fast,
                state,
                seg_rates,
                p.steps,
                start=start,
                stop=start + count,
                score=score if p.every_step else None,
            )
        return [*done.fast.values(), *flatten_state(done.state, names), *done.scores]

    return replay


def _replay_query(p: _Pass, c: int) -> Replay:
    """Chunk ``c``'s final query losses again, with a graph."""
    part = p.parts[c]

    def replay(kept_in: list[Tensor], other: list[Tensor]) -> list[Tensor]:
        _, seg_consts = p.unpack(other)
        with _rng_forked(p.device), exact_attention():
            _set_rng(p.rng["query", c, p.steps])
            last = query_step(p.steps)
            return [p.forward(dict(zip(p.names, kept_in)), seg_consts, part.query_x, part.query_y, step=last)[0]]

    return replay


def _scaled(grads: list[Tensor]) -> Pullback:
    """The query node's pullback from gradients taken in the forward pass: each task's, times its cotangent."""

    def pullback(
        inputs: list[Tensor], _: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
    ) -> list[Tensor | None]:
        cot = cotangents[0]  # (T_c,)
        pulled = [g * cot.view(-1, *[1] * (g.dim() - 1)) for g in grads]
        return [g if need else None for g, need in zip(pulled, needs)] + [None] * (len(inputs) - len(pulled))

    return pullback


class _ForwardOverReverse:
    """A segment's pullback without a second-order graph: values forwards, then ``step_vjp`` backwards (``hvp.py``).

    Inputs and cotangents as the segment node lays them out: kept ``(T_c, *shape)`` fast
    weights and state, then the rates and the trained consts; the outputs' cotangents are
    the new fast weights' and state's, then one ``(T_c,)`` per query score after a step.
    """

    def __init__(self, p: _Pass, c: int, start: int, count: int, n_kept: int) -> None:
        self.p, self.c, self.start, self.count, self.n_kept = p, c, start, count, n_kept
        self.part = p.parts[c]

    def _hvp(self, step: int, fixed: Params, phi: Params) -> HessianProducts:
        def products(fast: Params, tangent: Params) -> tuple[Params, Params, Params]:
            _set_rng(self.p.rng["support", self.c, step])
            x, y = self.part.support_at(step)
            return support_hvp(self.p.forward, fixed, phi, x, y, fast, tangent, step=step)

        return products

    def _score_vjp(self, step: int, fast: Params, cot: Tensor, fixed: Params, phi: Params) -> tuple[Params, Params]:
        """Pulls the ``(T_c,)`` cotangent of the query losses after ``step`` back to ``fast`` and ``phi``."""
        _set_rng(self.p.rng["query", self.c, step])
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in fast.items()}
            phi_leaves = {k: v.detach().requires_grad_() for k, v in phi.items()}
            x, y = self.part.query_x, self.part.query_y
            losses, _ = self.p.forward(leaves, {**fixed, **phi_leaves}, x, y, step=step)
            pulled = torch.autograd.grad(
                losses, [*leaves.values(), *phi_leaves.values()], cot, allow_unused=True, materialize_grads=True
            )
        n = len(self.p.names)
        return dict(zip(self.p.names, pulled[:n])), dict(zip(phi, pulled[n:]))

    def __call__(
        self, inputs: list[Tensor], outputs: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
    ) -> list[Tensor | None]:
        p, names, n_kept, n_fast = self.p, self.p.names, self.n_kept, len(self.p.names)
        start, count, loop = self.start, self.count, self.p.loop
        seg_rates, seg_consts = p.unpack([t.detach() for t in inputs[n_kept:]])
        want_rates = any(needs[n_kept : n_kept + len(p.rate_keys)])
        # The trained consts whose cotangent is wanted get the cross terms; the rest are constants.
        phi = {k: seg_consts[k] for i, k in enumerate(p.trained) if needs[n_kept + len(p.rate_keys) + i]}
        fixed = {k: v for k, v in seg_consts.items() if k not in phi}
        support_grad = p.support_grad(self.c, seg_consts)
        fast = {k: v.detach() for k, v in zip(names, inputs[:n_fast])}  # (T_c, *shape)
        state: State = unflatten_state([t.detach() for t in inputs[n_fast:n_kept]], names)
        cot_fast = dict(zip(names, cotangents[:n_fast]))
        cot_state = unflatten_state(list(cotangents[n_fast:n_kept]), names)
        score_cots = cotangents[n_kept:]  # (T_c,) after step start + i, for each such step < steps - 1
        cot_rates = {k: torch.zeros_like(v) for k, v in seg_rates.items()} if want_rates else {}
        cot_phi = {k: torch.zeros_like(v) for k, v in phi.items()}
        with _rng_forked(p.device), exact_attention():
            # Values only, through all but the last step (whose output the node kept), keeping
            # the fast weights, state and support gradient entering each step.
            entering = p.entering(support_grad, start, count, fast, state, seg_rates)
            for i in reversed(range(count)):
                step = start + i
                if p.every_step and step < p.steps - 1:  # the query score after the step, at its output
                    after = dict(zip(names, outputs)) if i == count - 1 else entering[i + 1][0]
                    from_score, phi_score = self._score_vjp(step, after, score_cots[i], fixed, phi)
                    cot_fast = {k: v + from_score[k] for k, v in cot_fast.items()}
                    cot_phi = {k: v + phi_score[k] for k, v in cot_phi.items()}
                fast_i, state_i, grads_i = entering[i]
                cot_fast, cot_state, step_rates, step_phi = step_vjp(
                    self._hvp(step, fixed, phi),
                    lambda f, step=step: support_grad(f, step)[0],
                    loop.rule,
                    loop.rates,
                    seg_rates,
                    step,
                    fast_i,
                    state_i,
                    grads_i,
                    cot_fast,
                    cot_state,
                    want_rates=want_rates,
                    unused=loop.forward.unused(step),
                )
                cot_rates = {k: v + step_rates[k] for k, v in cot_rates.items()}
                cot_phi = {k: v + step_phi[k] for k, v in cot_phi.items()}
        pulled: list[Tensor | None] = [*cot_fast.values(), *flatten_state(cot_state, names)]
        pulled += [cot_rates.get(k) for k in p.rate_keys] + [cot_phi.get(k) for k in p.trained]
        return [g if need else None for g, need in zip(pulled, needs)]


def _chunk_graph(
    p: _Pass,
    c: int,
    params: Params,
    others: list[Tensor],
    kept: dict[int, list[Tensor]],
    final_state: list[Tensor],
    scores: list[Tensor],
    final: tuple[Tensor, Tensor, list[Tensor] | None],
    every: int,
    hvp: str,
) -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """Chunk ``c``'s nodes: one per segment of ``every`` steps, then one for its query loss.

    Returns the chunk's fast weights, ``(T_c,)`` query losses and the ``(T_c,)`` query score
    after each step but the last, each on the graph back to ``params`` and ``others``.
    """
    n_fast, steps = len(p.names), p.steps
    n_kept = len(kept[0]) if steps else n_fast
    # The forward-over-reverse pullback of a segment scored after its last step reads that step's output.
    keep_outputs = n_fast if hvp == "forward_over_reverse" and p.every_step else 0
    # The initial fast weights as a view of the parameters, so that the gradient reaches them.
    inputs = [*per_task(params, p.parts[c].num_tasks).values(), *(p.chunk(kept[0], c)[n_fast:] if steps else [])]
    chunk_scores: list[Tensor] = []
    for start in range(0, steps, every):
        count = min(every, steps - start)
        end = start + count
        after = p.chunk(kept[end] if end < steps else final_state, c)
        extra = [p.chunk([scores[s]], c)[0] for s in range(start, end) if s < steps - 1] if p.every_step else []
        if hvp == "forward_over_reverse":
            pullback: Pullback = _ForwardOverReverse(p, c, start, count, n_kept)
        else:
            pullback = _StepByStep(p, c, start, count, n_kept)
        outs = _Segment.apply(pullback, keep_outputs, (*after, *extra), *inputs, *others)
        inputs, chunk_scores = list(outs[:n_kept]), chunk_scores + list(outs[n_kept:])
    losses, _, grads = final
    pull_query = _scaled(grads) if grads is not None else _by_autograd(_replay_query(p, c), n_fast)
    (loss,) = _Segment.apply(pull_query, 0, (losses,), *inputs[:n_fast], *others)
    return inputs[:n_fast], loss, chunk_scores


def segment_steps(steps: int, tasks: int, chunk: int) -> int:
    """The default ``every`` where nothing is planned: the segment length that keeps the fewest iterates (module docstring).

    ``steps`` inner steps of ``tasks`` tasks recomputed ``chunk`` at a time keep ``steps * tasks / e``
    iterates at the segments' starts and ``e * chunk`` within the segment being replayed.
    """
    return min(max(steps, 1), max(1, round(math.sqrt(steps * tasks / chunk))))


def run(
    problem: Problem,
    *,
    chunk: int,
    every: int | None,
    step_weights: Tensor | None,
    hvp: str = "reverse_over_reverse",
) -> MetaOutput:
    """The exact meta-loss with recomputation in the backward pass.

    Args:
        problem: the inner problem (``loop.Problem``); its constants that require grad
            (parameters outside the adapt set) get their exact meta-gradient.
        chunk: tasks per recomputed segment.
        every: inner steps per recomputed segment (``Checkpointed.every``); None: :func:`segment_steps`.
        step_weights: ``(steps,)`` MAML++'s multi-step loss weights, or ``None``.
        hvp: how a segment's backward differentiates its steps (``Checkpointed.hvp``, see ``hvp.py``).
    """
    loop, params, rate_values, consts, batch, steps = problem
    assert hvp in ("reverse_over_reverse", "forward_over_reverse"), hvp
    names, tasks = tuple(params), batch.num_tasks
    trained = tuple(k for k, v in consts.items() if v.requires_grad)
    others = [*rate_values.values(), *(consts[k] for k in trained)]
    bounds = [(lo, min(lo + chunk, tasks)) for lo in range(0, tasks, chunk)]
    every = segment_steps(steps, tasks, chunk) if every is None else every
    p = _Pass(
        loop=loop,
        names=names,
        parts=[batch[lo:hi] for lo, hi in bounds],
        bounds=bounds,
        steps=steps,
        every_step=step_weights is not None,
        device=batch.support_x.device,
        rate_keys=tuple(rate_values),
        trained=trained,
        plain={k: v.detach() for k, v in consts.items()},
    )
    r_values, r_consts = p.unpack([o.detach() for o in others])
    kept, done = _values_pass(p, params, r_values, r_consts, every)
    final_state = [*done.fast.values(), *flatten_state(done.state, names)]
    # Without grad mode (evaluation) nothing is taken now (see _final_query).
    grads_now = torch.is_grad_enabled() and not trained and any(v.requires_grad for v in params.values())
    final = _final_query(p, done.fast, r_consts, grads_now)

    # ---- the graph: per chunk, one node per segment, then one for the query loss
    chunks = [
        _chunk_graph(p, c, params, others, kept, final_state, done.scores, final[c], every, hvp)
        for c in range(len(p.parts))
    ]
    fast_parts, query_parts, score_parts = zip(*chunks)
    query_losses = torch.cat(query_parts)
    per_step = None
    if p.every_step:
        per_step = torch.stack([*(torch.cat([s[i] for s in score_parts]) for i in range(steps - 1)), query_losses])
    return MetaOutput.of(
        query_losses,
        torch.cat([out for _, out, _ in final]),
        stacked(done.support_losses, tasks, batch.support_x),
        {k: torch.cat([f[i] for f in fast_parts]) for i, k in enumerate(names)},
        per_step,
        step_weights,
    )
