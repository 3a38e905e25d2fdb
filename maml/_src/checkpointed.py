"""The checkpointed path: the exact meta-gradient with memory nearly flat in the number of inner steps.

The forward pass runs the inner loop for values only, step by step over every chunk of tasks,
in the order the eager path runs (so dropout draws the same masks), and keeps the fast weights
and the rule's state every ``checkpoint_every`` steps, plus each step's random-number state.
The autograd graph is then one node per segment (``checkpoint_every`` steps of one chunk of
tasks) and one per chunk's query loss, whose gradient with respect to the last fast weights the
forward pass takes at once (the backward pass scales it by the losses' cotangents). A segment
node's backward replays its steps with ``create_graph=True`` from its kept input, each step under its recorded random-number state,
and pulls the cotangents back with ``torch.autograd.grad``: peak memory is the kept iterates
plus one segment of one chunk's activations, instead of every step's activations of every task.

How a node's backward pulls the cotangents back through its steps is the learner's
``checkpoint_hvp``: ``"reverse_over_reverse"`` (the default) replays them with
``create_graph=True`` and differentiates the replay with ``torch.autograd.grad``, as above;
``"forward_over_reverse"`` replays them for values only and walks them backwards one step at a
time, the support loss's Hessian-vector products by ``torch.func.jvp`` over ``torch.func.grad``
and the update rule's Jacobian by autograd on the rule alone (``mixed.py`` has the math and why
both exist). Either way each replayed forward pass restores its step's random-number state.

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
from .mixed import CHECKPOINT_HVPS, HessianProducts, step_vjp, support_hvp
from .rules import State
from .step import autograd_support_grad, inner_step

__all__ = ["run"]

# replay(kept inputs, other inputs) -> outputs, building the graph to differentiate
Replay = Callable[[list[Tensor], list[Tensor]], Sequence[Tensor]]
# pullback(inputs, kept outputs, cotangents of the outputs, which inputs need a cotangent)
#   -> a cotangent (or None) per input; runs in the backward pass
Pullback = Callable[[list[Tensor], list[Tensor], Sequence[Tensor], Sequence[bool]], list[Tensor | None]]
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
    """Returns outputs computed already; its backward pulls the cotangents back from the inputs it keeps.

    ``keep_outputs``: how many leading outputs the pullback reads too (they are views of tensors
    kept anyway: the next segment's inputs).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, pullback: Pullback, keep_outputs: int, outputs: tuple[Tensor, ...], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.pullback, ctx.n_inputs = pullback, len(inputs)
        outs = tuple(t.detach() for t in outputs)
        ctx.save_for_backward(*inputs, *outs[:keep_outputs])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *cotangents: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        grads = ctx.pullback(saved[: ctx.n_inputs], saved[ctx.n_inputs :], cotangents, ctx.needs_input_grad[3:])
        return (None, None, None, *grads)


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
    hvp: str = "reverse_over_reverse",
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
        hvp: how a segment's backward differentiates its steps (``checkpoint_hvp``, see ``mixed.py``).
    """
    assert hvp in CHECKPOINT_HVPS, hvp
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
    # The final query losses' gradients with respect to the last fast weights are taken now, while
    # their forward pass runs anyway, and the backward pass only scales them: replaying the query set
    # would cost one more forward pass over it, often the larger set (75 images against 5 at 5-way
    # 1-shot). Task t's loss depends on its own fast weights alone, so the gradient of the chunk's
    # summed losses holds each task's own. Trained parameters outside the adapt set are shared by the
    # tasks, so their per-task terms cannot be told apart in one summed gradient: then the query is
    # replayed in the backward pass as before. Without grad mode (evaluation) nothing is taken.
    final_query, query_grads = [], []
    query_now = torch.is_grad_enabled() and not trained and any(p.requires_grad for p in params.values())
    for c, part in enumerate(parts):
        rng["query", c, steps] = _rng_state(device)
        if query_now:
            kept_grads = [torch.empty_like(v) for v in values[c].values()]  # before the activations (module docstring)
            with torch.enable_grad():
                leaves = {k: v.detach().requires_grad_() for k, v in values[c].items()}
                losses, out = forward(leaves, r_consts, part.query_x, part.query_y)
                grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True, materialize_grads=True)
            final_query.append((losses.detach(), out.detach()))
            query_grads.append([k.copy_(g) for k, g in zip(kept_grads, grads)])
        else:
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

    def scaled(grads: list[Tensor]) -> Pullback:
        """The query node's pullback from gradients taken in the forward pass: each task's, times its cotangent."""

        def pullback(
            inputs: list[Tensor], _: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
        ) -> list[Tensor | None]:
            cot = cotangents[0]  # (T_c,)
            pulled = [g * cot.view(-1, *[1] * (g.dim() - 1)) for g in grads]
            return [g if need else None for g, need in zip(pulled, needs)] + [None] * (len(inputs) - len(pulled))

        return pullback

    n_kept = len(kept[0, 0]) if steps else len(names)
    n_fast = len(names)

    def forward_over_reverse(c: int, start: int, count: int) -> Pullback:
        """The segment's pullback without a second-order graph: values forwards, then ``step_vjp`` backwards.

        Inputs and cotangents as the segment node lays them out: kept ``(T_c, *shape)`` fast
        weights and state, then the rates and the trained consts; the outputs' cotangents are
        the new fast weights' and state's, then one ``(T_c,)`` per query score after a step.
        """
        part = parts[c]
        end = start + count

        def pullback(
            inputs: list[Tensor], outputs: list[Tensor], cotangents: Sequence[Tensor], needs: Sequence[bool]
        ) -> list[Tensor | None]:
            seg_rates, seg_consts = unpack([t.detach() for t in inputs[n_kept:]])
            want_rates = any(needs[n_kept : n_kept + len(rate_keys)])
            # The trained consts whose cotangent is wanted get the cross terms; the rest are constants.
            phi = {k: seg_consts[k] for i, k in enumerate(trained) if needs[n_kept + len(rate_keys) + i]}
            fixed = {k: v for k, v in seg_consts.items() if k not in phi}

            def hvp_at(step: int) -> HessianProducts:
                def products(fast: Params, tangent: Params) -> tuple[Params, Params, Params]:
                    _set_rng(rng["support", c, step])
                    return support_hvp(forward, fixed, phi, part.support_x, part.support_y, fast, tangent)

                return products

            def grad_at(step: int) -> Callable[[Params], Params]:
                def grad(fast: Params) -> Params:
                    _set_rng(rng["support", c, step])
                    leaves = {k: v.detach().requires_grad_() for k, v in fast.items()}
                    support_grad = autograd_support_grad(forward, seg_consts, part.support_x, part.support_y, create_graph=False)
                    with torch.enable_grad():
                        return support_grad(leaves)[0]

                return grad

            def score_vjp(step: int, fast: Params, cot: Tensor) -> tuple[Params, Params]:
                """Pulls the ``(T_c,)`` cotangent of the query losses after ``step`` back to ``fast`` and ``phi``."""
                _set_rng(rng["query", c, step])
                with torch.enable_grad():
                    leaves = {k: v.detach().requires_grad_() for k, v in fast.items()}
                    phi_leaves = {k: v.detach().requires_grad_() for k, v in phi.items()}
                    losses, _ = forward(leaves, {**fixed, **phi_leaves}, part.query_x, part.query_y)
                    pulled = torch.autograd.grad(
                        losses, [*leaves.values(), *phi_leaves.values()], cot, allow_unused=True, materialize_grads=True
                    )
                return dict(zip(names, pulled[:n_fast])), dict(zip(phi, pulled[n_fast:]))

            fast = {k: v.detach() for k, v in zip(names, inputs[:n_fast])}  # (T_c, *shape)
            state: State = unflatten_state([t.detach() for t in inputs[n_fast:n_kept]], names)
            # (fast weights, state, support gradient or None) entering each step of the segment
            entering: list[tuple[Params, State, Params | None]] = []
            cot_fast = dict(zip(names, cotangents[:n_fast]))
            cot_state = unflatten_state(list(cotangents[n_fast:n_kept]), names)
            score_cots = cotangents[n_kept:]  # (T_c,) after step start + i, for each such step < steps - 1
            cot_rates = {k: torch.zeros_like(v) for k, v in seg_rates.items()} if want_rates else {}
            cot_phi = {k: torch.zeros_like(v) for k, v in phi.items()}
            with _rng_forked(device), exact_attention():
                for step in range(start, end):  # values only; the last step's output is the node's
                    grads = grad_at(step)(fast) if step < end - 1 else None
                    entering.append((fast, state, grads))
                    if grads is not None:
                        with torch.no_grad():
                            fast, state = rule.update(grads, state, fast, step, rates.at(seg_rates, step))
                for i in reversed(range(count)):
                    step = start + i
                    if every_step and step < steps - 1:  # the query score after the step, at its output
                        after = dict(zip(names, outputs)) if i == count - 1 else entering[i + 1][0]
                        from_score, phi_score = score_vjp(step, after, score_cots[i])
                        cot_fast = {k: v + from_score[k] for k, v in cot_fast.items()}
                        cot_phi = {k: v + phi_score[k] for k, v in cot_phi.items()}
                    fast_i, state_i, grads_i = entering[i]
                    cot_fast, cot_state, step_rates, step_phi = step_vjp(
                        hvp_at(step), grad_at(step), rule, rates, seg_rates, step, fast_i, state_i, grads_i,
                        cot_fast, cot_state, want_rates=want_rates,
                    )  # fmt: skip
                    cot_rates = {k: v + step_rates[k] for k, v in cot_rates.items()}
                    cot_phi = {k: v + step_phi[k] for k, v in cot_phi.items()}
            pulled: list[Tensor | None] = [*cot_fast.values(), *flatten_state(cot_state, names)]
            pulled += [cot_rates.get(k) for k in rate_keys] + [cot_phi.get(k) for k in trained]
            return [g if need else None for g, need in zip(pulled, needs)]

        return pullback

    def pullback(c: int, start: int, count: int) -> Pullback:
        if hvp == "forward_over_reverse":
            return forward_over_reverse(c, start, count)
        return _by_autograd(segment(c, start, count), n_kept)

    # The forward-over-reverse pullback of a segment scored after its last step reads that step's output.
    keep = n_fast if hvp == "forward_over_reverse" and every_step else 0
    fast_parts, query_parts, score_parts = [], [], []
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
            outs = _Segment.apply(pullback(c, start, count), keep, (*after, *extra), *inputs, *others)
            inputs, scores = list(outs[:n_kept]), scores + list(outs[n_kept:])
        fast = inputs[:n_fast]
        pull_query = scaled(query_grads[c]) if query_now else _by_autograd(query(c), n_fast)
        (loss,) = _Segment.apply(pull_query, 0, (final_query[c][0],), *fast, *others)
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
