"""How a run runs, as opposed to what it trains: :class:`RunOptions` (a module of its own, so that what reads it imports no parser)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

__all__ = ["RunOptions"]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run, as opposed to what to train (the experiment's config dataclass).

    Under ``torchrun``, ``rank`` and ``world_size`` place this process among the ones that
    share each meta-batch, and ``device`` is its own (``cuda:LOCAL_RANK`` for ``--device cuda``).
    """

    experiment: str
    out: Path
    resume: bool
    overwrite: bool
    wandb: str
    device: torch.device
    config_file: Path | None
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        """Whether this process is rank 0, the one that logs and writes under ``--out``."""
        return self.rank == 0
