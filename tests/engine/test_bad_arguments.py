"""Every bad input gets an error that names the argument, the bad value and the fix."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import make
from torch import nn

import maml


def raises(exc: type[Exception], text: str):
    return pytest.raises(exc, match=re.escape(text))


@pytest.fixture
def mlp():
    model, batch, loss_fn = make("mlp")
    return model, batch, loss_fn


# ---------------------------------------------------------------- TaskBatch


def test_support_and_query_task_counts_differ():
    x, y = torch.zeros(4, 5, 3), torch.zeros(4, 5, 1)
    with raises(ValueError, "TaskBatch: query_x has 3 tasks (size of dimension 0) but support_x has 4"):
        maml.TaskBatch(x, y, x[:3], y[:3])


def test_examples_and_targets_differ():
    x, y = torch.zeros(4, 5, 3), torch.zeros(4, 5, 1)
    with raises(ValueError, "TaskBatch: query_x has 5 examples per task (dimension 1) but query_y has 2"):
        maml.TaskBatch(x, y, x, y[:, :2])


def test_batch_fields_must_be_tensors_with_a_task_dimension():
    x, y = torch.zeros(4, 5, 3), torch.zeros(4, 5, 1)
    with raises(TypeError, "TaskBatch: support_y must be a torch.Tensor with a leading task dimension, got list"):
        maml.TaskBatch(x, [1, 2], x, y)
    with raises(ValueError, "TaskBatch: query_y has shape (4,); it needs at least two dimensions"):
        maml.TaskBatch(x, y, x, torch.zeros(4))
    with raises(ValueError, "TaskBatch: support_x holds 0 tasks"):
        maml.TaskBatch(x[:0], y[:0], x[:0], y[:0])


def test_run_needs_a_task_batch(mlp):
    model, batch, loss_fn = mlp
    with raises(TypeError, "batch must be a maml.TaskBatch, got tuple"):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1).meta_loss(tuple(vars(batch).values()))


# ---------------------------------------------------------------- inputs


def test_non_floating_input(mlp):
    model, batch, loss_fn = mlp
    bad = maml.TaskBatch(batch.support_x.to(torch.uint8), batch.support_y, batch.query_x, batch.query_y)
    with raises(
        TypeError,
        "support_x has dtype torch.uint8, but the model needs floating-point inputs (torch.float64); convert them with support_x.to(torch.float64)",
    ):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1).meta_loss(bad)
    with raises(TypeError, "support_x has dtype torch.int64, but the model needs floating-point inputs"):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1).adapt(batch.support_x[0].long(), batch.support_y[0])


def test_input_dtype_differs_from_the_parameters(mlp):
    model, batch, loss_fn = mlp
    bad = maml.TaskBatch(batch.support_x, batch.support_y, batch.query_x.float(), batch.query_y)
    with raises(
        TypeError,
        "query_x has dtype torch.float32 but the model's parameters are torch.float64; convert the inputs with query_x.to(torch.float64)",
    ):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1).meta_loss(bad)


def test_integer_inputs_are_fine_for_an_embedding_model():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 1)).double()
    x = torch.randint(0, 10, (2, 3, 2))
    batch = maml.TaskBatch(x, torch.randn(2, 3, 1, dtype=torch.float64), x, torch.randn(2, 3, 1, dtype=torch.float64))
    assert maml.MetaLearner(model, F.mse_loss, inner_lr=0.1).meta_loss(batch).isfinite()


def test_adapt_examples_and_targets_differ(mlp):
    model, batch, loss_fn = mlp
    with raises(ValueError, "support_x has 5 examples but support_y has 4"):
        maml.MetaLearner(model, loss_fn, inner_lr=0.1).adapt(batch.support_x[0], batch.support_y[0, :4])


# ---------------------------------------------------------------- constructor arguments


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (
            {"mode": "second-order"},
            ValueError,
            "mode='second-order' is not supported (did you mean 'second_order'?); choose one of 'second_order', 'first_order', 'checkpointed', 'reptile', 'implicit'.",
        ),
        ({"mode": "fomaml"}, ValueError, "mode='fomaml' is not supported; choose one of"),
        (
            {"batching": "vmapp"},
            ValueError,
            "batching='vmapp' is not supported (did you mean 'vmap'?); choose one of 'auto', 'vmap', 'loop'.",
        ),
        ({"steps": -1}, ValueError, "steps=-1 is out of range; it must be >= 0."),
        ({"steps": 1.5}, TypeError, "steps must be an int, got 1.5 (float)."),
        ({"inner_lr": -0.1}, ValueError, "inner_lr=-0.1 is out of range; it must be a finite number > 0."),
        ({"inner_lr": float("nan")}, ValueError, "inner_lr=nan is out of range"),
        ({"inner_lr": "0.1"}, TypeError, "inner_lr must be a Python float, got '0.1' (str)"),
        (
            {"learn_inner_lr": "meta_sgd"},
            ValueError,
            "learn_inner_lr='meta_sgd' is not supported; choose one of None, 'scalar', 'per_parameter', 'per_layer_per_step'.",
        ),
        ({"chunk_size": 0}, ValueError, "chunk_size=0 is out of range; it must be >= 1."),
        ({"chunk_size": 2, "batching": "loop"}, ValueError, "chunk_size=2 only applies to batching='vmap'"),
        (
            {"mode": "checkpointed", "chunk_size": 2},
            ValueError,
            "chunk_size=2 is tasks per vmapped call; the checkpointed mode's tasks replayed together are "
            "mode=maml.Checkpointed(tasks=2).",
        ),
        ({"mode": 3}, TypeError, "mode must be a name such as 'second_order' or a maml.Mode"),
    ],
)
def test_bad_constructor_arguments(mlp, kwargs, exc, text):
    model, _, loss_fn = mlp
    with raises(exc, text):
        maml.MetaLearner(model, loss_fn, **{"inner_lr": 0.1, **kwargs})


def test_model_and_loss_types(mlp):
    model, _, loss_fn = mlp
    with raises(TypeError, "model must be a torch.nn.Module, got function"):
        maml.MetaLearner(lambda x: x, loss_fn, inner_lr=0.1)
    with raises(TypeError, "loss_fn must be callable as loss_fn(output, y) -> scalar, got 'mse'"):
        maml.MetaLearner(model, "mse", inner_lr=0.1)
    with raises(ValueError, "model has no parameter with requires_grad=True: there is nothing to adapt."):
        maml.MetaLearner(model.requires_grad_(False), loss_fn, inner_lr=0.1)


# ---------------------------------------------------------------- during the inner loop


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_loss_that_is_not_a_scalar(mlp, batching):
    model, batch, _ = mlp
    learner = maml.MetaLearner(model, lambda out, y: (out - y) ** 2, inner_lr=0.1, batching=batching)
    with raises(
        ValueError,
        "loss_fn returned a tensor of shape (5, 1) for one task; it must return a scalar tensor, the mean loss over the task's examples",
    ):
        learner.meta_loss(batch)
    learner = maml.MetaLearner(model, lambda out, y: 1.0, inner_lr=0.1, batching=batching)
    with raises(ValueError, "loss_fn returned float for one task"):
        learner.meta_loss(batch)


def test_parameter_names_that_do_not_match_the_model(mlp):
    model, batch, loss_fn = mlp
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1)
    params = dict(model.named_parameters())
    params["0.weigth"] = params.pop("0.weight")
    with raises(
        ValueError, "params has keys that are not parameters of the model: '0.weigth' (did you mean '0.weight'"
    ):
        learner.run(batch, params)
    del params["0.weigth"]
    with raises(ValueError, "params lacks parameters of the model: '0.weight'"):
        learner.adapt(batch.support_x[0], batch.support_y[0], params)
    params["0.weight"] = torch.zeros(2, 2, dtype=torch.float64)
    with raises(ValueError, "params['0.weight'] has shape (2, 2) but the model's parameter has shape (16, 3)"):
        learner.run(batch, params)


@pytest.mark.parametrize("mode", maml.MODES)
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_nan_inner_loss_names_the_task_and_step(mlp, mode, batching):
    model, batch, loss_fn = mlp
    support_x = batch.support_x.clone()
    support_x[2, 1, 0] = float("nan")
    bad = maml.TaskBatch(support_x, batch.support_y, batch.query_x, batch.query_y)
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1, steps=3, mode=mode, batching=batching)
    with raises(FloatingPointError, "the inner (support) loss is nan for task 2 at inner step 0 (0-based, of 3)"):
        learner.meta_loss(bad)


def test_diverging_inner_loop_names_the_step_and_the_rate(mlp):
    model, batch, loss_fn = mlp
    learner = maml.MetaLearner(model, loss_fn, inner_lr=1e200, steps=4)
    with pytest.raises(
        FloatingPointError,
        match=r"for task \d at inner step [123] .*Lower the inner learning rate \(inner_lr=1e\+200\)",
    ):
        learner.meta_loss(batch)
    assert maml.MetaLearner(model, loss_fn, inner_lr=1e200, steps=4, check_finite=False).meta_loss(batch).isnan()


def test_batchnorm_tracking_running_statistics_in_training_mode(mlp):
    _, batch, loss_fn = mlp
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).double()
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1)
    with raises(
        ValueError,
        "BatchNorm1d '1' is in training mode and tracks running statistics: it would overwrite them in place on every inner step of every task (and vmap cannot batch that). Build it with track_running_stats=False",
    ):
        learner.meta_loss(batch)
    model.eval()
    assert learner.meta_loss(batch).isfinite()


def test_loading_rates_of_another_kind(mlp):
    model, _, loss_fn = mlp
    scalar = maml.MetaLearner(model, loss_fn, inner_lr=0.1, learn_inner_lr="scalar")
    per_parameter = maml.MetaLearner(model, loss_fn, inner_lr=0.1, learn_inner_lr="per_parameter")
    with raises(ValueError, "state['inner_lrs'] has rates ['inner_lr'] but this learner learns ['0.bias', '0.weight'"):
        per_parameter.load_state_dict(scalar.state_dict())


def test_steps_per_call_is_checked(mlp):
    model, batch, loss_fn = mlp
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1)
    with raises(ValueError, "steps=-2 is out of range; it must be >= 0."):
        learner.run(batch, steps=-2)
    with raises(TypeError, "steps must be an int, got 2.0 (float)."):
        learner.adapt(batch.support_x[0], batch.support_y[0], steps=2.0)


# ---------------------------------------------------------------------------- optimizer options, batches, frozen parameters


def test_inner_optimizer_options_are_checked_as_torch_optim_checks_them():
    model = torch.nn.Linear(2, 1)
    loss = torch.nn.functional.mse_loss
    with pytest.raises(
        ValueError,
        match=r"Nesterov momentum needs a momentum > 0 and zero dampening \(torch.optim.SGD refuses it too\)",
    ):
        maml.MetaLearner(
            model, loss, 0.1, inner_optimizer="momentum", inner_optimizer_options={"momentum": 0.0, "nesterov": True}
        )
    with pytest.raises(TypeError, match="inner_optimizer_options must be a mapping of option names to values"):
        maml.MetaLearner(model, loss, 0.1, inner_optimizer="momentum", inner_optimizer_options=[("momentum", 0.9)])


X, Y = torch.randn(2, 5, 4), torch.tensor([[0, 1, 2, 0, 1]] * 2)


def learner(loss=torch.nn.functional.cross_entropy, **kwargs) -> maml.MetaLearner:
    return maml.MetaLearner(torch.nn.Linear(4, 3), loss, 0.1, **kwargs)


@pytest.mark.parametrize(
    "batch, error",
    [
        (
            lambda: maml.TaskBatch(X[:, :0], Y[:, :0], X, Y),
            "the batch's support set is empty (support_x has 0 examples a task), so the inner loop has no loss to "
            "take 1 step(s) on; give each task support examples, or pass steps=0.",
        ),
        (
            lambda: maml.TaskBatch(X, Y, X[:, :0], Y[:, :0]),
            "the batch's query set is empty (query_x has 0 examples a task), so there is no meta-loss to compute; "
            "give each task at least one query example.",
        ),
        (
            lambda: maml.TaskBatch(X, torch.full_like(Y, 3), X, Y),
            "loss_fn(output, support_y) failed on the first task: Target 3 is out of bounds. Class labels must be "
            "in [0, C) for a model of C outputs; check support_y and query_y.",
        ),
    ],
)
def test_empty_sets_and_labels_out_of_range_name_the_argument(batch, error):
    with pytest.raises(ValueError) as info:
        learner().meta_loss(batch())
    assert str(info.value) == error


def test_support_and_query_examples_of_other_shapes_or_devices_are_refused():
    with pytest.raises(ValueError, match=r"support_x examples have shape \(4,\) but query_x examples \(3,\)"):
        maml.TaskBatch(X, Y, torch.randn(2, 5, 3), Y)
    with pytest.raises(ValueError, match="its tensors are on different devices"):
        maml.TaskBatch(X, Y, X.to("meta"), Y)


@pytest.mark.filterwarnings("ignore:Using a target size:UserWarning")  # torch's own mse_loss warning, beside ours
def test_a_regression_target_of_another_shape_than_the_output_warns():
    with pytest.warns(
        UserWarning, match=r"the model's output for one task has shape \(5, 3\) but its targets \(5, 1\)"
    ):
        learner(torch.nn.functional.mse_loss).meta_loss(
            maml.TaskBatch(X, torch.randn(2, 5, 1), X, torch.randn(2, 5, 1))
        )


@pytest.mark.parametrize("mode", ["second_order", "first_order", "checkpointed"])
def test_a_parameter_frozen_after_the_learner_was_built_is_named(mode):
    meta = learner(mode=mode)
    meta.model.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"the parameter\(s\) 'bias' were frozen \(requires_grad=False\) after"):
        meta.meta_loss(maml.TaskBatch(X, Y, X, Y))


def test_step_weights_that_require_grad_are_refused_where_they_would_get_none():
    meta = learner(compile=True, steps=2)
    weights = torch.tensor([0.5, 0.5], requires_grad=True)
    with pytest.raises(ValueError, match="step_weights require grad, but with compile=True"):
        meta.meta_loss(maml.TaskBatch(X, Y, X, Y), step_weights=weights)


# ---------------------------------------------------------------- rules, layers, state


def test_meta_curvature_of_another_model_is_named():
    model, batch, loss_fn = make("mlp")
    other = nn.Sequential(nn.Linear(5, 7)).double()  # the same names as the mlp's first layer, other shapes
    rule = maml.MetaCurvature(model)
    rule.curvatures[0] = maml.MetaCurvature(other).curvatures[0]
    learner = maml.MetaLearner(model, loss_fn, 0.1, inner_optimizer=rule)
    with raises(
        ValueError, "MetaCurvature's curvature of '0.weight' was built for shape (7, 5), but the learner adapts"
    ):
        learner.meta_loss(batch)


@pytest.mark.parametrize(
    "batching, message",
    [
        ({"cpux": "vmap"}, "state['batching'] names the device 'cpux', which torch does not know"),
        ({"cpu": "bogus"}, "state['batching']['cpu'] is 'bogus'; it must be 'vmap' or 'loop'"),
        (["cpu"], "state['batching'] must map devices to 'vmap' or 'loop'"),
    ],
)
def test_a_state_naming_an_unknown_batching_loads_nothing(mlp, batching, message):
    model, batch, loss_fn = mlp
    learner = maml.MetaLearner(model, loss_fn, 0.1)
    state = {**learner.state_dict(), "batching": batching}
    with raises(ValueError, message):
        learner.load_state_dict(state)
    assert learner.resolved_batching == "vmap"


@pytest.mark.parametrize("eps", [-1.0, 0.0, float("nan"), "1e-5", True])
def test_step_batch_norm_refuses_an_eps_not_above_zero(eps):
    with raises(ValueError, f"StepBatchNorm2d: eps={eps!r} must be a number > 0"):
        maml.nn.StepBatchNorm2d(4, 3, eps=eps)


def test_data_parallel_is_refused_at_construction_naming_its_module_and_task_sharding(mlp):
    # functional_call refuses nn.DataParallel, but only at the first call; a nested one splits a task's examples.
    model, batch, loss_fn = mlp
    sharding = "maml.shard(batch), then maml.all_reduce_grads(learner.parameters())"
    with raises(TypeError, "model=nn.DataParallel(Sequential) cannot be meta-learned") as e:
        maml.MetaLearner(nn.DataParallel(model), loss_fn, inner_lr=0.1)
    assert "Pass model.module, the network it wraps." in str(e.value) and sharding in str(e.value)
    with raises(TypeError, "model=nn.DataParallel(Sequential)"):
        maml.call(nn.DataParallel(model), {}, batch.support_x[0])
    nested = nn.Sequential(nn.DataParallel(model[0]), *model[1:])
    with raises(TypeError, "model's submodule '0' is an nn.DataParallel(Linear)") as e:
        maml.MetaLearner(nested, loss_fn, inner_lr=0.1)
    assert "model.get_submodule('0').module" in str(e.value) and sharding in str(e.value)
    # Wrapped after construction: the next call follows the model's new structure, and refuses it.
    learner = maml.MetaLearner(model, loss_fn, inner_lr=0.1)
    model[0] = nn.DataParallel(model[0])
    with raises(TypeError, "model's submodule '0' is an nn.DataParallel(Linear)"):
        learner.meta_loss(batch)
