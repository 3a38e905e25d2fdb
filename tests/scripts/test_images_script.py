"""experiments.images: its default is cbfinn/maml's mini-ImageNet protocol; a short run writes results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import folder_writer, write_ren_mini
from torch import nn

import maml
from experiments import images, omniglot
from experiments.harness import fit, recipes
from experiments.nets import BatchNormOffset


def test_the_default_config_is_the_references_mini_imagenet_protocol():
    """main.py's usage line: --metatrain_iterations=60000 --meta_batch_size=4 --update_batch_size=1
    --update_lr=0.01 --num_updates=5 --num_classes=5 --num_filters=32 --max_pool=True; K+15 images per
    class in training, 2K at test, 600 test tasks at 10 steps; Adam at meta_lr 0.001."""
    for shots in (1, 5):
        cfg = images.ImagesConfig(shots=shots).resolved()
        assert (cfg.dataset, cfg.network, cfg.loss, cfg.filters) == ("miniimagenet", "reference", "reference", 32)
        assert (cfg.iterations, cfg.meta_batch, cfg.inner_lr, cfg.steps, cfg.ways) == (60_000, 4, 0.01, 5, 5)
        assert (cfg.query, cfg.eval_query, cfg.eval_tasks, max(cfg.eval_steps)) == (15, shots, 600, 10)
        assert (cfg.meta_lr, cfg.meta_optimizer, cfg.clip_meta_grad, cfg.mode) == (0.001, "adam", 10.0, "second_order")


def test_the_network_is_the_references_max_pool_net_on_84_pixels():
    torch.manual_seed(0)
    model = images.make_model(images.ImagesConfig().resolved()).module
    shapes = []
    for layer in model:
        layer.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape[1:])))
    model(torch.rand(2, 3, 84, 84))
    pools = [s for s, layer in zip(shapes, model) if isinstance(layer, nn.MaxPool2d)]
    assert pools == [(32, 42, 42), (32, 21, 21), (32, 10, 10), (32, 5, 5)]  # 'VALID' 2x2 pools
    assert shapes[-1] == (5,) and model[-1].in_features == 32 * 5 * 5  # w5: [dim_hidden*5*5, dim_output]
    norm = model[1]
    assert isinstance(norm, BatchNormOffset) and norm.eps == 1e-3 and not list(model.buffers())
    convs = [layer for layer in model if isinstance(layer, nn.Conv2d)]
    assert [c.stride for c in convs] == [(1, 1)] * 4 and [c.padding for c in convs] == [(1, 1)] * 4
    for layer in [*convs, model[-1]]:  # Xavier-uniform weights, zero biases
        fan_out, fan_in = layer.weight.shape[0] * layer.weight[0, 0].numel(), layer.weight[0].numel()
        assert layer.weight.abs().max() <= math.sqrt(6 / (fan_in + fan_out)) and not layer.bias.any()
    assert omniglot.meta_only(model) == {f"{i}.offset" for i in (1, 5, 9, 13)}


def test_the_loss_is_the_references_sum_over_k_and_the_meta_loss_its_mean_over_tasks():
    """xent = softmax_cross_entropy_with_logits / update_batch_size, a vector: tf.gradients differentiates its
    sum, in the inner step (5 support images) and in the meta-loss (75 query images at 1 shot), which is
    reduce_sum(lossesb) / meta_batch_size."""
    cfg = images.ImagesConfig(filters=4).resolved()  # (the reduction does not depend on the width)
    torch.manual_seed(0)
    model = images.make_model(cfg).module.double()
    loss = images.make_model(cfg).loss
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 5, 3, 84, 84, generator=g, dtype=torch.float64)
    q = torch.rand(2, 75, 3, 84, 84, generator=g, dtype=torch.float64)
    y, qy = torch.arange(5).expand(2, -1), torch.arange(5).repeat_interleave(15).expand(2, -1)
    learner = maml.MetaLearner(
        model,
        loss,
        inner_lr=cfg.inner_lr,
        steps=1,
        batching="loop",
        adapt=recipes.adapt_set(model, cfg.adapt, omniglot.meta_only(model)),
    )
    out = learner.run(maml.TaskBatch(x, y, q, qy))
    adapted = {k: v for k, v in model.named_parameters() if not k.endswith("offset")}
    expected = []
    for t in range(2):
        support = F.cross_entropy(model(x[t]), y[t], reduction="sum") / cfg.shots
        grads = torch.autograd.grad(support, list(adapted.values()), create_graph=True)
        fast = {k: v - cfg.inner_lr * g_ for (k, v), g_ in zip(adapted.items(), grads)}
        logits = torch.func.functional_call(model, {**dict(model.named_parameters()), **fast}, (q[t],))
        expected.append(F.cross_entropy(logits, qy[t], reduction="sum") / cfg.shots)
    torch.testing.assert_close(out.loss, torch.stack(expected).sum() / 2)
    mean = F.cross_entropy(out.query_out.flatten(0, 1), qy.flatten())
    torch.testing.assert_close(out.loss.detach(), 75 * mean.detach())  # 5 ways x 15 query / K = 1


def test_the_mamlpp_recipe_is_its_repositorys_mini_imagenet_config():
    one = images.ImagesConfig(**recipes.recipe("images", "mamlpp"), algorithm="mamlpp").resolved()
    assert (one.steps, one.inner_lr, one.meta_batch, one.iterations, one.loss, one.network) == (
        5, 0.01, 4, 75_000, "mean", "maxpool",
    )  # fmt: skip
    assert one.per_step_bn and one.learn_inner_lr == "per_layer_per_step" and one.first_order_fraction == 80 / 150
    five = images.ImagesConfig(**recipes.recipe("images", "mamlpp"), algorithm="mamlpp", shots=5).resolved()
    assert five.meta_batch == 2


SHORT = [
    "--query", "1", "--ways", "2", "--filters", "4", "--meta-batch", "2", "--iterations", "2", "--steps", "1",
    "--eval-tasks", "4", "--eval-chunk", "2", "--val-tasks", "2", "--eval-steps", "1,2", "--log-every", "1",
    "--val-every", "2", "--checkpoint-every", "1", "--wandb", "disabled", "--threads", "1",
]  # fmt: skip


@pytest.mark.parametrize(
    ("dataset", "write", "algorithm"),
    [
        ("miniimagenet", write_ren_mini, "maml"),
        ("cifarfs", folder_writer(32), "mamlpp"),
        ("fc100", folder_writer(32), "anil"),
    ],
)
def test_a_short_run_writes_results_and_resumes(tmp_path: Path, monkeypatch, dataset, write, algorithm) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    write(data, {"fc100": (60, 20, 20)}.get(dataset, (64, 16, 20)), per_class=2)
    out = tmp_path / "run"
    args = ["--dataset", dataset, "--data", str(data), "--algorithm", algorithm, "--out", str(out), *SHORT]
    fit.main(images.run, args)
    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == "images" and results["config"]["dataset"] == dataset
    assert results["data"]["classes"] == list({"fc100": (60, 20, 20)}.get(dataset, (64, 16, 20)))
    assert set(results["test"]) == {"1step", "2step"} and results["test"]["1step"]["tasks"] == 4
    if algorithm == "maml":
        fit.main(images.run, [*args, "--resume", "--iterations", "3"])
        assert json.loads((out / "results.json").read_text())["iterations"] == 3


def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MINIIMAGENET_DIR", raising=False)
    for argv, said in (
        ([], "no data: pass --data PATH (the mini-ImageNet files"),
        (["--data", str(tmp_path)], "holds none of the mini-ImageNet layouts"),
        (["--clip-meta-grad", "-1", "--data", str(tmp_path)], "--clip-meta-grad -1 must be"),
    ):
        with pytest.raises(SystemExit) as e:
            fit.main(images.run, [*argv, "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and said in err and "\n" not in err
