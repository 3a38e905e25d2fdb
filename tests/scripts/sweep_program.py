"""A tiny training program for the sweep runner's tests (tests/scripts/test_sweep.py) that writes its folder as our scripts do.

    python tests/scripts/sweep_program.py --out DIR --wandb offline --x=0.5 --y=2 [--seed=0] [--fail-above=3] [--sleep=0.2]
        [--resume | --overwrite]

Like ``experiments.sine`` it writes ``DIR/config.yaml`` and ``DIR/checkpoint.pt`` first, refusing a
``DIR`` that holds a run unless ``--resume`` or ``--overwrite``; every logged row to
``DIR/metrics.jsonl`` (three ``train/loss`` rows, then ``val/score`` rows that fall to ``score(x, y)``
and rise again); and at its end ``DIR/results.json`` (``test`` metrics with 95 % CIs, from
``evaluation``, and ``train_seconds``). When ``x * y > fail_above`` it "diverges": it exits 1 after
the loss rows. It needs no wandb (``--wandb`` is accepted and ignored), so a trial takes a fraction
of a second.

For the tests to watch it: each start and end appends a JSON line (event, argv, ``OMP_NUM_THREADS``,
``WANDB_RUN_GROUP``, ``WANDB_MODE``, time) to ``$SWEEP_PROGRAM_LOG`` when set, and
``$SWEEP_PROGRAM_HANG=N`` makes the N-th start in that log hang, after its checkpoint, until killed. SIGTERM
ends it with exit code 143, as it ends the experiment scripts (after a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def score(x: float, y: int) -> float:
    """The best ``val/score`` the program logs (lower is better; best at x = 1 and large y)."""
    return (x - 1.0) ** 2 + 1.0 / (3 * y)


def evaluation(x: float, y: int, seed: int) -> dict[str, dict[str, float]]:
    """What it writes under ``test`` in results.json: two metrics, each with a 95 % CI half-width."""
    return {
        "1step": {"score": score(x, y) + 0.1 * seed, "ci95": 0.01 * (seed + 1)},
        "5step": {"score": score(x, y) / 2 + 0.05 * seed**2, "ci95": 0.02 + 0.001 * x},
    }


def note(event: str) -> int:
    """Appends an event to ``$SWEEP_PROGRAM_LOG``; returns how many starts it holds."""
    path = os.environ.get("SWEEP_PROGRAM_LOG")
    if not path:
        return 0
    record = {
        "event": event,
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "time": time.time(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "group": os.environ.get("WANDB_RUN_GROUP"),
        "mode": os.environ.get("WANDB_MODE"),
    }
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")
    return sum(json.loads(line)["event"] == "start" for line in Path(path).read_text().splitlines())


def write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    """Writes the logged rows to ``metrics.jsonl``, one JSON object a line."""
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the flags, writes the run's files and exits (1 when it diverges, 2 for an --out holding a run)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wandb", choices=("offline", "online", "disabled"), default="offline")
    parser.add_argument("--x", type=float, default=1.0)
    parser.add_argument("--y", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-above", type=float, default=math.inf)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # as our scripts: stop (with a checkpoint), 143
    starts = note("start")
    start = time.monotonic()
    if (args.out / "config.yaml").exists() and not (args.resume or args.overwrite):
        print(f"error: --out {args.out} already holds a run; pass --resume or --overwrite", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.yaml").write_text(json.dumps(vars(args), default=str))
    (args.out / "checkpoint.pt").write_text("not a real checkpoint")
    rows: list[dict[str, Any]] = [
        {"iteration": step, "train/loss": (args.x - 1.0) ** 2 + 1.0 / (args.y * (step + 1))} for step in range(3)
    ]
    write_rows(args.out, rows)
    if str(starts) == os.environ.get("SWEEP_PROGRAM_HANG"):
        time.sleep(3600)
    time.sleep(args.sleep)
    if args.x * args.y > args.fail_above:
        raise RuntimeError(f"diverged: x * y = {args.x * args.y} > {args.fail_above}")
    best = score(args.x, args.y)
    rows += [{"iteration": 3 + step, "val/score": best + rise} for step, rise in enumerate((1.0, 0.0, 0.5))]
    write_rows(args.out, rows)
    results = {"test": evaluation(args.x, args.y, args.seed), "train_seconds": args.x + args.seed}
    (args.out / "results.json").write_text(json.dumps(results))
    note("end")
    print(f"val/score {best:.4f} after {time.monotonic() - start:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
