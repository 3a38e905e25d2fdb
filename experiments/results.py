"""What a run reports: the test metrics with their 95 % confidence intervals, in ``results.json`` with its provenance."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experiments.files import atomic_write
from experiments.run_options import RunOptions
from experiments.rundir import DATA_KEYS, source
from experiments.tracking import finish_wandb
from experiments.trainer import Trainer

__all__ = ["mean_ci95", "provenance", "finish"]


def mean_ci95(values: Tensor) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (normal approximation)."""
    values = values.double().flatten()
    n = values.numel()
    half = 1.96 * float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return float(values.mean()), half


def provenance() -> dict[str, Any]:
    """Package versions, the machine, and the code that runs now (:func:`~experiments.rundir.source`)."""
    versions = {"python": platform.python_version()}
    for pkg in ("maml-toolkit", "torch", "numpy", "wandb", "learn2learn", "higher"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    cpu = None  # the processor's model name (Linux), else the platform's word for it
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return {
        "versions": versions,
        **source(),
        "host": platform.node(),
        "cpu": cpu or platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def finish(
    opts: RunOptions, cfg: Any, run: Any, trainer: Trainer, test: dict[str, dict[str, Any]], metric: str, **extra: Any
) -> None:
    """Puts the test metric in the wandb summary, writes results.json, and closes the wandb run."""
    for key, r in test.items():
        run.summary[f"test/{metric}_{key}"] = r[metric]
        run.summary[f"test/{metric}_{key}_ci95"] = r["ci95"]
    config = dataclasses.asdict(cfg)
    # No path of this machine in a result file: the data's path relative to the working directory, its fingerprint.
    data = {
        k: {"path": os.path.relpath(v), "fingerprint": trainer.data_files.get(k, {}).get("fingerprint")}
        for k in DATA_KEYS
        if isinstance(v := config.get(k), str)
    }
    config.update({k: d["path"] for k, d in data.items()})
    results = {
        "experiment": opts.experiment,
        "config": config,
        **({"data_files": data} if data else {}),
        **extra,
        "test": test,
        "final_val": trainer.final_val,
        "best_val": trainer.best,
        "iterations": trainer.iterations,
        "train_seconds": round(trainer.train_seconds, 1),
        "device": str(opts.device),
        "processes": opts.world_size,
        "git_history": trainer.git_history,  # the code at the start and at each resume; at the end: provenance()
        **provenance(),
    }
    atomic_write(opts.out / "results.json", lambda p: p.write_text(json.dumps(results, indent=2) + "\n"))
    finish_wandb(run)
