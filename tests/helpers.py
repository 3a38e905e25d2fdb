"""What the tests share: small float64 models and meta-batches for the engine, a finite-difference check, the
real Omniglot archives, small image data sets written on the fly, and running the experiment scripts."""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

import maml

DTYPE = torch.float64


@dataclass(frozen=True)
class Case:
    """A model family with a matching meta-batch and loss; ``finish`` edits both after they are drawn."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], maml.TaskBatch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    finish: Callable[[nn.Module, maml.TaskBatch], tuple[nn.Module, maml.TaskBatch]] | None = None


def regression_batch(
    g: torch.Generator, tasks: int = 3, n: int = 5, features: int = 3, outputs: int = 1
) -> maml.TaskBatch:
    def x() -> Tensor:
        return torch.randn(tasks, n, features, generator=g, dtype=DTYPE)

    def y() -> Tensor:
        return torch.randn(tasks, n, outputs, generator=g, dtype=DTYPE)

    return maml.TaskBatch(x(), y(), x(), y())


def image_batch(
    g: torch.Generator, tasks: int = 3, ways: int = 3, shots: int = 2, query: int = 3, side: int = 8
) -> maml.TaskBatch:
    def split(per_class: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(tasks, ways * per_class, 1, side, side, generator=g, dtype=DTYPE)
        y = torch.arange(ways).repeat_interleave(per_class).expand(tasks, -1).contiguous()
        return x, y

    return maml.TaskBatch(*split(shots), *split(query))


def _conv(norm: Callable[[int], nn.Module]) -> nn.Module:
    # Two conv blocks on 8x8 images: 8 -> 4 -> 2 after pooling.
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        norm(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1),
        norm(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _mlp(norm: Callable[[int], nn.Module] | None = None) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(3, 16)]
    if norm is not None:
        layers.append(norm(16))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


CASES: dict[str, Case] = {
    "mlp": Case(lambda: _mlp(), regression_batch, F.mse_loss),
    "mlp_layernorm": Case(lambda: _mlp(nn.LayerNorm), regression_batch, F.mse_loss),
    "mlp_batchnorm1d": Case(
        lambda: _mlp(lambda c: nn.BatchNorm1d(c, track_running_stats=False)), regression_batch, F.mse_loss
    ),
    "conv_batchnorm_maxpool": Case(
        lambda: _conv(lambda c: nn.BatchNorm2d(c, track_running_stats=False)), image_batch, F.cross_entropy
    ),
    "conv_groupnorm": Case(lambda: _conv(lambda c: nn.GroupNorm(2, c)), image_batch, F.cross_entropy),
    "conv_instancenorm": Case(lambda: _conv(lambda c: nn.InstanceNorm2d(c, affine=True)), image_batch, F.cross_entropy),
}


def make(case: str, seed: int = 0) -> tuple[nn.Module, maml.TaskBatch, Callable[[Tensor, Tensor], Tensor]]:
    """A float64 model (random init from ``seed``), a meta-batch and the loss of ``case``."""
    return build_case(CASES[case], seed)


def build_case(c: Case, seed: int = 0) -> tuple[nn.Module, maml.TaskBatch, Callable[[Tensor, Tensor], Tensor]]:
    """``c``'s float64 model at a generic point (its defaults perturbed), its meta-batch and its loss."""
    torch.manual_seed(seed)
    model = perturbed(c.build())
    batch = c.batch(torch.Generator().manual_seed(seed + 1))
    return (model, batch, c.loss_fn) if c.finish is None else (*c.finish(model, batch), c.loss_fn)


def perturbed(model: nn.Module) -> nn.Module:
    """``model`` in float64 at a generic point: its defaults perturbed (from torch's global generator), so that norm
    affine parameters are not exactly 1/0."""
    model = model.to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


# The exact execution paths beside eager second order with vmap (learner options), for tests that hold
# a feature to the same meta-gradient in every one of them.
EXACT_PATHS = [
    pytest.param({"batching": "loop"}, id="loop"),
    pytest.param({"mode": "checkpointed"}, id="checkpointed"),
    pytest.param({"mode": maml.Checkpointed(every=2)}, id="checkpointed-every2"),
    pytest.param({"mode": maml.Checkpointed(hvp="forward_over_reverse")}, id="checkpointed-fwd"),
    pytest.param({"mode": maml.Checkpointed(every=2, hvp="forward_over_reverse")}, id="checkpointed-fwd-every2"),
    pytest.param({"compile": True}, id="compiled"),
]


def flat_grad(learner: maml.MetaLearner, batch: maml.TaskBatch) -> Tensor:
    """The meta-gradient with respect to every meta-parameter, flattened into one vector."""
    params = list(learner.parameters())
    grads = torch.autograd.grad(learner.meta_loss(batch), params)
    return torch.cat([g.flatten() for g in grads])


def finite_difference_error(
    learner: maml.MetaLearner, batch: maml.TaskBatch, directions: int = 3, seed: int = 0
) -> float:
    """:func:`directional_error` of a learner's meta-gradient, over all its meta-parameters (model
    parameters and learnable inner rates)."""
    return directional_error(lambda: learner.meta_loss(batch), list(learner.parameters()), directions, seed)


def directional_error(
    loss_at: Callable[[], Tensor], params: list[Tensor], directions: int = 3, seed: int = 0, *, order: int = 2
) -> float:
    """Worst relative error of ``<grad, v>`` against central differences of ``loss_at()`` along random
    directions v over ``params`` (the one finite-difference checker of the tests).

    ``loss_at`` is called once with gradients on (the gradient under test), then under ``torch.no_grad()``
    for values alone. ReLU and max-pool make a meta-loss piecewise smooth, so a difference whose step
    crosses a kink is wrong whatever the gradient; the step shrinks until two differences agree (from
    function values alone, never from the gradient under test). ``order=4``: the fourth-order stencil,
    from larger steps, for losses curved at the scale of a step (Adam's update where a gradient is small).
    """
    loss = loss_at()
    grads = torch.autograd.grad(loss, params)
    g = torch.Generator().manual_seed(seed)
    # A central difference carries the rounding of the losses it subtracts, about eps_float * |L| / step:
    # two steps agree at best to that (a kink that forces the step down to 1e-7 leaves ~1e-9 of noise).
    rounding = 8 * torch.finfo(loss.dtype).eps * abs(float(loss.detach()))
    steps = (1e-5, 1e-6, 1e-7) if order == 2 else (1e-4, 3e-5, 1e-5, 3e-6, 1e-6)

    def value(v: list[Tensor], step: float) -> float:
        with torch.no_grad():
            for p, vi in zip(params, v):
                p.add_(step * vi)
            try:
                return float(loss_at().detach())
            finally:
                for p, vi in zip(params, v):
                    p.sub_(step * vi)

    def central(v: list[Tensor], h: float) -> float:
        if order == 2:
            return (value(v, h) - value(v, -h)) / (2 * h)
        return (8 * (value(v, h) - value(v, -h)) - (value(v, 2 * h) - value(v, -2 * h))) / (12 * h)

    worst = 0.0
    for _ in range(directions):
        v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
        analytic = sum(float((gi * vi).sum()) for gi, vi in zip(grads, v))
        for h in steps:
            coarse, fine = central(v, h), central(v, h / 2)
            if abs(coarse - fine) <= 1e-8 * max(abs(fine), 1e-12) + rounding / h:
                break
        else:
            raise AssertionError("central differences did not converge: the loss is not smooth here")
        worst = max(worst, abs(analytic - fine) / max(abs(fine), 1e-12))
    return worst


REPO = Path(__file__).resolve().parent.parent


def omniglot_root() -> Path:
    """The real Omniglot archives, in $OMNIGLOT_DIR (.ci/run sets it). Missing data fails, never skips."""
    if not os.environ.get("OMNIGLOT_DIR"):
        pytest.fail(
            "OMNIGLOT_DIR is not set; set it to the folder holding images_background_small1.zip and "
            "images_background_small2.zip (github.com/brendenlake/omniglot).",
            pytrace=False,
        )
    root = Path(os.environ["OMNIGLOT_DIR"])
    archives = ("images_background_small1.zip", "images_background_small2.zip")
    missing = [a for a in archives if not (root / a).is_file()]
    if missing:
        pytest.fail(
            f"the real Omniglot archives {missing} are not in {root}; set OMNIGLOT_DIR to the folder "
            f"holding them (CI: .ci/run sets it).",
            pytrace=False,
        )
    return root


# ---------------------------------------------------------------- the experiment scripts

# A fixed batching: "auto" times both, and two fresh runs compared to the bit must batch alike.
SMALL_SINE = [
    "--compile",
    "false",
    "--batching",
    "vmap",
    "--hidden",
    "8",
    "--eval-tasks",
    "20",
    "--val-tasks",
    "10",
    "--eval-query",
    "20",
]


def env(tmp_path: Path) -> dict[str, str]:
    """A subprocess environment that keeps wandb offline, local and fast."""
    return {
        **os.environ,
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # any stray network call fails at once
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_SILENT": "true",
        "MAML_CACHE_DIR": str(tmp_path / "cache"),
    }


def script(module: str, args: list[str], tmp_path: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def finished(proc: subprocess.Popen, code: int = 0) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err[-3000:]
    return out


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def assert_logged(out: Path, history: list[dict], summary: dict[str, float]) -> None:
    """``out/metrics.jsonl`` holds exactly the rows the script kept, ``results.json`` the summary's test metrics
    (``test/{metric}_{key}``, as wandb's summary names them), and wandb logged one offline run under ``out``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == history
    test = json.loads((out / "results.json").read_text())["test"]
    for key, value in summary.items():
        metric, entry = key.removeprefix("test/").split("_", 1)
        assert test[entry][metric] == pytest.approx(value, rel=1e-12)
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


# A sine run of a few iterations: 2 tasks per meta-batch, a 1-8-8-1 net, 4 validation and 4 test tasks.
# A fixed batching: "auto" times both, and two fresh runs compared to the bit must batch alike.
TINY = [
    "--compile",
    "false",
    "--batching",
    "vmap",
    "--meta-batch",
    "2",
    "--hidden",
    "8",
    "--val-tasks",
    "4",
    "--eval-tasks",
    "4",
    "--eval-query",
    "5",
    "--eval-shots",
    "5",
    "--eval-steps",
    "1",
]


def run_sine(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 0, module: Any = None) -> str:
    """Runs an experiment script (``module``, the sine script by default) in this process, wandb disabled unless
    ``args`` say otherwise; returns its stderr."""
    from experiments import sine
    from experiments.harness.lifecycle import main

    module = module or sine
    try:
        main(module.run, [*(TINY if module is sine else []), "--wandb", "disabled", *args])
        rc: int | str | None = 0
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == code, err[-3000:]
    return err


# A sine run of a few iterations that fails before it trains or diverges: 4 tasks per meta-batch, a 1-8-8-1 net,
# 4 validation and 4 test tasks of 10 query points, wandb disabled.
TINY_SINE = [
    "--compile",
    "false",
    "--hidden",
    "8",
    "--val-tasks",
    "4",
    "--eval-tasks",
    "4",
    "--eval-query",
    "10",
    "--meta-batch",
    "4",
    "--wandb",
    "disabled",
]


def exits(capsys: pytest.CaptureFixture[str], run, argv: list[str], code: int) -> str:
    """Runs a script in-process; returns its stderr, which must be one line, after checking the exit code."""
    from experiments.harness.lifecycle import main

    with pytest.raises(SystemExit) as exit_:
        main(run, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.rstrip("\n")


def one_error(err: str) -> str:
    """The one line a usage or environment error prints, last (after any progress lines); no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err[-3000:]
    assert not [line for line in lines[:-1] if not line.startswith("meta-train ")], err[-3000:]
    return lines[-1]


def says(line: str, lead: str, *fixes: str) -> None:
    """An error line names ``lead`` first and holds each of ``fixes``: what a message must say, not its wording."""
    assert "\n" not in line.rstrip("\n") and line.startswith(f"error: {lead}"), line
    for fix in fixes:
        assert fix in line, (fix, line)


# ---------------------------------------------------------------- image data sets

SPLITS = ("train", "val", "test")


def random_images(n: int, side: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def split_data(counts: tuple[int, ...], split: str, side: int, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """``per_class`` random images of each class of ``split``; labels global over splits (as MetaOptNet's)."""
    s = SPLITS.index(split)
    first = sum(counts[:s])
    labels = np.repeat(np.arange(first, first + counts[s]), per_class)
    return random_images(labels.size, side, seed=s), labels


def image_bytes(image: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt)
    return out.getvalue()


def write_ren_mini(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
    for split in SPLITS:
        images, labels = split_data(counts, split, 84, per_class)
        class_dict = {f"n{c:08d}": np.flatnonzero(labels == c).tolist() for c in np.unique(labels)}
        with open(root / f"mini-imagenet-cache-{split}.pkl", "wb") as f:
            pickle.dump({"image_data": images, "class_dict": class_dict}, f)


def write_csv(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
    """Ravi and Larochelle's layout: ``<split>.csv`` (``filename,label``) beside ``images/`` of JPEGs."""
    (root / "images").mkdir()
    for split in SPLITS:
        images, labels = split_data(counts, split, 84, per_class)
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["filename", "label"])
            for i, (image, label) in enumerate(zip(images, labels)):
                name = f"n{label:08d}{i:08d}.jpg"
                (root / "images" / name).write_bytes(image_bytes(image, "JPEG"))
                w.writerow([name, f"n{label:08d}"])


def write_ren_tiered(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
    """Ren et al.'s tieredImageNet: ``<split>_images_png.pkl`` (PNG bytes as uint8 arrays) and ``<split>_labels.pkl``."""
    for split in SPLITS:
        images, labels = split_data(counts, split, 84, per_class)
        names = [f"n{c:08d}" for c in np.unique(labels)]  # WordNet ids, distinct over the splits
        labels = labels - labels.min()  # Ren's labels count from 0 in each split, and name a class by its id
        with open(root / f"{split}_images_png.pkl", "wb") as f:
            pickle.dump([np.frombuffer(image_bytes(im), dtype=np.uint8) for im in images], f)
        with open(root / f"{split}_labels.pkl", "wb") as f:
            pickle.dump({"label_specific": labels, "label_specific_str": names}, f)


def folder_writer(side: int) -> Callable[..., None]:
    def write(root: Path, counts: tuple[int, ...], per_class: int = 2) -> None:
        for split in SPLITS:
            images, labels = split_data(counts, split, side, per_class)
            for i, (image, label) in enumerate(zip(images, labels)):
                folder = root / split / f"n{label:08d}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{i}.png").write_bytes(image_bytes(image))

    return write


def uncompressed_png(image: np.ndarray) -> bytes:
    """``image`` as a PNG without compression: its size depends on the image's shape and mode alone."""
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def replace_keeping_size_and_time(path: Path, data: bytes) -> None:
    """Writes ``data`` over ``path`` as ``cp -p`` (``shutil.copy2``) does, keeping its size and modification time."""
    before = path.stat()
    assert len(data) == before.st_size, "the replacement must have the size of the file it replaces"
    source = path.with_name(f".{path.name}.new")
    source.write_bytes(data)
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    shutil.copy2(source, path)
    source.unlink()
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


# ---------------------------------------------------------------- Meta-Dataset's sets

JPEG_MODES = ("RGB", "L", "CMYK")  # JPEG's modes; L (grayscale) and CMYK come out RGB


def jpeg(i: int, mode: str | None = None, size: tuple[int, int] | None = None) -> bytes:
    """A small JPEG of varied size and mode (the ``i``-th of a copy)."""
    size = size or (40 + 7 * (i % 5), 32 + 5 * (i % 4))
    rng = np.random.default_rng(i)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(
        mode or JPEG_MODES[i % 3]
    )
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_cub(root: Path, duplicates: dict[str, list[str]] | None = None) -> Path:
    """``root/CUB_200_2011/`` as the archive extracts: images/<class>/<file>.jpg, images.txt, bounding_boxes.txt.

    Two images a class (three in the first class of each split), and ``duplicates`` (class -> ImageNet duplicates'
    file names) besides.
    """
    from tasks._src.cub import CLASS_SPLITS

    base = root / "CUB_200_2011"
    listed = []
    for split in SPLITS:
        for c, name in enumerate(CLASS_SPLITS[split]):
            files = [f"{name.split('.', 1)[1]}_{k:04d}_1.jpg" for k in range(3 if c == 0 else 2)]
            files += (duplicates or {}).get(name, [])
            for file in files:
                listed.append(f"{name}/{file}")
    for i, name in enumerate(listed):
        path = base / "images" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg(i))
    (base / "images.txt").write_text("".join(f"{i} {name}\n" for i, name in enumerate(listed, 1)))
    (base / "bounding_boxes.txt").write_text("".join(f"{i} 2.0 3.0 20.0 15.0\n" for i in range(1, len(listed) + 1)))
    return base


def drawings(c: int, n: int) -> np.ndarray:
    """``n`` drawings of class ``c`` (its place in its split): pixel 0 holds the row, pixel 1 the class, the rest a
    constant of both, so each drawing is known by its pixels."""
    out = np.empty((n, 784), dtype=np.uint8)
    rows = np.arange(n)
    out[:] = ((rows * 7 + c * 3) % 251 + 1)[:, None]
    out[:, 0] = rows % 256
    out[:, 1] = c
    return out


def write_quickdraw(folder: Path, per_class: int = 4, big: dict[str, int] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    from tasks._src.quickdraw import CLASSES

    for names in CLASSES.values():
        for c, name in enumerate(names):
            np.save(folder / f"{name}.npy", drawings(c, (big or {}).get(name, per_class)))
    return folder
