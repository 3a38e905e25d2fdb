"""The JSON a benchmark writes with ``--json``: its results beside the command, device, versions and commit.

``python -m tools.tables`` renders the tables of the README and the docs from these files.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

__all__ = ["write_report"]


def write_report(path: Path, benchmark: str, argv: list[str], device: Any, threads: int, **fields: Any) -> None:
    """Writes ``fields`` to ``path`` (atomically) with how, where and when they were measured."""
    import torch

    from experiments.harness.folder import atomic_write
    from experiments.harness.report import provenance

    device = torch.device(device)
    report = {
        "benchmark": benchmark,
        "command": shlex.join(["python", "-m", f"benchmarks.{benchmark}", *argv]),
        "device": str(device),
        **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}),
        **{k: v for k, v in provenance().items() if k != "host"},
        "threads": threads,
        **fields,
    }
    atomic_write(path, lambda p: p.write_text(json.dumps(report, indent=1) + "\n"))
