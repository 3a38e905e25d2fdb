"""What the benchmarks record: a memory worker finds the caller's packages, a stopped speed run says what it missed,
the inner-optimizer benchmark measures every rule beside higher's same step and its table says which are slow."""

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

from benchmarks import memory, optimizers  # noqa: E402
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


def test_the_optimizer_benchmark_times_each_rule_beside_highers_and_the_table_names_the_slow_ones(
    tmp_path: Path,
) -> None:
    path = tmp_path / "optimizers.json"
    argv = ["--optimizers", "adam", "nadam", "--tasks", "1", "--steps", "1", "--repeats", "1", "--warmup", "0"]
    assert optimizers.main([*argv, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["command"] == "python -m benchmarks.optimizers " + " ".join([*argv, "--json", str(path)])
    assert [t["workload"] for t in report["tables"]] == ["sine", "omniglot"] and report["complete"]
    for table in report["tables"]:
        rows = {r["optimizer"]: r for r in table["rows"]}
        assert list(rows) == ["sgd", "adam", "nadam"]  # SGD, the baseline, always
        assert rows["sgd"]["vs_sgd"] == 1.0 and rows["adam"]["ours"]["ops"] > rows["sgd"]["ours"]["ops"]
        assert all(r["ours"]["peak_bytes"] > 0 and r["ours"]["cpu"] > 0 for r in rows.values())
        assert rows["nadam"]["higher"] is None and rows["nadam"]["vs_higher"] is None  # higher has no NAdam
        # The same step as higher's: the meta-gradients agree in float64 (Adam's eps overridden in higher's).
        assert rows["sgd"]["grad_diff"] < 1e-10 and rows["adam"]["grad_diff"] < 1e-6
    # The table of a committed run (this tree may hold uncommitted changes), with Adam made slow.
    report["git_dirty"] = False
    adam = report["tables"][0]["rows"][1]
    adam.update(vs_sgd=2.0, ops_vs_sgd=1.5, vs_higher=1.25)
    path.write_text(json.dumps(report))
    text = tables.optimizers(path)
    assert "**sine**: sine MLP" in text and "**omniglot**: Omniglot conv net" in text
    assert (
        sum(
            line.startswith("| `nadam` | 0.01 |") and line.endswith("| - | - | - | - | - |")
            for line in text.splitlines()
        )
        == 2
    )
    assert "Over 1.5x SGD's CPU time: `adam` on sine (2.00x, with 1.50x the operators)." in text
    slower = text.split("Slower than higher's version of the same optimizer: ")[1]
    assert "`adam` on sine (1.25x)" in slower and "nadam" not in slower
