"""What loading a Meta-Dataset set costs: decoding once (cold) against mapping the decoded cache (warm).

    python -m benchmarks.image_loads --json results/benchmarks/image_loads.json

CUB-200-2011 as Caltech's archive extracts (``CUB_200_2011/images/<class>/<file>.jpg`` with
``images.txt``), written into a temporary folder: its 200 classes of --per-class JPEGs of 500 x 375
random pixels (the real set: 11,788 images, about 59 a class, most near 500 x 375; 300 a class make
60,000, mini-ImageNet's count), each size read by
``tasks.CUB200.splits`` twice, in a fresh process each (the first decodes and writes the cache, the
second maps it). Quick Draw (``tasks.QuickDraw.splits``: 345 memory-mapped ``.npy`` files of
--drawings 28 x 28 drawings each) has no cache: its load opens the maps, in a fresh process.
Wall time, the process's threads as torch sets them (``decode_all`` decodes on up to 8 threads).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_cub", "write_quickdraw"]


def write_cub(root: Path, per_class: int) -> Path:
    """``root/CUB_200_2011`` with ``per_class`` random 500 x 375 JPEGs in each of the 200 classes."""
    from PIL import Image

    from tasks._src.cub import CLASS_SPLITS

    base = root / "CUB_200_2011"
    rng = np.random.default_rng(0)
    # A few distinct images, each saved under many names: the decode cost is the same, the writing much less.
    blobs = []
    for _ in range(8):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
        blobs.append(out.getvalue())
    listed = []
    for names in CLASS_SPLITS.values():
        for name in names:
            (base / "images" / name).mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                file = f"{name}/{name.split('.', 1)[1]}_{k:04d}_1.jpg"
                (base / "images" / file).write_bytes(blobs[len(listed) % len(blobs)])
                listed.append(file)
    (base / "images.txt").write_text("".join(f"{i} {file}\n" for i, file in enumerate(listed, 1)))
    return base


def write_quickdraw(root: Path, drawings: int) -> Path:
    """``root`` with the 345 classes' ``.npy`` files of ``drawings`` random 28 x 28 bitmaps each."""
    from tasks._src.quickdraw import CLASSES

    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (drawings, 784), dtype=np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    for names in CLASSES.values():
        for name in names:
            np.save(root / f"{name}.npy", block)
    return root


def _load(kind: str, folder: str, cache: str) -> dict[str, Any]:
    """In this process: the time ``kind``'s three splits take to load from ``folder``."""
    import tasks

    start = time.perf_counter()
    if kind == "cub":
        splits = tasks.CUB200.splits(folder, cache_dir=cache)
    else:
        splits = tasks.QuickDraw.splits(folder)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "images": sum(len(p) for p in splits),
        "from_cache": all(getattr(p, "from_cache", False) for p in splits),
    }


def _fresh(kind: str, folder: Path, cache: Path) -> dict[str, Any]:
    child = [sys.executable, "-m", "benchmarks.image_loads", "--json", "-", "--child", kind, str(folder), str(cache)]
    return json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--per-class", type=int, nargs="+", default=[59, 300], help="CUB's JPEGs a class, each a row")
    parser.add_argument("--drawings", type=int, default=10_000, help="Quick Draw's drawings a class")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # one fresh process's load
    args = parser.parse_args()
    if args.child:
        json.dump(_load(*args.child), sys.stdout)
        return
    import torch

    from benchmarks.report import write_report

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for per_class in args.per_class:
            cub, cache = write_cub(Path(tmp) / f"cub{per_class}", per_class), Path(tmp) / f"cache{per_class}"
            cold, warm = _fresh("cub", cub, cache), _fresh("cub", cub, cache)
            assert not cold["from_cache"] and warm["from_cache"], (cold, warm)
            row = {
                "set": "CUB-200-2011",
                "images": cold["images"],
                "cold_s": cold["seconds"],
                "warm_s": warm["seconds"],
            }
            rows.append(row)
        draw = write_quickdraw(Path(tmp) / "quickdraw", args.drawings)
        opened = _fresh("quickdraw", draw, Path(tmp))
        rows.append({"set": "Quick Draw", "images": opened["images"], "cold_s": None, "warm_s": opened["seconds"]})
    for row in rows:
        print(row, flush=True)
    write_report(args.json, "image_loads", sys.argv[1:], "cpu", torch.get_num_threads(), rows=rows)


if __name__ == "__main__":
    main()
