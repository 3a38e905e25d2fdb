"""Meta-training across processes with torchrun (gloo, CPU): the trajectory of one process, rank 0 alone writes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_experiments import SMALL_SINE, assert_logged, checkpoint, env, finished, script

import maml
from experiments.cli import UsageError
from experiments.config import RunOptions
from experiments.runtime import check_shards

PROCESSES = 2


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    # torchrun sets this itself only for several processes per machine; 2 two-threaded
    # processes on 2 cores spin against each other and run 10 times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def torchrun(target: list[str], tmp_path: Path, processes: int = PROCESSES) -> subprocess.Popen:
    """``python -m torch.distributed.run`` on this machine, a free port, ``processes`` CPU processes."""
    return script("torch.distributed.run", ["--standalone", "--nproc-per-node", str(processes), *target], tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_follow_the_trajectory_of_one_and_only_rank_0_writes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = [
        "--iterations",
        "20",
        "--meta-batch",
        "10",
        "--log-every",
        "10",
        "--val-every",
        "20",
        "--checkpoint-every",
        "20",
        *SMALL_SINE,
    ]
    # Both at once: the launches overlap on the 2 cores.
    single = script("experiments.sine", [*args, "--out", str(one), "--wandb", "disabled"], tmp_path)
    sharded = torchrun(["-m", "experiments.sine", *args, "--out", str(two), "--wandb", "offline"], tmp_path)
    finished(single)
    printed = finished(sharded)

    a, b = checkpoint(one), checkpoint(two)
    assert a["iteration"] == b["iteration"] == 20
    assert a["learner"]["model"].keys() == b["learner"]["model"].keys()
    for key, value in a["learner"]["model"].items():
        torch.testing.assert_close(b["learner"]["model"][key], value, rtol=0, atol=1e-5, msg=key)
    assert torch.equal(a["generator"], b["generator"])  # every rank sampled the full meta-batches
    # The logged training metrics are the full meta-batch's, not rank 0's share.
    for row_a, row_b in zip(a["history"], b["history"], strict=True):
        assert row_a.keys() == row_b.keys()
        for key in row_a.keys() - {"train/step_time_ms"}:
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-7), key

    # Rank 0 alone wrote: the files of a single-process run, one wandb run, one results table.
    assert sorted(p.name for p in two.iterdir()) == sorted([*(p.name for p in one.iterdir()), "wandb"])
    assert len(list((two / "wandb").glob("offline-run-*/*.wandb"))) == 1  # one wandb run
    assert_logged(two, b["history"], {})
    assert printed.count("test MSE on 20 tasks") == 1
    results = json.loads((two / "results.json").read_text())
    assert results["processes"] == PROCESSES and results["iterations"] == 20


def test_a_meta_batch_the_processes_cannot_share_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    proc = torchrun(
        ["-m", "experiments.sine", "--meta-batch", "25", "--out", str(out), "--wandb", "disabled"], tmp_path
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "--meta-batch 25 cannot be split evenly across 2 processes" in err, err[-3000:]
    assert not out.exists()


def test_collectives_in_a_real_process_group(tmp_path):
    printed = finished(torchrun(["tests/distributed_program.py"], tmp_path))
    assert printed.count(": ok") == PROCESSES


def test_shard_splits_the_tasks_into_equal_contiguous_shares():
    x = torch.arange(12.0).view(12, 1, 1)
    batch = maml.TaskBatch(x, x, x, x)
    shares = [maml.shard(batch, rank=r, world_size=3) for r in range(3)]
    assert [s.num_tasks for s in shares] == [4, 4, 4]
    for field in ("support_x", "support_y", "query_x", "query_y"):
        assert torch.equal(torch.cat([getattr(s, field) for s in shares]), getattr(batch, field))
    # Without a process group: the whole batch, and nothing to average.
    assert maml.shard(batch) is batch
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    extras = torch.tensor([1.0])
    assert maml.all_reduce_grads([p], extras) is extras and p.grad.tolist() == [3.0, 3.0]
    assert maml.all_reduce_mean(extras) is extras


def test_shard_errors_say_how_to_fix_them():
    x = torch.zeros(10, 1, 1)
    batch = maml.TaskBatch(x, x, x, x)
    message = (
        "a meta-batch of 10 tasks cannot be split evenly across 4 processes (world size): every process must "
        "adapt the same number of tasks"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        maml.shard(batch, rank=0, world_size=4)
    assert "multiple of 4 (e.g. 8 or 12)" in str(error.value) and "divides 10 (1, 2, 5, 10)" in str(error.value)
    with pytest.raises(ValueError, match=re.escape("rank=2 is out of range for world_size=2")):
        maml.shard(batch, rank=2, world_size=2)
    with pytest.raises(TypeError, match="batch must be a maml.TaskBatch"):
        maml.shard(x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("extras must be a 1-D tensor")):
        maml.all_reduce_grads([], torch.zeros(2, 2))


def test_the_scripts_check_the_meta_batch_against_the_number_of_processes(tmp_path):
    opts = RunOptions("sine", tmp_path, False, False, "disabled", torch.device("cpu"), None, rank=0, world_size=3)
    check_shards(24, opts)
    with pytest.raises(
        UsageError, match=re.escape("--meta-batch 25 cannot be split evenly across 3 processes")
    ) as error:
        check_shards(25, opts)
    assert "divides 25: 1, 5, 25" in str(error.value)


def test_on_two_machines_a_stopped_run_resumes_from_rank_0s_checkpoint(tmp_path):
    """Two torchrun launches, one process each, as on two machines: each in its own working
    directory, so ``--out run`` is a different folder for each, as on machines without a shared disk."""
    iterations = 300
    args = [
        "--iterations",
        str(iterations),
        "--meta-batch",
        "10",
        "--log-every",
        "50",
        "--val-every",
        "300",
        "--checkpoint-every",
        "50",
        "--wandb",
        "disabled",
        *SMALL_SINE,
    ]
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    for m in machines:
        m.mkdir()
    launched: list[subprocess.Popen] = []

    def launch(*extra: str) -> list[subprocess.Popen]:
        port = free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(i),
                    "--nproc-per-node",
                    "1",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    "-m",
                    "experiments.sine",
                    *args,
                    "--out",
                    "run",
                    *extra,
                ],
                cwd=machine,
                env=env(tmp_path),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i, machine in enumerate(machines)
        ]
        launched.extend(procs)
        return procs

    reference = script("experiments.sine", [*args, "--out", str(tmp_path / "one")], tmp_path)
    try:
        first = launch()
        saved = machines[0] / "run" / "checkpoint.pt"
        deadline = time.monotonic() + 120
        while not saved.exists() and time.monotonic() < deadline and first[0].poll() is None:
            time.sleep(0.01)
        first[0].send_signal(signal.SIGINT)  # Ctrl-C on machine 0's torchrun alone
        _, err = first[0].communicate(timeout=120)
        first[1].communicate(timeout=120)
        stopped_at = checkpoint(machines[0] / "run")["iteration"]
        assert 0 < stopped_at < iterations, "the run was not interrupted: raise `iterations`"
        # Both ranks stopped after the same iteration (none was left waiting in an all-reduce).
        assert f"stopped after iteration {stopped_at};" in err, err[-3000:]

        for proc in launch("--resume"):  # machine 1 has no checkpoint: rank 0 sends it
            finished(proc)
        finished(reference)
    finally:
        for proc in [*launched, reference]:
            if proc.poll() is None:
                proc.terminate()  # torchrun passes it on to its workers
                proc.wait(60)

    a, b = checkpoint(tmp_path / "one"), checkpoint(machines[0] / "run")
    assert a["iteration"] == b["iteration"] == iterations
    for key, value in a["learner"]["model"].items():
        torch.testing.assert_close(b["learner"]["model"][key], value, rtol=0, atol=1e-5, msg=key)
    assert list(machines[1].iterdir()) == []  # rank 1 wrote nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: run on a GPU machine (CI has none)")
def test_on_gpus_one_rank_per_gpu_follows_the_single_process_run(tmp_path, capsys):
    gpus = torch.cuda.device_count()
    args = [
        "--iterations",
        "200",
        "--meta-batch",
        str(10 * gpus),
        "--log-every",
        "50",
        "--val-every",
        "200",
        "--checkpoint-every",
        "200",
        "--device",
        "cuda",
        "--wandb",
        "disabled",
        *SMALL_SINE,
    ]
    finished(script("experiments.sine", [*args, "--out", str(tmp_path / "one")], tmp_path))
    finished(torchrun(["-m", "experiments.sine", *args, "--out", str(tmp_path / "nccl")], tmp_path, processes=gpus))
    a, b = checkpoint(tmp_path / "one"), checkpoint(tmp_path / "nccl")
    assert a["iteration"] == b["iteration"] == 200
    for key, value in a["learner"]["model"].items():
        torch.testing.assert_close(b["learner"]["model"][key], value, rtol=0, atol=1e-5, msg=key)
    with capsys.disabled():  # the step time, for the README
        steps = [[row["train/step_time_ms"] for row in c["history"]] for c in (a, b)]
        print(
            f"\n{torch.cuda.get_device_name()}: {gpus} rank(s); step time per logged window (ms): "
            f"one process {[round(t, 2) for t in steps[0]]}, torchrun {[round(t, 2) for t in steps[1]]}"
        )
