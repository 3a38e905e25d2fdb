"""Tasks per second of tasks.MiniImageNet's sampler against learn2learn's TaskDataset, on the same files.

    .venv/bin/python -m benchmarks.image_sampling                      # synthetic Ren et al. pickles
    .venv/bin/python -m benchmarks.image_sampling --data $MINIIMAGENET_DIR --per-class 600

Both read Ren et al.'s ``mini-imagenet-cache-train.pkl`` (the layout learn2learn's MiniImagenet
reads): --data when given, else one written into a temporary folder with --per-class random
84x84 images for each of the 64 train classes (the real split has 600). Timed: meta-batches of
--meta-batch 5-way 1-shot tasks with 15 query images per class (the MAML protocol), on the CPU,
as uint8 -> float [0, 1] batches (ours) and learn2learn's float tasks (NWays, KShots, LoadData,
RemapLabels, ConsecutiveLabels, as its examples build them). Writes
results/benchmarks/image_sampling.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make the repository's packages importable
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tasks  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.sampling import median_seconds  # noqa: E402

OUT = REPO / "results" / "benchmarks" / "image_sampling.json"


def write_train_pickle(folder: Path, per_class: int) -> None:
    """Ren et al.'s train pickle of 64 classes of ``per_class`` random 84x84 images (and empty val/test stubs)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64 * per_class, 84, 84, 3), dtype=np.uint8)
    class_dict = {f"n{c:08d}": list(range(c * per_class, (c + 1) * per_class)) for c in range(64)}
    with open(folder / "mini-imagenet-cache-train.pkl", "wb") as f:
        pickle.dump({"image_data": images, "class_dict": class_dict}, f, protocol=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=None, help="a folder holding mini-imagenet-cache-train.pkl (default: synthetic)"
    )
    parser.add_argument("--per-class", type=int, default=100, help="synthetic images per class (default: %(default)s)")
    parser.add_argument("--meta-batch", type=int, default=4, help="tasks per meta-batch (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=30, help="timed meta-batches per sampler (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON file written (default: %(default)s)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.data) if args.data else Path(tmp)
        if not args.data:
            write_train_pickle(folder, args.per_class)
        t0 = time.perf_counter()
        ours = tasks.MiniImageNet(folder, "train", cache_dir=Path(tmp) / "cache")
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = tasks.MiniImageNet(folder, "train", cache_dir=Path(tmp) / "cache")
        warm = time.perf_counter() - t0
        sampler = ours.sampler(5, 1, 15)
        g = torch.Generator().manual_seed(0)
        ours_s = median_seconds(lambda: sampler.sample(args.meta_batch, g), args.repeats, torch.device("cpu"))

        import learn2learn as l2l

        t0 = time.perf_counter()
        dataset = l2l.data.MetaDataset(l2l.vision.datasets.MiniImagenet(str(folder), mode="train"))
        l2l_load = time.perf_counter() - t0
        taskset = l2l.data.TaskDataset(
            dataset,
            task_transforms=[
                l2l.data.transforms.NWays(dataset, 5),
                l2l.data.transforms.KShots(dataset, 1 + 15),
                l2l.data.transforms.LoadData(dataset),
                l2l.data.transforms.RemapLabels(dataset),
                l2l.data.transforms.ConsecutiveLabels(dataset),
            ],
            num_tasks=-1,
        )
        l2l_s = median_seconds(
            lambda: [taskset.sample() for _ in range(args.meta_batch)], args.repeats, torch.device("cpu")
        )
    result = {
        "data": args.data or f"synthetic Ren et al. train pickle, 64 classes x {args.per_class} images of 84x84",
        "task": f"5-way 1-shot, 15 query per class, meta-batch {args.meta_batch}, CPU",
        "ours": {
            "tasks_per_second": args.meta_batch / ours_s,
            "ms_per_meta_batch": 1e3 * ours_s,
            "cold_load_s": cold,
            "warm_load_s": warm,
        },
        "learn2learn": {
            "tasks_per_second": args.meta_batch / l2l_s,
            "ms_per_meta_batch": 1e3 * l2l_s,
            "load_s": l2l_load,
        },
        "speedup": l2l_s / ours_s,
    }
    argv_used = sys.argv[1:] if argv is None else argv
    write_report(args.out, "image_sampling", argv_used, "cpu", torch.get_num_threads(), **result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
