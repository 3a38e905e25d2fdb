"""Inputs that used to be accepted without a word (issue 22): each is now one line naming the flag, the
value and the fix (exit 2, nothing written), or a note where the input is kept but overridden."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import omniglot_root
from test_run_faults import one_error, run_sine

import maml
from experiments import memory, omniglot
from experiments.cli import UsageError


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--rate-meta-lr", "0.1"],
            "error: --rate-meta-lr 0.1 is the Adam lr of learned inner rates, and none are learned; drop it, or "
            "learn them with --learn-inner-lr.",
        ),
        (
            ["--meta-lr-schedule", "cosine", "--min-meta-lr", "0.01"],
            "error: --min-meta-lr 0.01 is above --meta-lr 0.001, where the cosine schedule starts: it would anneal "
            "the meta-lr upwards; pass a --min-meta-lr below --meta-lr.",
        ),
    ],
)
def test_flags_that_would_do_nothing_or_the_opposite_are_refused(capsys, tmp_path, args, line):
    out = tmp_path / "run"
    assert one_error(run_sine(capsys, [*args, "--out", str(out)], code=2)) == line
    assert not out.exists()


def test_one_way_tasks_are_refused(capsys, tmp_path):
    out = tmp_path / "run"
    err = run_sine(capsys, ["--ways", "1", "--out", str(out)], code=2, module=omniglot)
    assert one_error(err) == "error: --ways 1: a task needs at least 2 classes to tell apart; pass --ways 2 or more."
    assert not out.exists()


TRILLION = "1000000000000"


@pytest.mark.parametrize(
    "flag, needs",
    [
        ("--hidden", "--hidden: the network's weights, meta-gradient, and one task's support gradient and fast weights "
         "need more than PyTorch can count"),
        ("--meta-batch", "--meta-batch, --shots, --query, --hidden: the training meta-batch's points and one task's "
         "first hidden layer need at least 160.0 TB"),
        ("--shots", "--val-tasks, --shots, --query: the validation tasks' points need at least 800.0 TB"),
        ("--query", "--val-tasks, --shots, --query: the validation tasks' points need at least 800.0 TB"),
        ("--val-tasks", "--val-tasks, --shots, --query: the validation tasks' points need at least 160.0 TB"),
        ("--eval-tasks", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 840.0 TB"),
        ("--eval-shots", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 4.8 PB"),
        ("--eval-query", "--eval-tasks, --eval-shots, --eval-query: the test tasks' points need at least 4.8 PB"),
    ],
)  # fmt: skip  # one flag and its line per row
def test_a_size_whose_tensors_cannot_fit_is_one_line_with_its_estimate(capsys, tmp_path, flag, needs):
    out = tmp_path / "run"
    # The defaults of the sine script, with one size at 10^12 (the tests' small sizes would change the estimates).
    args = ["--hidden", "40", "--meta-batch", "25", "--val-tasks", "100", "--eval-tasks", "600", "--eval-query", "100"]
    line = one_error(run_sine(capsys, [*args, flag, TRILLION, "--out", str(out)], code=2))
    assert line.startswith(f"error: {needs}, and this machine has "), line
    assert line.endswith(" of memory free; lower " + ("it." if flag == "--hidden" else "the one set too high."))
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--filters", "--meta-batch", "--eval-tasks"])
def test_an_omniglot_size_whose_tensors_cannot_fit_is_one_line(capsys, tmp_path, flag):
    out = tmp_path / "run"
    args = ["--data", str(omniglot_root()), flag, TRILLION, "--out", str(out)]
    line = one_error(run_sine(capsys, args, code=2, module=omniglot))
    assert line.startswith(f"error: {flag}") and "of memory free; lower the one set too high." in line, line
    assert not out.exists()


def test_more_threads_than_cpus_are_refused(capsys, tmp_path):
    out = tmp_path / "run"
    cpus = len(os.sched_getaffinity(0))
    line = one_error(run_sine(capsys, ["--threads", TRILLION, "--out", str(out)], code=2))
    assert (
        line == f"error: --threads {TRILLION} is more than the {cpus} CPUs this process may run on; pass 1 to {cpus}."
    )
    assert not out.exists()


def test_the_memory_check_refuses_only_what_cannot_fit():
    free = memory.free_bytes(torch.device("cpu"))
    assert free is not None and free > 0
    memory.check_fits([memory.Need("a small thing", "--small", free // 2)], torch.device("cpu"))
    with pytest.raises(UsageError, match=r"^--big: a big thing need at least .*; lower it\.$"):
        memory.check_fits([memory.Need("a big thing", "--big", 2 * free)], torch.device("cpu"))


def test_a_key_given_twice_in_a_config_file_is_refused(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("iterations: 2\nhidden: 8\niterations: 3\n")
    line = one_error(run_sine(capsys, ["--config", str(config), "--out", str(tmp_path / "run")], code=2))
    assert line == (
        f"error: --config {config}: not valid YAML at line 3, column 1: the key 'iterations' is given twice; keep one."
    )


def test_resume_says_that_a_hand_edited_config_yaml_is_not_what_it_continues(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["--iterations", "2", "--eval-tasks", "2", "--out", str(out)]
    run_sine(capsys, args)
    path = out / "config.yaml"
    path.write_text(path.read_text().replace("hidden: 8", "hidden: 9"))
    err = run_sine(capsys, [*args[:1], "3", *args[2:], "--resume"])
    assert (
        f"note: {path} was edited (hidden); --resume continues with the run's config, kept in its checkpoint, "
        f"and writes config.yaml anew (a resumable key changes by its flag)"
    ) in err.splitlines()
    assert "hidden: 8" in path.read_text()


def test_inner_optimizer_options_are_checked_as_torch_optim_checks_them():
    model = torch.nn.Linear(2, 1)
    loss = torch.nn.functional.mse_loss
    with pytest.raises(ValueError, match=r"Nesterov momentum needs a momentum > 0 \(torch.optim.SGD refuses it too\)"):
        maml.MetaLearner(
            model, loss, 0.1, inner_optimizer="momentum", inner_optimizer_options={"momentum": 0.0, "nesterov": True}
        )
    with pytest.raises(TypeError, match="inner_optimizer_options must be a mapping of option names to values"):
        maml.MetaLearner(model, loss, 0.1, inner_optimizer="momentum", inner_optimizer_options=[("momentum", 0.9)])


# ---------------------------------------------------------------------------- the engine's API

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
