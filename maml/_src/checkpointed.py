"""The checkpointed path: the exact meta-gradient with memory nearly flat in the number of inner steps.

The forward pass runs the inner loop for values only, step by step over every chunk of tasks,
in the order the eager path runs (so dropout draws the same masks), and keeps the fast weights
and the rule's state every ``checkpoint_every`` steps, plus each step's random-number state.
The autograd graph is then one node per segment (``checkpoint_every`` steps of one chunk of
tasks) and one per chunk's query loss. A node's backward replays its steps with
``create_graph=True`` from its kept input, each step under its recorded random-number state,
and pulls the cotangents back with ``torch.autograd.grad``: peak memory is the kept iterates
plus one segment of one chunk's activations, instead of every step's activations of every task.

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
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .batch import TaskBatch
from .inner import Params, exact_attention
from .loop import InnerLoop, Trace, flatten_state, unflatten_state
from .step import autograd_support_grad, inner_step

__all__ = ["run"]

# replay(kept inputs, other inputs) -> outputs, building the second-order graph
Replay = Callable[[list[Tensor], list[Tensor]], Sequence[Tensor]]
_RngState = tuple[Tensor, list[int], list[Tensor]]


def _rng_state(device: torch.device) -> _RngState:
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
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


class _Segment(torch.autograd.Function):
    """Returns outputs computed already; its backward recomputes them from the inputs it keeps."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, replay: Replay, n_kept: int, outputs: tuple[Tensor, ...], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.replay, ctx.n_kept = replay, n_kept
        ctx.save_for_backward(*inputs)
        return tuple(t.detach() for t in outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *cotangents: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        needs = ctx.needs_input_grad[3:]
        # Kept inputs always need grad: the replayed inner steps differentiate with respect to them.
        inputs = [t.detach().requires_grad_(i < ctx.n_kept or needs[i]) for i, t in enumerate(ctx.saved_tensors)]
        with torch.enable_grad():
            out = ctx.replay(inputs[: ctx.n_kept], inputs[ctx.n_kept :])
        wanted = [i for i, need in enumerate(needs) if need]
        # An output that does not depend on the inputs (the state of a parameter the loss never
        # reaches) has nothing to pull back.
        pairs = [(o, g) for o, g in zip(out, cotangents) if o.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs], allow_unused=True
        )
        result: list[Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, None, None, *result)


def run(
    loop: InnerLoop,
    params: Params,
    rate_values: Params,
    consts: Params,
    batch: TaskBatch,
    steps: int,
    *,
    chunk: int,
    every: int,
    every_step: bool,
) -> Trace:
    """The exact meta-loss's pieces with recomputation in the backward pass.

    Args:
        loop: the learner's inner loop.
        params: the adapted parameters' initial values (no task dimension).
        rate_values: the learnable rates.
        consts: shared parameters and buffers; those that require grad (parameters outside the
            adapt set) get their exact meta-gradient.
        batch: ``T`` tasks.
        steps: inner steps.
        chunk: tasks per recomputed segment.
        every: inner steps per recomputed segment (``checkpoint_every``).
        every_step: also score the query set after every step (the multi-step loss).
    """
    names = tuple(params)
    tasks = batch.num_tasks
    device = batch.support_x.device
    forward, rule, rates = loop.forward, loop.rule, loop.rates
    rate_keys = tuple(rate_values)
    trained = tuple(k for k, v in consts.items() if v.requires_grad)
    others = [*rate_values.values(), *(consts[k] for k in trained)]
    plain = {k: v.detach() for k, v in consts.items()}
    starts = range(0, tasks, chunk)
    parts = [batch[lo : lo + chunk] for lo in starts]

    def unpack(other: Sequence[Tensor]) -> tuple[Params, Params]:
        """``(rate values, consts)`` from a node's other inputs."""
        return dict(zip(rate_keys, other)), {**plain, **dict(zip(trained, other[len(rate_keys) :]))}

    # ---- values only, step by step over every chunk, in the eager path's order
    values = [{k: p.detach().unsqueeze(0).expand(part.num_tasks, *p.shape) for k, p in params.items()} for part in parts]
    states = [rule.init(v) for v in values]
    kept: dict[tuple[int, int], list[Tensor]] = {}  # (chunk, step) -> fast weights and state entering the step
    rng: dict[tuple[str, int, int], _RngState] = {}  # (phase, chunk, step) -> random state before it
    r_values, r_consts = unpack([o.detach() for o in others])
    support_losses, step_query = [], []
    for step in range(steps):
        step_rates = rates.at(r_values, step)
        losses = []
        for c, part in enumerate(parts):
            if step % every == 0:
                kept[c, step] = [*values[c].values(), *flatten_state(states[c], names)]
            rng["support", c, step] = _rng_state(device)
            fast = {k: v.detach().requires_grad_() for k, v in values[c].items()}
            flat = flatten_state(states[c], names)
            out = [torch.empty_like(t) for t in [*fast.values(), *flat]]  # before the activations
            support_grad = autograd_support_grad(forward, r_consts, part.support_x, part.support_y, create_graph=False)
            new, state, loss = inner_step(support_grad, rule, fast, states[c], step_rates, step)
            out = [o.copy_(t.detach()) for o, t in zip(out, [*new.values(), *flatten_state(state, names)])]
            values[c], states[c] = dict(zip(names, out[: len(names)])), unflatten_state(out[len(names) :], names)
            losses.append(loss)
        losses = torch.cat(losses)
        if loop.check is not None:  # once every chunk took the step, so that the task index is the batch's
            loop.check(losses, step, steps)
        support_losses.append(losses)
        if every_step and step < steps - 1:
            per_chunk = []
            for c, part in enumerate(parts):
                rng["query", c, step] = _rng_state(device)
                with torch.no_grad():
                    per_chunk.append(forward(values[c], r_consts, part.query_x, part.query_y)[0])
            step_query.append(per_chunk)
    final_query = []
    for c, part in enumerate(parts):
        rng["query", c, steps] = _rng_state(device)
        with torch.no_grad():
            final_query.append(forward(values[c], r_consts, part.query_x, part.query_y))

    # ---- the graph: per chunk, one node per segment, then one for the query loss
    def segment(c: int, start: int, count: int) -> Replay:
        part = parts[c]

        def replay(kept_in: list[Tensor], other: list[Tensor]) -> list[Tensor]:
            seg_rates, seg_consts = unpack(other)
            fast = dict(zip(names, kept_in[: len(names)]))
            state = unflatten_state(kept_in[len(names) :], names)
            scores = []
            with _rng_forked(device), exact_attention():
                for step in range(start, start + count):
                    _set_rng(rng["support", c, step])
                    support_grad = autograd_support_grad(forward, seg_consts, part.support_x, part.support_y, create_graph=True)
                    fast, state, _ = inner_step(support_grad, rule, fast, state, rates.at(seg_rates, step), step)
                    if every_step and step < steps - 1:
                        _set_rng(rng["query", c, step])
                        scores.append(forward(fast, seg_consts, part.query_x, part.query_y)[0])
            return [*fast.values(), *flatten_state(state, names), *scores]

        return replay

    def query(c: int) -> Replay:
        part = parts[c]

        def replay(kept_in: list[Tensor], other: list[Tensor]) -> list[Tensor]:
            _, seg_consts = unpack(other)
            with _rng_forked(device), exact_attention():
                _set_rng(rng["query", c, steps])
                return [forward(dict(zip(names, kept_in)), seg_consts, part.query_x, part.query_y)[0]]

        return replay

    fast_parts, query_parts, score_parts = [], [], []
    n_kept = len(kept[0, 0]) if steps else len(names)
    for c, part in enumerate(parts):
        # The initial fast weights as a view of the parameters, so that the gradient reaches them.
        inputs = [*(p.unsqueeze(0).expand(part.num_tasks, *p.shape) for p in params.values())]
        inputs += kept[c, 0][len(names) :] if steps else []
        scores: list[Tensor] = []
        for start in range(0, steps, every):
            count = min(every, steps - start)
            end = start + count
            after = kept[c, end] if end < steps else [*values[c].values(), *flatten_state(states[c], names)]
            extra = [step_query[s][c] for s in range(start, end) if s < steps - 1] if every_step else []
            outs = _Segment.apply(segment(c, start, count), n_kept, (*after, *extra), *inputs, *others)
            inputs, scores = list(outs[:n_kept]), scores + list(outs[n_kept:])
        fast = inputs[: len(names)]
        (loss,) = _Segment.apply(query(c), len(names), (final_query[c][0],), *fast, *others)
        fast_parts.append(fast)
        query_parts.append(loss)
        score_parts.append(scores)
    return Trace(
        query_losses=torch.cat(query_parts),
        query_out=torch.cat([out for _, out in final_query]),
        support_losses=torch.stack(support_losses) if support_losses else batch.support_x.new_zeros((0, tasks), dtype=torch.float32),
        fast={k: torch.cat([f[i] for f in fast_parts]) for i, k in enumerate(names)},
        step_query_losses=(
            torch.stack([*(torch.cat([s[i] for s in score_parts]) for i in range(steps - 1)), torch.cat(query_parts)])
            if every_step
            else None
        ),
    )
