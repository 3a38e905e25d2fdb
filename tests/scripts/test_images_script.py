"""experiments.images: its default is cbfinn/maml's mini-ImageNet protocol; a short run writes results.json."""

from __future__ import annotations

import json
import math
import shutil
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    folder_writer,
    random_images,
    replace_keeping_size_and_time,
    says,
    uncompressed_png,
    write_cub,
    write_quickdraw,
    write_ren_mini,
)
from torch import nn

import maml
import tasks
from experiments import fewshot, images, omniglot
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
    one = images.ImagesConfig(**recipes.recipe(images.ImagesConfig, "mamlpp"), algorithm="mamlpp").resolved()
    assert (one.steps, one.inner_lr, one.meta_batch, one.iterations, one.loss, one.network) == (
        5, 0.01, 4, 75_000, "mean", "maxpool",
    )  # fmt: skip
    assert one.per_step_bn and one.learn_inner_lr == "per_layer_per_step" and one.first_order_fraction == 80 / 150
    five = images.ImagesConfig(**recipes.recipe(images.ImagesConfig, "mamlpp"), algorithm="mamlpp", shots=5).resolved()
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


def test_a_class_too_small_for_a_task_or_in_two_splits_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys):
    """Both ran to a results.json that counted 64/16/20 classes: one trained on fewer, one tested on val classes."""
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    folder_writer(32)(data, (64, 16, 20), per_class=2)
    args = ["--dataset", "cifarfs", "--data", str(data), "--out", str(tmp_path / "run"), *SHORT]

    def refused() -> str:
        with pytest.raises(SystemExit) as e:
            fit.main(images.run, args)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and not (tmp_path / "run" / "results.json").exists(), err
        return err

    image = data / "train" / "n00000005" / "10.png"
    kept = image.read_bytes()
    image.unlink()  # one image left: 1 shot + 1 query cannot be drawn from it
    assert "--shots 1 --query 1, the train split: " in (err := refused())
    assert "2 distinct images are needed per class, but class n00000005 (label 5) has 1, the smallest" in err
    image.write_bytes(kept)
    shutil.rmtree(data / "test" / "n00000099")
    shutil.copytree(data / "val" / "n00000064", data / "test" / "n00000064")  # a validation class in the test split
    assert "class n00000064 is in the val split (val) and in the test split (test)" in refused()


def test_cifarfs_on_mini_imagenet_folders_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    """Both have 64/16/20 classes: mini-ImageNet's 84-pixel class folders trained as CIFAR-FS, shrunk to 32 pixels."""
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    folder_writer(84)(data, (64, 16, 20), per_class=1)
    with pytest.raises(SystemExit) as e:
        fit.main(images.run, ["--dataset", "cifarfs", "--data", str(data), "--out", str(tmp_path / "run"), *SHORT])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and not (tmp_path / "run" / "results.json").exists(), err
    assert f"{data / 'train' / 'n00000000' / '0.png'} is 84x84 pixels, not 32x32" in err


def test_the_final_test_holds_one_chunk_of_tasks_at_a_time_and_scores_the_same(tmp_path: Path) -> None:
    """Every chunk of the 600 tasks was drawn before any was evaluated: --eval-chunk bounded nothing (5.16 GB peak)."""
    images_ = torch.randint(0, 256, (10 * 6, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    sampler = tasks.FewShotSampler(images_, torch.arange(10).repeat_interleave(6), 3, 1, 2)
    live, most = [0], [0]

    class Counted:
        def sample(self, n, g, device=None):
            batch = sampler.sample(n, g, device=device)
            live[0] += 1
            weakref.finalize(batch.query_x, lambda: live.__setitem__(0, live[0] - 1))
            return batch

    def run(batch, steps):  # a stand-in model: logits from the pixels and the steps, so that tasks score apart
        most[0] = max(most[0], live[0])
        return types.SimpleNamespace(
            query_out=batch.query_x.flatten(2)[..., : 3 * steps].reshape(*batch.query_y.shape, steps, 3).sum(-2)
        )

    cfg = types.SimpleNamespace(seed=3, eval_tasks=23, eval_chunk=5, eval_steps=(1, 2))
    results = fewshot.evaluate(run, Counted(), cfg, torch.device("cpu"))
    assert most[0] == 1  # was 5, every chunk
    g = torch.Generator().manual_seed(cfg.seed + 20_000)
    chunks = [sampler.sample(min(5, 23 - i), g) for i in range(0, 23, 5)]  # as it was: all drawn, then evaluated
    for steps in cfg.eval_steps:
        acc = torch.cat([fewshot.accuracy(run(b, steps).query_out, b.query_y) for b in chunks])
        assert results[f"{steps}step"]["tasks"] == 23
        assert results[f"{steps}step"]["accuracy"] == fewshot.mean_ci95(acc)[0]


@pytest.mark.parametrize("change", ["image-added", "image-rewritten-at-its-size-and-time"])
def test_resume_with_the_same_data_path_refuses_files_changed_in_place(
    tmp_path: Path, monkeypatch, capsys, change: str
) -> None:
    """The same --data path was never compared: data changed between the run and the resume went unnoticed; then
    names and sizes were, and an image rewritten at its size (which the cache decodes again) went on unnoticed."""
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    data, out = tmp_path / "data", tmp_path / "run"
    folder_writer(32)(data, (64, 16, 20), per_class=2)
    image = data / "train" / "n00000005" / "10.png"
    image.write_bytes(uncompressed_png(random_images(1, 32, seed=1)[0]))  # of a size another image can have
    args = ["--dataset", "cifarfs", "--data", str(data), "--out", str(out), *SHORT]
    fit.main(images.run, args)
    capsys.readouterr()
    fit.main(images.run, [*args, "--resume", "--iterations", "3"])  # unchanged: resumed
    assert json.loads((out / "results.json").read_text())["iterations"] == 3
    capsys.readouterr()
    if change == "image-added":
        shutil.copy(image, image.with_name("99.png"))
    else:  # as cp -p or rsync -a replace it
        replace_keeping_size_and_time(image, uncompressed_png(random_images(1, 32, seed=2)[0]))
    with pytest.raises(SystemExit) as e:
        fit.main(images.run, [*args, "--resume", "--iterations", "4"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    says(err, "--resume", f"--data {data}", "put them back", "--overwrite")
    assert json.loads((out / "results.json").read_text())["iterations"] == 3


def test_a_run_meta_trains_on_one_set_and_tests_on_another(tmp_path: Path, monkeypatch, capsys) -> None:
    """Across domains (--test-dataset): the final test draws from the other set's test split, and results.json, the
    summary and the run's name say both; no path of this machine is recorded."""
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    trained, tested = tmp_path / "cifarfs", tmp_path / "fc100"
    folder_writer(32)(trained, (64, 16, 20), per_class=2)
    folder_writer(32)(tested, (60, 20, 20), per_class=2)
    out = tmp_path / "run"
    args = ["--dataset", "cifarfs", "--data", str(trained), "--test-dataset", "fc100", "--test-data", str(tested)]
    fit.main(images.run, [*args, "--out", str(out), *SHORT])
    results = json.loads((out / "results.json").read_text())
    assert (results["data"]["dataset"], results["data"]["test_dataset"]) == ("CIFAR-FS", "FC100")
    assert results["data"]["classes"] == [64, 16, 20] and results["test"]["1step"]["tasks"] == 4
    assert results["config"]["test_data"] == "fc100" and str(tmp_path) not in (out / "results.json").read_text()
    assert "of held-out FC100 classes (meta-trained on CIFAR-FS)" in capsys.readouterr().out


def test_a_test_set_of_another_image_size_or_without_its_data_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FC100_DIR", raising=False)
    data, small = tmp_path / "mini", tmp_path / "fc100"
    data.mkdir()
    write_ren_mini(data, (64, 16, 20), per_class=2)
    folder_writer(32)(small, (60, 20, 20), per_class=2)
    for argv, said in (
        (["--test-dataset", "fc100", "--test-data", str(small)],
         "error: --test-dataset fc100: its images are 3-channel 32x32, and the network trained on miniimagenet takes "
         "3-channel 84x84; test on a set of the same image size."),
        (["--test-dataset", "fc100"],
         "error: --test-dataset fc100: no test data: pass --test-data PATH (the FC100 files in a layout of "
         "docs/data.md) or set $FC100_DIR."),
        (["--test-data", str(small)], f"error: --test-data {small} names no set to test on: pass --test-dataset too."),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            fit.main(images.run, ["--data", str(data), *argv, "--out", str(tmp_path / "run"), *SHORT])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err == said and not (tmp_path / "run" / "results.json").exists(), err


def test_mini_imagenet_to_cub_end_to_end(tmp_path: Path, monkeypatch, capsys) -> None:
    """The usual cross-domain protocol, on copies in the sets' real layouts: meta-trained on mini-ImageNet (Ren et
    al.'s pickles), tested on CUB-200-2011's test classes (Caltech's archive extracted), both 84x84 RGB."""
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    mini = tmp_path / "mini"
    mini.mkdir()
    write_ren_mini(mini, (64, 16, 20), per_class=2)
    cub = write_cub(tmp_path / "cub")
    out = tmp_path / "run"
    args = ["--data", str(mini), "--test-dataset", "cub", "--test-data", str(cub), "--out", str(out), *SHORT]
    fit.main(images.run, args)
    results = json.loads((out / "results.json").read_text())
    assert (results["data"]["dataset"], results["data"]["test_dataset"]) == ("mini-ImageNet", "CUB-200-2011")
    assert results["data"]["classes"] == [64, 16, 30] and results["data"]["test_layout"] == "extracted"
    assert "held-out CUB-200-2011 classes (meta-trained on mini-ImageNet)" in capsys.readouterr().out


def test_quick_draw_trains_one_channel_at_28_pixels(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    data = write_quickdraw(tmp_path / "quickdraw")
    out = tmp_path / "run"
    fit.main(images.run, ["--dataset", "quickdraw", "--data", str(data), "--out", str(out), *SHORT])
    results = json.loads((out / "results.json").read_text())
    assert results["data"]["dataset"] == "Quick Draw" and results["data"]["classes"] == [241, 52, 52]
    assert results["test"]["1step"]["tasks"] == 4


def test_a_meta_dataset_set_without_its_label_file_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    cub = write_cub(tmp_path / "cub")
    (cub / "images.txt").unlink()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        fit.main(images.run, ["--dataset", "cub", "--data", str(cub), "--out", str(out), *SHORT])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and not (out / "results.json").exists(), err
    assert err.startswith(f"error: --data {cub}: {cub} holds images of the extracted layout but not images.txt "), err
