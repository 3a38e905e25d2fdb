"""A tiny training program for the sweep runner's tests (see tests/test_sweep.py).

    python tests/sweep_program.py --out DIR --wandb offline --x=0.5 --y=2 [--fail-above=3] [--blob=N]

Logs three rows (``loss`` and a nested ``train`` dict), then ``val/score = (x - 1)^2 + 1 / (3 y)``
and a summary entry with offline wandb under ``DIR``, and writes every row it logged to
``DIR/logged.json`` so that a test can compare them with what is read back from the run files.
When ``x * y > fail_above`` it "diverges": it raises after the three rows, so the process exits 1.
``--blob=N`` also logs an N-character string, to make records span wandb's 32 KiB blocks.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def rows(x: float, y: int) -> list[dict[str, Any]]:
    """The training rows the program logs for parameters ``x`` and ``y``."""
    return [
        {"loss": (x - 1.0) ** 2 + 1.0 / (y * (step + 1)), "train": {"xy": x * y, "step": step}} for step in range(3)
    ]


def score(x: float, y: int) -> float:
    """The final metric, ``val/score`` (lower is better; best at x = 1 and large y)."""
    return (x - 1.0) ** 2 + 1.0 / (3 * y)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, log with wandb and exit (1, by an exception, when it diverges)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wandb", choices=("offline", "disabled"), default="offline")
    parser.add_argument("--x", type=float, default=1.0)
    parser.add_argument("--y", type=int, default=1)
    parser.add_argument("--fail-above", type=float, default=math.inf)
    parser.add_argument("--blob", type=int, default=0)
    args = parser.parse_args(argv)

    import wandb

    args.out.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(x_disable_stats=True, x_disable_machine_info=True)
    run = wandb.init(dir=args.out, mode=args.wandb, config={"x": args.x, "y": args.y}, settings=settings)
    logged = rows(args.x, args.y)
    if args.blob:
        logged.append({"blob": "b" * args.blob})
    for row in logged:
        run.log(row)
    logged_path = args.out / "logged.json"
    logged_path.write_text(json.dumps(logged))
    if args.x * args.y > args.fail_above:
        raise RuntimeError(f"diverged: x * y = {args.x * args.y} > {args.fail_above}")
    final = {"val/score": score(args.x, args.y)}
    run.log(final)
    logged.append(final)
    run.summary["best_loss"] = min(row["loss"] for row in logged if "loss" in row)
    logged_path.write_text(json.dumps(logged))
    run.finish()
    wandb.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
