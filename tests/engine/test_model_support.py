"""Models a researcher brings: recurrent layers, attention, modules with state, weight_norm, dropout.

Each model either gets the exact meta-gradient (float64, against central finite differences and
across modes) or an error or warning that says what happened and what to do.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import finite_difference_error, flat_grad
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import maml

DTYPE = torch.float64


def raises(exc: type[Exception], text: str):
    return pytest.raises(exc, match=re.escape(text))


def batch_of(x_shape: tuple[int, ...], tasks: int = 3, n: int = 4, seed: int = 1) -> maml.TaskBatch:
    """``tasks`` regression tasks with ``n`` examples of shape ``x_shape`` in each split."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(tasks, n, *shape, generator=g, dtype=DTYPE)

    return maml.TaskBatch(draw(*x_shape), draw(1), draw(*x_shape), draw(1))


def built(module: Callable[..., nn.Module], *args: object) -> nn.Module:
    """``module(*args)`` in float64, initialised from seed 0."""
    torch.manual_seed(0)
    return module(*args).to(DTYPE)


def assert_close(got: Tensor, expected: Tensor) -> None:
    assert torch.allclose(got, expected, rtol=0, atol=1e-10 * expected.abs().max())


# ---------------------------------------------------------------- recurrent layers


class Recurrent(nn.Module):
    """A recurrent layer over sequences ``(n, 5, 2)``, read out at the last step."""

    def __init__(self, layer: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = layer(2, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize("mode", ["second_order", "checkpointed"])
@pytest.mark.parametrize("layer", [nn.GRU, nn.LSTM, nn.RNN])
def test_auto_batching_runs_a_recurrent_model_in_a_loop_exactly(layer, mode):
    # vmap has no batching rule for the fused recurrent kernels (aten::gru.input, ...).
    learner = maml.MetaLearner(built(Recurrent, layer), F.mse_loss, inner_lr=0.3, steps=2, mode=mode)
    assert finite_difference_error(learner, batch_of((5, 2))) < 1e-6
    assert learner.resolved_batching == "loop"


def test_vmap_asked_for_on_a_recurrent_model_says_to_use_the_loop():
    learner = maml.MetaLearner(built(Recurrent, nn.GRU), F.mse_loss, inner_lr=0.3, batching="vmap")
    with raises(
        ValueError,
        "batching='vmap' cannot batch GRU 'rnn' over the tasks: PyTorch's vmap has no rule for an "
        "operator of its forward pass. Use batching='loop', or batching='auto', which picks the loop "
        "for such a model. (PyTorch: Batching rule not implemented for aten::gru.input",
    ):
        learner.meta_loss(batch_of((5, 2)))


class ItemScale(nn.Module):
    """Scales by a Python number read with ``.item()``, which vmap cannot batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) / (1 + x.detach().abs().max().item())


def test_auto_batching_falls_back_to_the_loop_for_any_operator_vmap_cannot_batch():
    learner = maml.MetaLearner(built(ItemScale), F.mse_loss, inner_lr=0.3, steps=2)
    assert learner.resolved_batching == "vmap"  # nothing tells before the first call
    assert finite_difference_error(learner, batch_of((3,))) < 1e-6
    assert learner.resolved_batching == "loop"
    vmap = maml.MetaLearner(built(ItemScale), F.mse_loss, inner_lr=0.3, batching="vmap")
    with raises(ValueError, "batching='vmap' cannot batch ItemScale '' over the tasks: PyTorch's vmap has no rule"):
        vmap.meta_loss(batch_of((3,)))


# ---------------------------------------------------------------- attention


class Attention(nn.Module):
    """Self-attention over sequences ``(n, 5, 2)`` by ``nn.MultiheadAttention`` without weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        a, _ = self.attention(h, h, h, need_weights=False)
        return self.head((h + a).mean(-2))


class ScaledDotProduct(nn.Module):
    """Self-attention over sequences ``(n, 5, 2)`` by ``F.scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(2, 12)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(-2))


BATCHINGS = [("vmap", None), ("vmap", 2), ("loop", None)]


@pytest.mark.parametrize("batching, chunk_size", BATCHINGS, ids=["vmap", "vmap-chunk2", "loop"])
@pytest.mark.parametrize("model", [Attention, ScaledDotProduct])
def test_attention_is_exact_in_the_exact_modes(model, batching, chunk_size):
    # The fused CPU kernel has no double backward; the exact modes run the inner steps on the math kernel.
    batch = batch_of((5, 2))
    kw = {"inner_lr": 0.3, "steps": 3, "batching": batching}
    second = maml.MetaLearner(built(model), F.mse_loss, mode="second_order", chunk_size=chunk_size, **kw)
    assert finite_difference_error(second, batch) < 1e-6
    ckpt = maml.MetaLearner(second.model, F.mse_loss, mode=maml.Checkpointed(every=2, tasks=chunk_size or 1), **kw)
    assert_close(flat_grad(ckpt, batch), flat_grad(second, batch))  # so exact too


def test_attention_is_exact_compiled(monkeypatch):
    # The fused kernel's missing double backward stops dynamo's tracing, before any backend runs; the
    # aot_eager backend traces the same graph without inductor's C++ build (50 s on 2 cores here).
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_with(fn, **{**kw, "backend": "aot_eager"}))
    batch = batch_of((5, 2))
    eager = maml.MetaLearner(built(ScaledDotProduct), F.mse_loss, inner_lr=0.3, batching="vmap")
    compiled = maml.MetaLearner(eager.model, F.mse_loss, inner_lr=0.3, batching="vmap", compile=True)
    assert_close(flat_grad(compiled, batch), flat_grad(eager, batch))


# ---------------------------------------------------------------- modules that write their own state


def spectral_mlp() -> nn.Module:
    return nn.Sequential(spectral_norm(nn.Linear(3, 8)), nn.Tanh(), nn.Linear(8, 1))


SPECTRAL_NORM_MESSAGE = (
    "_SpectralNorm '0.parametrizations.weight.0' writes its buffers '_u', '_v' in place in its forward "
    "pass (in training mode): every inner step of every task would overwrite them with that task's fast "
    "weights, so results would depend on the order of the tasks and calls (and vmap cannot batch the "
    "writes). Call model.eval() if the module leaves its state alone in eval mode (spectral_norm does), "
    "or stop it from writing its state in the forward pass (a parametrization comes off with "
    "torch.nn.utils.parametrize.remove_parametrizations)."
)


@pytest.mark.parametrize("mode", maml.MODES)
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_spectral_norm_in_training_mode_is_refused(batching, mode):
    model = built(spectral_mlp)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, mode=mode, batching=batching)
    batch = batch_of((3,))
    with raises(ValueError, SPECTRAL_NORM_MESSAGE):
        learner.meta_loss(batch)
    with raises(ValueError, SPECTRAL_NORM_MESSAGE):
        learner.adapt(batch.support_x[0], batch.support_y[0])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was written


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_spectral_norm_in_eval_mode_is_exact(batching):
    batch = batch_of((3,))
    learner = maml.MetaLearner(built(spectral_mlp).eval(), F.mse_loss, inner_lr=0.3, steps=2, batching=batching)
    assert finite_difference_error(learner, batch) < 1e-6
    assert torch.equal(learner.meta_loss(batch), learner.meta_loss(batch))
    learner.model.train()  # the mode is checked on every call
    with raises(ValueError, SPECTRAL_NORM_MESSAGE):
        learner.meta_loss(batch)


class Counter(nn.Module):
    """Counts its calls in a buffer, in every mode."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(1)
        return self.linear(x)


def test_any_module_that_writes_a_buffer_is_refused():
    model = nn.Sequential(built(Counter)).eval()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3)
    with raises(
        ValueError,
        "Counter '0' writes its buffer 'calls' in place in its forward pass (in eval mode): every inner "
        "step of every task would overwrite it with that task's fast weights, so results would depend on "
        "the order of the tasks and calls (and vmap cannot batch the writes). Stop it from writing its "
        "state in the forward pass (a parametrization comes off with "
        "torch.nn.utils.parametrize.remove_parametrizations).",
    ):
        learner.meta_loss(batch_of((3,)))
    assert model[0].calls == 0


# ---------------------------------------------------------------- weight_norm


def weight_norm_mlp() -> nn.Module:
    return nn.Sequential(weight_norm(nn.Linear(3, 8)), nn.Tanh(), nn.Linear(8, 1))


def hooked_weight_norm_mlp() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), torch.nn.utils.weight_norm(nn.Linear(8, 1)))


WEIGHT_NORM_WARNING = (
    "weight_norm normalizes the 'weight' of {module}, but PyTorch's second derivative of it is wrong "
    "(torch._weight_norm fails torch.autograd.gradgradcheck), so mode={mode!r} gives inexact "
    "meta-gradients through it. Use mode='first_order', or write the norm in plain torch ops, e.g. "
    "weight = g * v / v.norm(dim=1, keepdim=True) for a Linear layer, which are exact."
)


@pytest.mark.parametrize("mode", ["second_order", "checkpointed"])
@pytest.mark.parametrize("build, module", [(weight_norm_mlp, "Linear '0'"), (hooked_weight_norm_mlp, "Linear '2'")])
def test_weight_norm_in_an_exact_mode_warns(build, module, mode):
    model = built(build)
    with pytest.warns(UserWarning, match=re.escape(WEIGHT_NORM_WARNING.format(module=module, mode=mode))):
        maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, mode="first_order")
    with pytest.warns(UserWarning, match=re.escape(WEIGHT_NORM_WARNING.format(module=module, mode=mode))):
        learner.mode = mode  # set on a live learner, as built with it


class HandWeightNorm(nn.Module):
    """A weight-normalized linear layer in plain torch ops, what the warning suggests."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(8, 3))
        self.g = nn.Parameter(torch.rand(8, 1) + 0.5)
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.bias)


def test_weight_norm_written_by_hand_is_exact():
    model = built(lambda: nn.Sequential(HandWeightNorm(), nn.Tanh(), nn.Linear(8, 1)))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, steps=2)
    assert finite_difference_error(learner, batch_of((3,))) < 1e-6


# ---------------------------------------------------------------- dropout


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("batching, chunk_size", [("vmap", 1), ("vmap", 2), ("loop", 1), ("loop", 2)])
def test_checkpointed_draws_the_dropout_masks_of_second_order(batching, chunk_size, every):
    # Several chunks and several steps per segment: every task and step draws its mask in second order's order.
    batch = batch_of((3,))
    model = built(dropout_mlp)
    kw = {"inner_lr": 0.3, "steps": 3, "batching": batching}
    second = maml.MetaLearner(model, F.mse_loss, chunk_size=chunk_size if batching == "vmap" else None, **kw)
    ckpt = maml.MetaLearner(model, F.mse_loss, mode=maml.Checkpointed(every=every, tasks=chunk_size), **kw)

    def run(learner: maml.MetaLearner) -> tuple[maml.MetaOutput, Tensor]:
        torch.manual_seed(5)
        out = learner.run(batch)
        grads = torch.autograd.grad(out.loss, list(learner.parameters()))
        return out, torch.cat([g.flatten() for g in grads])

    (a, got), (b, expected) = run(ckpt), run(second)
    assert_close(got, expected)
    for field in ("loss", "query_losses", "query_out", "support_losses"):
        assert torch.allclose(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14)
    torch.manual_seed(6)
    assert not torch.equal(second.run(batch).loss, b.loss)  # other masks, another loss: a mix-up would show
    # The first call's look at the model (model_check.py) draws nothing from the stream: a later call is the same.
    assert torch.equal(run(ckpt)[1], got)


# ---------------------------------------------------------------- what the engine can tell


def test_adapt_given_a_whole_batch_says_so():
    batch = batch_of((3,))
    model = built(lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3)
    learner.meta_loss(batch)  # the learner sees examples shaped (3,)
    with raises(
        ValueError,
        "support_x has shape (3, 4, 3): a batch of 3 tasks of 4 examples shaped (3,), the shape of the "
        "examples this learner saw before, but adapt takes one task, (n, *x_shape). Pass one task "
        "(support_x[t], support_y[t]), or use learner.run(maml.TaskBatch(...)) for every task.",
    ):
        learner.adapt(batch.support_x, batch.support_y)
    fast = learner.adapt(batch.support_x[0], batch.support_y[0])  # one task is fine
    assert fast["0.weight"].shape == (8, 3)


def test_backward_of_a_meta_loss_taken_under_no_grad_says_so():
    batch = batch_of((3,))
    model = built(lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3)
    with torch.no_grad():
        loss = learner.meta_loss(batch)
    assert not loss.requires_grad  # evaluation works as before
    assert torch.allclose(loss, learner.meta_loss(batch), rtol=1e-14)
    with raises(
        RuntimeError,
        "this meta-loss was computed under torch.no_grad(), which records no graph, so it has no "
        "meta-gradient to backpropagate; call learner.meta_loss(batch) with grad mode on to train, and "
        "keep torch.no_grad() for evaluation.",
    ):
        loss.backward()
    assert type(loss * 2) is Tensor  # arithmetic on it gives ordinary tensors


def test_inference_mode_says_to_use_no_grad():
    batch = batch_of((3,))
    learner = maml.MetaLearner(built(lambda: nn.Linear(3, 1)), F.mse_loss, inner_lr=0.3)
    with (
        torch.inference_mode(),
        raises(
            RuntimeError,
            "MetaLearner.run cannot run under torch.inference_mode(): the inner loop differentiates the support "
            "loss, which inference mode forbids even inside torch.enable_grad(). Evaluate under torch.no_grad() "
            "instead, which gives the same values without keeping a graph.",
        ),
    ):
        learner.meta_loss(batch)
    with torch.inference_mode(), raises(RuntimeError, "MetaLearner.adapt cannot run under torch.inference_mode()"):
        learner.adapt(batch.support_x[0], batch.support_y[0])


# ---------------------------------------------------------------- a module used at two places


class Twice(nn.Module):
    """``lin(tanh(lin(x)))`` with ``lin`` registered once: the reference for the same net built as a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def shared_batch() -> maml.TaskBatch:
    """Regression tasks of 3 features to 3 targets."""
    b = batch_of((3,), n=5)
    return maml.TaskBatch(b.support_x, 0.5 * b.support_x.flip(-1), b.query_x, 0.5 * b.query_x.flip(-1))


def shared_sequential() -> tuple[nn.Module, nn.Linear]:
    """``nn.Sequential(lin, nn.Tanh(), lin)``: one ``nn.Linear`` registered under two names."""
    lin = built(nn.Linear, 3, 3)
    return nn.Sequential(lin, nn.Tanh(), lin), lin


def twice_meta_loss(w: Tensor, b: Tensor, batch: maml.TaskBatch, lr: float, steps: int) -> Tensor:
    """The second-order MAML meta-loss of ``x -> tanh(x w^T + b) w^T + b`` written out by hand."""
    net = lambda w, b, x: torch.tanh(x @ w.T + b) @ w.T + b  # noqa: E731
    losses = []
    for t in range(batch.num_tasks):
        fw, fb = w, b
        for _ in range(steps):
            gw, gb = torch.autograd.grad(
                F.mse_loss(net(fw, fb, batch.support_x[t]), batch.support_y[t]), (fw, fb), create_graph=True
            )
            fw, fb = fw - lr * gw, fb - lr * gb
        losses.append(F.mse_loss(net(fw, fb, batch.query_x[t]), batch.query_y[t]))
    return torch.stack(losses).mean()


SHARED_PATHS = [
    pytest.param({"mode": spec, "batching": batching}, id=f"{mode}-{batching}{suffix}")
    for mode in maml.MODES
    for batching in ("vmap", "loop")
    for spec, suffix in (
        [(mode, ""), (maml.Checkpointed(hvp="forward_over_reverse"), "-fwd")]
        if mode == "checkpointed"
        else [(mode, "")]
    )
] + [pytest.param({"compile": True, "batching": "vmap"}, id="compiled")]


@pytest.mark.parametrize("options", SHARED_PATHS)
def test_a_module_used_twice_keeps_its_parameters_and_gets_the_exact_meta_gradient(options):
    batch = shared_batch()
    model, lin = shared_sequential()
    weight, bias = lin.weight, lin.bias
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, steps=2, **options)
    reference = built(Twice)
    reference.load_state_dict({"lin.weight": weight.detach(), "lin.bias": bias.detach()})
    twin = maml.MetaLearner(reference, F.mse_loss, inner_lr=0.3, steps=2, **options)

    loss, expected = learner.meta_loss(batch), twin.meta_loss(batch)
    loss.backward()
    expected.backward()

    # The model's own parameters are never replaced, and the gradient lands in them.
    assert lin.weight is weight and lin.bias is bias and isinstance(weight, nn.Parameter)
    assert model[0].weight is model[2].weight is weight
    assert_close(loss.detach(), expected.detach())
    assert_close(weight.grad, reference.lin.weight.grad)
    assert_close(bias.grad, reference.lin.bias.grad)
    if options.get("mode", "second_order") == "second_order":  # the reference itself, written out by hand
        w, b = (t.detach().clone().requires_grad_() for t in (weight, bias))
        by_hand = twice_meta_loss(w, b, batch, 0.3, 2)
        by_hand.backward()
        assert_close(weight.grad, w.grad)
        assert_close(bias.grad, b.grad)
    model(batch.query_x[0]).sum().backward()  # the model still runs, on its parameters


def test_a_module_used_twice_adapts_alike_in_training_and_evaluation():
    batch = shared_batch()
    model, lin = shared_sequential()
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.3, steps=2)
    trained = learner.run(batch).fast
    with torch.no_grad():
        evaluated = learner.run(batch).fast
    one = learner.adapt(batch.support_x[0], batch.support_y[0])
    assert set(trained) == set(evaluated) == {"0.weight", "0.bias"}
    for k in trained:
        assert_close(evaluated[k], trained[k].detach())
        assert_close(one[k].detach(), trained[k][0].detach())
    assert isinstance(lin.weight, nn.Parameter) and model[2].weight is lin.weight


class EvalEncoder(nn.Module):
    """An eval-mode transformer layer with a head: PyTorch's fused fast path has no derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x.unsqueeze(0)).squeeze(0))


@pytest.mark.parametrize("mode", ["second_order", "first_order", "checkpointed"])
@pytest.mark.parametrize("batching", ["auto", "vmap"])
def test_eval_mode_attention_layers_under_vmap_equal_the_loop(mode, batching):
    model = built(EvalEncoder).eval()
    batch = batch_of((4,))
    grads = {}
    for b in (batching, "loop"):
        learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.1, steps=2, mode=mode, batching=b)
        grads[b] = flat_grad(learner, batch)
    torch.testing.assert_close(grads[batching], grads["loop"], rtol=0, atol=1e-12)
    assert torch.backends.mha.get_fastpath_enabled()  # the process-wide switch is restored


class Pair(nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 1), out

    def forward(self, x: Tensor) -> object:
        y = self.lin(x)
        return (y, y.sum()) if self.out == "tuple" else {"y": y}


@pytest.mark.parametrize("out", ["tuple", "dict"])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_a_model_returning_several_outputs_is_refused_in_one_line(out, batching):
    model = built(Pair, out)
    learner = maml.MetaLearner(model, lambda o, y: F.mse_loss(o[0] if out == "tuple" else o["y"], y), 0.1)
    learner.batching = batching
    with raises(TypeError, f"the model returned a {out}; the learner needs one tensor, the output loss_fn scores"):
        learner.meta_loss(batch_of((4,)))
