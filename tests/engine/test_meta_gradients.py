"""The engine's meta-gradients, proven in float64 against finite differences and against each other."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import CASES, finite_difference_error, flat_grad, make
from torch import Tensor
from torch.func import functional_call

import maml

# (mode, batching, chunk_size): every exact configuration.
EXACT = [
    ("second_order", "vmap", None),
    ("second_order", "vmap", 2),
    ("second_order", "loop", None),
    ("checkpointed", "vmap", None),
    ("checkpointed", "vmap", 2),
    ("checkpointed", "loop", None),
    ("checkpointed", "loop", 2),
]
EXACT_IDS = [f"{m}-{b}" + (f"-chunk{c}" if c else "") for m, b, c in EXACT]


def learner(
    case: str, steps: int, mode: str, batching: str, chunk_size: int | None = None, every: int | None = None, **kw
):
    """``chunk_size`` and ``every``: with ``mode="checkpointed"``, its tasks replayed together and segment length."""
    if mode == "checkpointed":
        mode, chunk_size = maml.Checkpointed(every=every, tasks=chunk_size), None
    model, batch, loss_fn = make(case)
    lr = 0.3 if case.startswith("conv") else 0.1
    return (
        maml.MetaLearner(
            model, loss_fn, inner_lr=lr, steps=steps, mode=mode, batching=batching, chunk_size=chunk_size, **kw
        ),
        batch,
    )


@pytest.mark.parametrize("config", EXACT, ids=EXACT_IDS)
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_meta_gradient_matches_finite_differences(case, steps, config):
    lrn, batch = learner(case, steps, *config)
    assert finite_difference_error(lrn, batch) < 1e-6


@pytest.mark.parametrize("config", EXACT, ids=EXACT_IDS)
@pytest.mark.parametrize("learn_inner_lr", ["per_parameter", "scalar"])
@pytest.mark.parametrize("case", list(CASES))
def test_learnable_inner_lr_matches_finite_differences(case, learn_inner_lr, config):
    lrn, batch = learner(case, 3, *config, learn_inner_lr=learn_inner_lr)
    # Give every rate its own value, so a mix-up between parameters cannot cancel out.
    with torch.no_grad():
        for rate in lrn.rate_parameters.values():
            rate.mul_(1 + 0.5 * torch.rand(rate.shape, generator=torch.Generator().manual_seed(3), dtype=rate.dtype))
    assert finite_difference_error(lrn, batch) < 1e-6
    grads = torch.autograd.grad(lrn.meta_loss(batch), list(lrn.rate_parameters.values()))
    assert all(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("steps,every", [(3, None), (5, 1), (5, 2), (5, 5), (4, 3)])
@pytest.mark.parametrize("case", ["mlp_batchnorm1d", "conv_batchnorm_maxpool", "conv_instancenorm"])
def test_checkpointed_equals_second_order(case, steps, every, batching):
    ref, batch = learner(case, steps, "second_order", batching, learn_inner_lr="per_parameter")
    ckpt, _ = learner(case, steps, "checkpointed", batching, learn_inner_lr="per_parameter", every=every)
    expected, got = flat_grad(ref, batch), flat_grad(ckpt, batch)
    assert torch.allclose(got, expected, rtol=0, atol=1e-10 * expected.abs().max())
    assert torch.equal(ckpt.run(batch).support_losses, ref.run(batch).support_losses)


@pytest.mark.parametrize("learn_inner_lr", ["per_parameter", "scalar", None])
@pytest.mark.parametrize("chunk_size", [1, 2])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_in_chunks_equals_second_order(case, batching, chunk_size, learn_inner_lr):
    # 3 tasks in chunks of 1 or 2 (a ragged last chunk), every norm layer the engine supports.
    ref, batch = learner(case, 4, "second_order", batching, learn_inner_lr=learn_inner_lr)
    ckpt, _ = learner(case, 4, "checkpointed", batching, chunk_size, learn_inner_lr=learn_inner_lr, every=2)
    expected, got = flat_grad(ref, batch), flat_grad(ckpt, batch)
    assert torch.allclose(got, expected, rtol=0, atol=1e-10 * expected.abs().max())
    a, b = ckpt.run(batch), ref.run(batch)
    for field in ("loss", "query_losses", "query_out", "support_losses"):
        assert torch.allclose(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14)
    for k in b.fast:
        assert torch.allclose(a.fast[k], b.fast[k], rtol=1e-12, atol=1e-14)


class SavedTensors:
    """Bytes of the distinct storages that autograd graphs hold for their backward pass: now, and at the peak."""

    def __init__(self) -> None:
        self.alive: dict[int, tuple[int, int]] = {}  # id(box) -> (storage address, bytes)
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.t)

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def live(self) -> int:
        gc.collect()
        return self._bytes()

    def _bytes(self) -> int:
        return sum(dict(self.alive.values()).values())

    def _pack(self, t: Tensor) -> _Box:
        box = _Box(t)
        self.alive[id(box)] = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        weakref.finalize(box, self.alive.pop, id(box), None)  # the graph dropped the tensor
        self.peak = max(self.peak, self._bytes())
        return box


class _Box:
    def __init__(self, t: Tensor) -> None:
        self.t = t


@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_checkpointed_keeps_only_parameter_sized_iterates(batching, chunk_size):
    # What the graph holds between the forward and the backward pass: second order keeps every
    # step's activations; the checkpointed mode keeps one fast-weight iterate per task and step
    # (and the shared initial parameters), whatever the activations weigh.
    steps = 6
    ckpt, batch = learner("conv_batchnorm_maxpool", steps, "checkpointed", batching, chunk_size)
    ref, _ = learner("conv_batchnorm_maxpool", steps, "second_order", batching)
    params = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    ckpt.meta_loss(batch).backward()  # the first call measures the plan: its probes are not the step's graph
    with SavedTensors() as saved:
        loss = ckpt.meta_loss(batch)
        kept = saved.live()
    assert kept <= (steps * batch.num_tasks + 1) * params
    with SavedTensors() as saved:
        ref.meta_loss(batch)
        assert saved.live() > 10 * kept
    loss.backward()  # the kept tensors are all the backward pass needs


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_checkpointed_recomputes_one_chunk_at_a_time(batching):
    # The most the graphs hold at once, forward and backward: with tasks=1 one task's recomputed
    # activations, not all three tasks'. By default (planned: on a default budget no probe holds more
    # than the leanest plan, so two tasks are not probed batched) one task at a time, in segments of one step.
    def peak(chunk_size: int | None, every: int | None = None) -> int:
        lrn, batch = learner("conv_batchnorm_maxpool", 4, "checkpointed", batching, chunk_size, every)
        lrn.meta_loss(batch).backward()  # the first call measures the plan: its probes are not the step's graph
        with SavedTensors() as saved:
            lrn.meta_loss(batch).backward()
        return saved.peak

    whole, one = peak(3), peak(1)
    assert one < 0.5 * whole
    assert peak(None) == peak(1, every=1)


@pytest.mark.parametrize("case", list(CASES))
def test_vmap_and_loop_agree_on_every_output(case):
    vm, batch = learner(case, 2, "second_order", "vmap")
    lp, _ = learner(case, 2, "second_order", "loop")
    a, b = vm.run(batch), lp.run(batch)
    for x, y in [
        (a.loss, b.loss),
        (a.query_losses, b.query_losses),
        (a.query_out, b.query_out),
        (a.support_losses, b.support_losses),
    ]:
        assert torch.allclose(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("case", ["mlp", "conv_batchnorm_maxpool", "mlp_layernorm"])
def test_first_order_is_the_query_gradient_at_the_fast_weights(case, batching):
    fo, batch = learner(case, 3, "first_order", batching)
    model = fo.model
    out = fo.run(batch)
    got = torch.autograd.grad(out.loss, list(model.parameters()))

    # By hand: each task's query-loss gradient at its own (constant) fast weights, averaged.
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for t in range(batch.num_tasks):
        fast = {k: v[t].detach().requires_grad_() for k, v in out.fast.items()}
        loss = fo.loss_fn(functional_call(model, fast, (batch.query_x[t],)), batch.query_y[t])
        for e, g in zip(expected, torch.autograd.grad(loss, list(fast.values()))):
            e.add_(g / batch.num_tasks)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-14)

    so, _ = learner(case, 3, "second_order", batching)
    assert (flat_grad(so, batch) - flat_grad(fo, batch)).abs().max() > 1e-3


def test_zero_steps_is_the_query_loss_at_the_initial_parameters():
    lrn, batch = learner("mlp", 0, "second_order", "vmap")
    out = lrn.run(batch)
    expected = torch.stack([lrn.loss_fn(lrn.model(x), y) for x, y in zip(batch.query_x, batch.query_y)]).mean()
    assert torch.allclose(out.loss, expected, rtol=1e-14)
    assert out.support_losses.shape == (0, batch.num_tasks)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
@pytest.mark.parametrize("config", EXACT, ids=EXACT_IDS)
def test_a_channels_last_model_has_the_same_meta_gradient(config, device):
    # channels_last is the fast layout for conv nets on the CPU; under vmap a layer cannot ask for
    # a tensor's memory format (cuDNN's batch norm does: "NYI: querying is_contiguous inside of
    # vmap"), so the engine hands the batched calls contiguous weights.
    ref, batch = learner("conv_batchnorm_maxpool", 2, *config)
    ref.model.to(device)
    batch = batch.to(device)
    expected = flat_grad(ref, batch)
    ref.model.to(memory_format=torch.channels_last)
    assert ref.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    got = flat_grad(ref, batch)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12 * expected.abs().max())


# ---------------------------------------------------------------- inputs on a graph (an encoder upstream)


def _encoded(batch: maml.TaskBatch, encoder: torch.nn.Linear) -> maml.TaskBatch:
    """The batch with its inputs passed through a trainable encoder: inputs that require grad."""
    return maml.TaskBatch(encoder(batch.support_x), batch.support_y, encoder(batch.query_x), batch.query_y)


def _mlp_by_hand(params: list[Tensor], x: Tensor) -> Tensor:
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1.T + b1) @ w2.T + b2


def _encoder_reference(
    encoder: torch.nn.Linear, model: torch.nn.Module, raw: maml.TaskBatch, *, first_order: bool
) -> list[Tensor]:
    """The gradient of the meta-loss with respect to the encoder and the model, MAML written out by hand (2 steps)."""
    enc = [p.detach().clone().requires_grad_() for p in encoder.parameters()]
    theta = [p.detach().clone().requires_grad_() for p in model.parameters()]
    losses = []
    for t in range(raw.num_tasks):
        xs, xq = (x[t] @ enc[0].T + enc[1] for x in (raw.support_x, raw.query_x))
        fast = theta
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(_mlp_by_hand(fast, xs), raw.support_y[t])
            grads = torch.autograd.grad(loss, fast, create_graph=not first_order)
            fast = [p - 0.1 * g for p, g in zip(fast, grads)]
        losses.append(torch.nn.functional.mse_loss(_mlp_by_hand(fast, xq), raw.query_y[t]))
    return list(torch.autograd.grad(torch.stack(losses).mean(), [*enc, *theta]))


def _encoder_and_model() -> tuple[torch.nn.Linear, torch.nn.Module, maml.TaskBatch]:
    torch.manual_seed(0)
    encoder = torch.nn.Linear(3, 3).double()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    g = torch.Generator().manual_seed(1)
    raw = maml.TaskBatch(*(torch.randn(3, 5, n, generator=g, dtype=torch.float64) for n in (3, 1, 3, 1)))
    return encoder, model, raw


@pytest.mark.parametrize("batching", ["vmap", "loop"])
@pytest.mark.parametrize("mode", ["second_order", "first_order"])
def test_inputs_from_an_encoder_get_the_exact_gradient(mode, batching):
    encoder, model, raw = _encoder_and_model()
    expected = _encoder_reference(encoder, model, raw, first_order=mode == "first_order")
    learner = maml.MetaLearner(model, torch.nn.functional.mse_loss, inner_lr=0.1, steps=2, mode=mode, batching=batching)
    learner.meta_loss(_encoded(raw, encoder)).backward()
    got = [p.grad for p in (*encoder.parameters(), *model.parameters())]
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=0, atol=1e-12)
    assert encoder.weight.grad.abs().max() > 1e-3  # the encoder is reached, not left at zero


@pytest.mark.parametrize(
    "options, path",
    [
        ({"mode": "checkpointed"}, "mode='checkpointed'"),
        ({"mode": maml.Checkpointed(hvp="forward_over_reverse")}, "mode='checkpointed'"),
        ({"compile": True}, "compile=True"),
        ({"mode": "reptile"}, "mode='reptile'"),
        ({"mode": "implicit"}, "mode='implicit'"),
    ],
)
def test_inputs_on_a_graph_are_refused_where_the_gradient_cannot_reach_them(options, path):
    encoder, model, raw = _encoder_and_model()
    learner = maml.MetaLearner(model, torch.nn.functional.mse_loss, inner_lr=0.1, steps=2, **options)
    with pytest.raises(ValueError, match=r"^batch\.support_x requires grad .* but " + path.replace("(", r"\(")):
        learner.meta_loss(_encoded(raw, encoder))
    with pytest.raises(ValueError, match=r"^batch\.support_x requires grad"):
        learner.backward(_encoded(raw, encoder), chunk=1)
    with torch.no_grad():  # evaluation builds no graph: nothing is lost
        learner.run(_encoded(raw, encoder))
    learner.meta_loss(raw).backward()  # detached inputs train as before
