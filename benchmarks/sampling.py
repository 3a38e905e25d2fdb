"""Is task sampling ever the bottleneck of a meta-training step? Prints load, sampling and step times.

    .venv/bin/python -m benchmarks.sampling            # or: .venv/bin/python benchmarks/sampling.py
    .venv/bin/python -m benchmarks.sampling --data /path/to/omniglot --device cuda

Measures, on the real Omniglot archives (--data, else $OMNIGLOT_DIR):
  * the cold load of every archive under --data (decoding into a fresh cache folder) and the
    warm load (from that cache);
  * the median time to sample a meta-batch of 32 Omniglot 5-way 1-shot tasks with 15 query
    images each, and of 25 sine tasks with 10 support and 10 query points;
  * the median time of one meta-training step (meta_loss, backward, Adam step) of
    maml.MetaLearner on such a batch, with the MAML networks (second order, one inner step),
    batching "loop" and "vmap" (--batching; by default only "loop" for the conv net on the CPU);
and the ratio of sampling time to the faster step, which must stay below 5 %.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make the repository's packages importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import maml  # noqa: E402
import tasks  # noqa: E402

LIMIT = 0.05


def omniglot_net(ways: int) -> nn.Module:
    """The MAML Omniglot network: 4 x (3x3 conv 64, batch norm, ReLU, 2x2 max-pool), then linear."""
    layers: list[nn.Module] = []
    for c_in in (1, 64, 64, 64):
        layers += [
            nn.Conv2d(c_in, 64, 3, padding=1),
            nn.BatchNorm2d(64, track_running_stats=False),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, ways))


def sine_net() -> nn.Module:
    return nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_fn(learner: maml.MetaLearner, batch: maml.TaskBatch) -> Callable[[], None]:
    optimizer = torch.optim.Adam(learner.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        learner.meta_loss(batch).backward()
        optimizer.step()

    return step


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=os.environ.get("OMNIGLOT_DIR"), help="Omniglot archives or folders (default: $OMNIGLOT_DIR)"
    )
    parser.add_argument("--device", default="cpu", help="where batches and models live (default: %(default)s)")
    parser.add_argument("--sample-repeats", type=int, default=50, help="timed samplings per measure")
    parser.add_argument("--step-repeats", type=int, default=2, help="timed meta-training steps per measure")
    parser.add_argument(
        "--batching",
        choices=("auto", "loop", "vmap", "both"),
        default="auto",
        help="engine batchings to time; auto: both, except for the Omniglot conv net on the CPU, whose vmap "
        "step is several times slower than loop and would take minutes (default: %(default)s)",
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a ratio reaches 5 %%")
    args = parser.parse_args(argv)
    if args.data is None:
        print("--data: no Omniglot folder given and $OMNIGLOT_DIR is unset; pass --data PATH", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    chosen = {"auto": None, "both": ("loop", "vmap")}.get(args.batching, (args.batching,))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows: list[tuple[str, str]] = []

    with tempfile.TemporaryDirectory(prefix="omniglot-cache-") as cache_dir:
        start = time.perf_counter()
        omni = tasks.Omniglot(args.data, cache_dir=cache_dir)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        warm_omni = tasks.Omniglot(args.data, cache_dir=cache_dir)
        warm = time.perf_counter() - start
    if omni.from_cache or not warm_omni.from_cache:
        raise RuntimeError("the cold load read a cache or the warm load did not: the timings would be wrong.")
    rows.append((f"Omniglot cold load ({', '.join(omni.archives)}; decode + cache)", ms(cold)))
    rows.append(("Omniglot warm load (from the decoded cache)", ms(warm)))
    rows.append(("  loaded", f"{len(omni.characters)} characters, {omni.num_classes} classes with rotations"))

    sampler = omni.sampler(ways=5, shots=1, query=15)
    sine = tasks.Sine()
    # (name, sample, network, loss, inner rate, batchings under "auto", timed steps)
    cases = [
        (
            "Omniglot 32 tasks 5-way 1-shot 15-query",
            lambda: sampler.sample(32, g, device=device),
            lambda: omniglot_net(5),
            nn.functional.cross_entropy,
            0.4,
            ("loop", "vmap") if device.type == "cuda" else ("loop",),
            args.step_repeats,
        ),
        (
            "Sine 25 tasks 10-shot 10-query",
            lambda: sine.sample(25, shots=10, query=10, generator=g, device=device),
            sine_net,
            nn.functional.mse_loss,
            0.01,
            ("loop", "vmap"),
            10 * args.step_repeats,  # a step takes milliseconds: more repeats for a stable median
        ),
    ]
    verdicts = []
    for name, sample, make_net, loss_fn, inner_lr, auto, step_repeats in cases:
        sampling = median_seconds(sample, args.sample_repeats, device, warmup=3)
        rows.append((f"{name}: sampling (median of {args.sample_repeats})", ms(sampling)))
        batch = sample()
        steps = {}
        for batching in chosen or auto:
            learner = maml.MetaLearner(make_net().to(device), loss_fn, inner_lr=inner_lr, steps=1, batching=batching)
            steps[batching] = median_seconds(step_fn(learner, batch), step_repeats, device)
            rows.append((f"{name}: meta-training step, {batching} (median of {step_repeats})", ms(steps[batching])))
        fastest = min(steps, key=steps.__getitem__)
        ratio = sampling / steps[fastest]
        verdicts.append(ratio < LIMIT)
        verdict = "< 5 %: ok" if ratio < LIMIT else ">= 5 %: TOO SLOW"
        rows.append((f"{name}: sampling / fastest step ({fastest})", f"{ratio:10.2%}  {verdict}"))

    width = max(len(r[0]) for r in rows)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"{'measure'.ljust(width)} | time")
    print(f"{'-' * width}-+-{'-' * 28}")
    for label, value in rows:
        print(f"{label.ljust(width)} | {value.strip() if label.startswith('  ') else value}")
    return 1 if args.check and not all(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
