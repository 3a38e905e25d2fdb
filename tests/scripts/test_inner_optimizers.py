"""The scripts' inner update rules: every name of ``--inner-optimizer`` with its torch.optim options
(``--inner-optimizer-options``, a JSON object, or a mapping in a ``--config`` file), ``--inner-adam-betas`` under it,
learned options trained, saved and resumed, and what a bad option says (one line, exit code 2, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import checkpoint, one_error, run_sine, says
from torch import nn

import maml
from experiments import peers, sine
from experiments.harness import config, recipes


def parsed(argv: list[str]) -> sine.SineConfig:
    cfg, _ = config.parse_args(
        "sine", sine.SineConfig, [*argv, "--compile", "false", "--wandb", "disabled"], "", sine.validate_config
    )
    return cfg


def rule_of(argv: list[str]) -> nn.Module:
    """The update rule of the learner the scripts build for ``argv``."""
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    return recipes.learner(parsed(argv), net, F.mse_loss).rule


CLASSES = {name: next(getattr(maml, n) for n in maml.__all__ if n.lower() == name) for name in maml.INNER_OPTIMIZERS}


@pytest.mark.parametrize("name", maml.INNER_OPTIMIZERS)
def test_every_inner_optimizer_is_built_from_its_flag(name):
    assert type(rule_of(["--inner-optimizer", name])) is CLASSES[name]


def test_the_options_reach_the_rule_with_pairs_as_tuples():
    rule = rule_of(["--inner-optimizer", "rmsprop", "--inner-optimizer-options", '{"momentum": 0.5, "centered": true}'])
    assert "momentum=0.5" in repr(rule) and "centered=True" in repr(rule), repr(rule)
    options = '{"etas": [0.4, 1.3], "step_sizes": [1e-5, 2]}'
    cfg = parsed(["--inner-optimizer", "rprop", "--inner-optimizer-options", options])
    assert recipes.inner_options(cfg) == {"etas": (0.4, 1.3), "step_sizes": (1e-5, 2)}
    assert "etaminus=0.4, etaplus=1.3" in repr(
        rule_of(["--inner-optimizer", "rprop", "--inner-optimizer-options", options])
    )


def test_inner_adam_betas_are_adams_and_the_options_betas_replace_them():
    assert "beta1=0.0, beta2=0.999," in repr(rule_of(["--inner-optimizer", "adam", "--inner-adam-betas", "0,0.999"]))
    both = ["--inner-optimizer", "adam", "--inner-adam-betas", "0,0.999", "--inner-optimizer-options"]
    assert "beta1=0.5, beta2=0.9," in repr(rule_of([*both, '{"betas": [0.5, 0.9]}']))
    assert recipes.inner_options(parsed(["--inner-optimizer", "adamw"])) is None  # torch.optim's defaults


def test_a_config_file_takes_the_options_as_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner_optimizer: adam\ninner_optimizer_options: {betas: [0.9, 0.99], learn: [betas]}\n")
    cfg = parsed(["--config", str(path)])
    assert json.loads(cfg.inner_optimizer_options) == {"betas": [0.9, 0.99], "learn": ["betas"]}
    rule = rule_of(["--config", str(path)])
    assert "beta1=0.9 (learned, scalar), beta2=0.99 (learned, scalar)" in repr(rule), repr(rule)


def test_learned_betas_are_meta_trained_saved_and_resumed_bit_for_bit(capsys, tmp_path):
    learn = ["--inner-optimizer", "adam", "--steps", "2", "--checkpoint-every", "2", "--val-every", "2"]
    learn += ["--inner-optimizer-options", '{"betas": [0.9, 0.99], "learn": {"betas": "per_layer_per_step"}}']
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_sine(capsys, [*learn, "--iterations", "4", "--out", str(whole)])
    run_sine(capsys, [*learn, "--iterations", "2", "--out", str(cut)])
    halfway = checkpoint(cut)["learner"]["rule"]
    run_sine(capsys, [*learn, "--iterations", "4", "--out", str(cut), "--resume"])
    a, b = checkpoint(whole), checkpoint(cut)
    rule = a["learner"]["rule"]
    assert sorted({k.split(".")[1] for k in rule}) == ["beta1", "beta2"] and len(rule) == 2 * 6  # 6 tensors of the net
    start = {"beta1": torch.logit(torch.tensor(0.9)), "beta2": torch.logit(torch.tensor(0.99))}
    for key, raw in rule.items():  # unconstrained (sigmoid's inverse), one per inner step, and trained
        assert raw.shape == (2,) and not torch.allclose(raw, start[key.split(".")[1]].expand(2), rtol=0, atol=1e-6)
        assert not torch.equal(raw, halfway[key]), key
        assert torch.equal(raw, b["learner"]["rule"][key]), key
    for key, value in a["learner"]["model"].items():
        assert torch.equal(value, b["learner"]["model"][key]), key
    # The outer optimizer steps them: their group of its state, resumed with it.
    assert [len(group["params"]) for group in a["optimizer"]["param_groups"]] == [6, 12]
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], b["optimizer"]["state"][index]["exp_avg"]), index


def test_a_torch_optim_rule_trains_end_to_end(capsys, tmp_path):
    out = tmp_path / "run"
    options = '{"momentum": 0.5}'
    run_sine(
        capsys,
        ["--inner-optimizer", "rmsprop", "--inner-optimizer-options", options, "--iterations", "2", "--out", str(out)],
    )
    results = json.loads((out / "results.json").read_text())
    assert (results["config"]["inner_optimizer"], results["config"]["inner_optimizer_options"]) == ("rmsprop", options)
    assert set(results["test"]) and checkpoint(out)["iteration"] == 2


@pytest.mark.parametrize(
    "args, lead, fixes",
    [
        (["--inner-optimizer-options", "{momentum: 0.9}"], "--inner-optimizer-options {momentum: 0.9}", ("not a JSON object", '{"momentum": 0.9}')),
        (["--inner-optimizer-options", "[0.9]"], "--inner-optimizer-options [0.9]", ("not a JSON object", "torch.optim's keyword names")),
        (["--inner-optimizer-options", '{"eps": 1, "eps": 2}'], '--inner-optimizer-options {"eps": 1, "eps": 2}', ("'eps' is given twice",)),
        (["--inner-optimizer", "rmsprop", "--inner-optimizer-options", '{"alpha": 1.5}'], '--inner-optimizer-options {"alpha": 1.5} (--inner-optimizer rmsprop)', ("alpha=1.5 is out of range", "[0, 1)")),
        (["--inner-optimizer", "adam", "--inner-optimizer-options", '{"momentum": 0.9}'], '--inner-optimizer-options {"momentum": 0.9} (--inner-optimizer adam)', ("'momentum'", "its options are 'betas'")),
        (["--inner-optimizer-options", '{"lr": 0.1}'], '--inner-optimizer-options {"lr": 0.1}', ("--inner-lr", "--inner-lr 0.1")),
        (["--inner-optimizer", "momentum", "--inner-optimizer-options", '{"momentum": 0, "learn": "momentum"}'], "--inner-optimizer-options", ("must start inside (0, 1)",)),
        (["--inner-optimizer", "adam", "--inner-optimizer-options", '{"learn": {"betas": "per_task"}}'], "--inner-optimizer-options", ("is not a layout", "'per_parameter'")),
        (["--algorithm", "reptile", "--inner-optimizer", "adam", "--inner-optimizer-options", '{"learn": ["betas"]}'], '--inner-optimizer-options {"learn": ["betas"]} learns betas', ("--mode reptile", 'drop "learn"', "pick another --mode")),
    ],
    ids=["not-json", "not-an-object", "key-twice", "out-of-range", "unknown-option", "lr", "learned-at-0", "layout", "reptile"],
)  # fmt: skip
def test_a_bad_option_names_the_flag_and_the_fix(capsys, tmp_path, args, lead, fixes):
    out = tmp_path / "run"
    says(one_error(run_sine(capsys, [*args, "--out", str(out)], code=2)), lead, *fixes)
    assert not out.exists()


def test_learn2learns_engine_refuses_inner_options():
    cfg = parsed(["--inner-optimizer-options", '{"momentum": 0.9}'])
    says(f"error: {peers.unsupported(cfg)}", "--engine learn2learn", '--inner-optimizer-options {"momentum": 0.9}')


def test_inner_proximal_adds_the_proximal_term_to_the_inner_loss_alone(capsys, tmp_path):
    """--inner-proximal: the learner's inner loss is the task's loss plus lam/2 |phi - theta|^2, exactly as written
    by hand in a second-order loop; the meta-loss stays the query loss; the run records it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    built = recipes.learner(parsed(["--inner-proximal", "0.3", "--steps", "2", "--inner-lr", "0.1"]), net, F.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y, qx, qy = (torch.randn(2, 5, 1, generator=g, dtype=torch.float64) for _ in range(4))
    (got,) = torch.autograd.grad(built.meta_loss(maml.TaskBatch(x, y, qx, qy)), [net[0].weight])
    theta = dict(net.named_parameters())
    total = 0.0
    for t in range(2):
        fast = dict(theta)
        for _ in range(2):
            out = torch.func.functional_call(net, fast, (x[t],))
            inner = F.mse_loss(out, y[t]) + 0.15 * sum((fast[k] - theta[k]).pow(2).sum() for k in fast)
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {k: v - 0.1 * gk for (k, v), gk in zip(fast.items(), grads)}
        total = total + F.mse_loss(torch.func.functional_call(net, fast, (qx[t],)), qy[t]) / 2
    (expected,) = torch.autograd.grad(total, [net[0].weight])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)
    out = tmp_path / "run"
    run_sine(capsys, ["--inner-proximal", "0.1", "--iterations", "2", "--out", str(out)])
    assert json.loads((out / "results.json").read_text())["config"]["inner_proximal"] == 0.1


@pytest.mark.parametrize(
    "args, lead, fixes",
    [
        (["--inner-proximal", "-1"], "--inner-proximal -1", ("finite number >= 0",)),
        (["--inner-proximal", "nan"], "--inner-proximal nan", ("finite number >= 0",)),
        (["--inner-proximal", "0.5", "--mode", "implicit"], "--inner-proximal 0.5 with --mode implicit", ("--implicit-lam", "drop --inner-proximal")),
    ],
    ids=["negative", "nan", "implicit"],
)  # fmt: skip
def test_a_bad_inner_proximal_names_the_flag_and_the_fix(capsys, tmp_path, args, lead, fixes):
    out = tmp_path / "run"
    says(one_error(run_sine(capsys, [*args, "--out", str(out)], code=2)), lead, *fixes)
    assert not out.exists()


def test_learn2learns_engine_refuses_an_inner_proximal_term():
    says(
        f"error: {peers.unsupported(parsed(['--inner-proximal', '0.5']))}",
        "--engine learn2learn",
        "--inner-proximal 0.5",
    )
