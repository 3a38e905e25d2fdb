"""Where a run's logged rows go: ``metrics.jsonl``, wandb, and a progress line when stderr is no terminal."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from experiments.files import atomic_write, writing

__all__ = ["Logbook"]


class Logbook:
    """Rank 0's log of a run: every row to ``metrics.jsonl`` and to wandb.

    A start rewrites the file with the checkpoint's history, so after a kill it holds each logged
    iteration once and none that is redone. Where stderr is no terminal (a batch job), tqdm is
    silent and a plain progress line per log window goes to stderr instead.
    """

    def __init__(self, path: Path, file: IO[str], run: Any, wandb_from: int, start: int) -> None:
        self.path, self.file, self.run, self.wandb_from = path, file, run, wandb_from
        # tqdm switches itself off without a terminal (disable=None); then a plain line per log window.
        self.plain = sys.stderr is not None and not sys.stderr.isatty()
        self.window_began, self.window_start = time.perf_counter(), start

    @classmethod
    def open(cls, path: Path, history: list[dict[str, float]], run: Any, start: int) -> Logbook:
        """Rewrites ``path`` with ``history``, opens it for appending, and replays to wandb what its run lacks."""
        atomic_write(path, lambda p: p.write_text("".join(json.dumps(row) + "\n" for row in history)))
        with writing(path):
            file = path.open("a")
        # wandb's next step: 0 offline; online, past the last row its server holds (it has the earlier ones).
        wandb_from = run.starting_step
        for row in history:
            if row["iteration"] >= wandb_from:
                run.log(row, step=row["iteration"])
        return cls(path, file, run, wandb_from, start)

    def write(self, row: dict[str, float], iterations: int) -> None:
        """One row, to the file (flushed: a kill loses no row the process logged) and to wandb."""
        iteration = int(row["iteration"])
        with writing(self.path):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if iteration >= self.wandb_from:
            self.run.log(row, step=iteration)
        if self.plain:
            now = time.perf_counter()
            rate = (iteration - self.window_start) / max(now - self.window_began, 1e-9)
            eta = round((iterations - iteration) / rate)
            print(
                f"meta-train {iteration}/{iterations} ({100 * iteration // iterations} %): "
                f"meta-loss {row['train/meta_loss']:.4g}, {rate:.1f} it/s, "
                f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}",
                file=sys.stderr,
                flush=True,
            )
            self.window_began, self.window_start = now, iteration

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
