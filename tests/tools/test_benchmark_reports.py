"""What the benchmarks record: a memory worker finds the caller's packages, a stopped speed run says what it missed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ and tools/ are not installed, they live in the checkout
    sys.path.insert(0, str(REPO))

from benchmarks import memory  # noqa: E402
from tools import tables  # noqa: E402


def test_a_memory_worker_keeps_the_callers_pythonpath_after_the_repository(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The peers may be installed on the caller's PYTHONPATH (a --target folder): a worker that replaced it
    # could not import them and reported an error row instead of a measurement.
    seen: dict[str, Any] = {}

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps({"method": "higher"}) + "\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = argparse.Namespace(
        device="cpu", batching="loop", threads=1, repeats=0, limit_gib=1.0, shots=1, chunk_size=None, memory_budget=None
    )
    assert memory.run_worker("higher", 1, 1, args) == {"method": "higher"}
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(memory.REPO), str(tmp_path)]


def test_a_stopped_speed_run_names_the_workloads_it_did_not_reach(tmp_path: Path) -> None:
    row = {"method": "learn2learn MAML", "median": 0.1, "min": 0.1, "max": 0.2, "speedup": 1.0, "peak_fraction": 0.01}
    report = {
        "command": "python -m benchmarks.speed --workloads sine1 sine5 omniglot20 --methods auto 'learn2learn MAML'",
        "complete": False,
        "tables": [
            {"workload": "sine1", "name": "sine", "table": "main", "batching": "vmap", "repeats": 3, "rows": [row]}
        ],
        "peak_gflops": 100.0,
        "versions": {"torch": "2"},
        "device": "cpu",
        "cpu": "a CPU",
        "threads": 1,
        "date": "2026-11-26",
        "git_commit": "0" * 40,
        "git_dirty": False,
    }
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(report))
    assert tables.speed(path).rstrip().endswith("The run was stopped before sine5, omniglot20.")
    path.write_text(json.dumps({**report, "complete": True}))
    assert "stopped" not in tables.speed(path)
