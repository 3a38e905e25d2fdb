"""Meta-training across processes with torchrun (gloo, CPU): the trajectory of one process, rank 0 alone writes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, SMALL_SINE, assert_logged, checkpoint, env, finished, script

from experiments.harness import fit
from experiments.harness.fit import check_shards
from experiments.harness.folder import UsageError, lock_holder
from experiments.harness.lifecycle import RankUsageError, peer_lost

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


ERROR_LINE = re.compile(r"^error(?: \(rank \d+\))?: .*$", re.M)  # the scripts' one-line errors


def test_a_meta_batch_the_processes_cannot_share_is_refused_before_anything_is_written(tmp_path):
    """Refused once, by rank 0, and not once per process; so is an unknown flag (refused before the group exists)."""
    out = tmp_path / "run"
    # Both at once: the launches overlap on the 2 cores.
    shares = torchrun(
        ["-m", "experiments.sine", "--meta-batch", "25", "--out", str(out), "--wandb", "disabled"], tmp_path
    )
    flag = torchrun(["-m", "experiments.sine", "--meta-batch", "10", "--bogus", "3", "--out", str(out)], tmp_path)
    for proc, message in [
        (shares, "error: --meta-batch 25: a meta-batch of 25 tasks cannot be split evenly across 2 processes"),
        (flag, "error: unknown flag --bogus"),
    ]:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode != 0
        lines = ERROR_LINE.findall(err)
        assert len(lines) == 1 and lines[0].startswith(message), err[-3000:]
        # Rank 1 waited for torchrun to end it, so rank 0 was not ended before it printed. torchrun reports a
        # failed worker its own way; no frame of a traceback is the scripts' or the engine's.
        assert "stopped during start-up" not in err, err[-3000:]
        frames = [line for line in err.splitlines() if line.lstrip().startswith('File "')]
        assert not [f for f in frames if "/experiments/" in f or "/maml/" in f], err[-3000:]
    assert not out.exists()


def test_a_usage_error_is_printed_once_per_machine_and_a_process_s_own_by_that_process(monkeypatch, capsys):
    """Every process meets an ordinary usage error alike: LOCAL_RANK 0 prints it. A RankUsageError (the GPU of
    one LOCAL_RANK) is printed by the process that meets it, naming its rank."""

    def alike(argv: object, life: object) -> None:
        raise UsageError("--meta-batch 3 cannot be split evenly across 2 processes")

    def own(argv: object, life: object) -> None:
        raise RankUsageError("process LOCAL_RANK=1 needs the GPU cuda:1, but this machine has 1")

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # (under torchrun, rank 1 would wait to be ended)
    for rank, run, printed in [
        ("0", alike, "error: --meta-batch 3 cannot"),
        ("1", alike, ""),
        ("1", own, "error (rank 1): process LOCAL_RANK=1 needs"),
    ]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(SystemExit) as stopped:
            fit.main(run, [])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(printed) and err.count("error") == (1 if printed else 0), (rank, err)


def test_a_failed_collective_is_told_from_other_errors():
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:16774: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    assert peer_lost(RuntimeError(gloo)) == "Connection reset by peer"
    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:5012"
    assert peer_lost(torch.distributed.DistBackendError(closed)) == "Connection closed by peer"
    # torchrun's SIGTERM, come while the collective's error unwound, still tells it.
    try:
        try:
            raise RuntimeError(gloo)
        except RuntimeError:
            raise KeyboardInterrupt from None
    except KeyboardInterrupt as e:
        assert peer_lost(e) == "Connection reset by peer"
    # A timeout (a peer that hangs), another library's broken pipe, a ValueError: not a peer that ended.
    assert peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:598] Read timeout [127.0.0.1]:5012")) is None
    assert peer_lost(RuntimeError("[Errno 32] Broken pipe")) is None
    assert peer_lost(ValueError(gloo)) is None


def endless_sine(out: Path, iterations: int = 100_000) -> list[str]:
    """A sine run of ``iterations`` (too many to finish in a test) with a checkpoint every 20."""
    return [
        *("--iterations", str(iterations), "--meta-batch", "10", "--log-every", "50", "--val-every", "50"),
        *("--checkpoint-every", "20", "--out", str(out), "--wandb", "disabled", *SMALL_SINE),
    ]


def torchrun_logged(args: list[str], tmp_path: Path, *options: str) -> subprocess.Popen:
    """torchrun (with ``options``) of ``experiments.sine args``, each process's stdout and stderr in its own file
    under tmp_path/logs."""
    return torchrun(
        [*options, "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "-m", "experiments.sine", *args], tmp_path
    )


def rank_log(tmp_path: Path, rank: int, attempt: int = 0) -> str:
    """What the process of local rank ``rank`` wrote on stderr in torchrun's ``attempt`` (see torchrun_logged)."""
    (path,) = (tmp_path / "logs").glob(f"*/attempt_{attempt}/{rank}/stderr.log")
    return path.read_text()


def rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """The pids of ``launcher``'s processes by rank: its children (Linux's /proc) and the RANK in their environment."""
    pids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0") if ppid == launcher.pid else []
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        pids.update({int(item[5:]): int(stat.parent.name) for item in environ if item.startswith(b"RANK=")})
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that no parent reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def training(launcher: subprocess.Popen, out: Path) -> dict[int, int]:
    """Waits until ``launcher``'s two processes train past their first checkpoint; their pids by rank."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and launcher.poll() is None:
        pids = rank_pids(launcher)
        if len(pids) == PROCESSES and (out / "checkpoint.pt").exists():
            return pids
        time.sleep(0.05)
    launcher.kill()
    raise AssertionError(f"the run did not reach its first checkpoint: {launcher.communicate()[1][-3000:]}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes from /proc")
def test_a_killed_process_leaves_the_other_one_line_and_a_folder_that_resumes(tmp_path):
    out = tmp_path / "run"
    launcher = torchrun_logged(endless_sine(out), tmp_path)
    pids: dict[int, int] = {}
    try:
        pids = training(launcher, out)
        os.kill(pids[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=60)
    survivor = rank_log(tmp_path, 0)
    assert "Traceback" not in survivor, survivor[-3000:]
    assert re.fullmatch(
        r"error \(rank 0\): another process of this torchrun run ended during a collective \(gloo: Connection "
        rf"(reset|closed) by peer\); the last checkpoint in {re.escape(str(out))} is whole: the same command plus "
        r"--resume goes on\.",
        survivor.strip().splitlines()[-1],
    ), survivor[-3000:]
    assert re.search(rf"exitcode\s*: 1 \(pid: {pids[0]}\)", err), err[-3000:]  # 1, not torchrun's SIGTERM
    stopped_at = checkpoint(out)["iteration"]
    # The folder is free and its checkpoint whole: --resume (one process, a length it has reached) evaluates it.
    finished(script("experiments.sine", [*endless_sine(out, iterations=20), "--resume"], tmp_path))
    assert checkpoint(out)["iteration"] == stopped_at and (out / "results.json").is_file()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes from /proc")
def test_the_processes_of_a_killed_launcher_stop_with_a_checkpoint_and_free_the_folder(tmp_path):
    out = tmp_path / "run"
    launcher = torchrun_logged(endless_sine(out), tmp_path)
    pids: dict[int, int] = {}
    try:
        pids = training(launcher, out)
        launcher.kill()  # SIGKILL: torchrun passes nothing on
        launcher.communicate(timeout=60)  # and its pipes closed
        killed = time.monotonic()
        while any(map(alive, pids.values())) and time.monotonic() < killed + 10:
            time.sleep(0.05)
        assert not any(map(alive, pids.values())), f"the processes outlived their launcher by 10 s: {pids}"
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # Each got SIGTERM from the kernel and stopped as after `kill`: after the iteration every rank voted for, or,
    # where a rank left before the vote (seen once in a dozen runs on 2 busy cores), at once at its last checkpoint.
    log = rank_log(tmp_path, 0)
    stopped = re.search(r"stopped after iteration (\d+); continue with the same command plus --resume", log)
    at_once = f"stopped at once; the last checkpoint in {out} is whole: the same command plus --resume goes on."
    assert stopped or at_once in log, log[-3000:]
    if stopped:
        assert checkpoint(out)["iteration"] == int(stopped.group(1))
    else:
        assert checkpoint(out)["iteration"] >= 1
    assert "Traceback" not in rank_log(tmp_path, 1), rank_log(tmp_path, 1)[-3000:]
    assert lock_holder(out) is None  # the folder is free


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_process_whose_launcher_died_before_it_asked_to_be_told_stops(tmp_path):
    """The race that prctl alone would lose: the parent dies before the request, and the kernel sends nothing."""
    child = (
        "import os, signal, sys, time\n"
        "from experiments.harness.lifecycle import Lifecycle\n"
        "life = Lifecycle()\n"  # reads its parent's pid
        "print('imported', flush=True)\n"
        "while os.getppid() == life.parent:\n"  # the launcher dies here
        "    time.sleep(0.01)\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: (print('SIGTERM', flush=True), os._exit(143)))\n"
        "life.leave_with_launcher()\n"
        "time.sleep(5)\n"
        "print('not stopped', flush=True)\n"
    )
    said = tmp_path / "said.txt"
    launcher = (  # starts the child, waits until it has imported the module, and dies
        "import subprocess, sys, time\n"
        f"with open({str(said)!r}, 'w') as said:\n"
        f"    subprocess.Popen([sys.executable, '-c', {child!r}], stdout=said)\n"
        f"while 'imported' not in open({str(said)!r}).read():\n"
        "    time.sleep(0.01)\n"
    )
    subprocess.run([sys.executable, "-c", launcher], cwd=REPO, env=env(tmp_path), timeout=120, check=True)
    deadline = time.monotonic() + 60
    while said.read_text().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said.read_text() == "imported\nSIGTERM\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes from /proc")
def test_a_run_that_torchrun_restarts_goes_on_from_its_last_checkpoint(tmp_path):
    """torchrun --max-restarts: a killed process ends the attempt, torchrun starts the processes again with the same
    command (and --overwrite), and the run resumes from the checkpoint in --out instead of starting over."""
    out = tmp_path / "run"
    args = [*endless_sine(out, iterations=2000), "--overwrite"]
    launcher = torchrun_logged(args, tmp_path, "--max-restarts", "1")
    try:
        os.kill(training(launcher, out)[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err[-3000:]
    assert f"torchrun restart 1: resuming the run in {out} from its last checkpoint" in rank_log(tmp_path, 0, 1)
    results = json.loads((out / "results.json").read_text())
    resumed = [entry["iteration"] for entry in results["git_history"] if entry["at"] == "resume"]
    assert results["iterations"] == 2000 and len(resumed) == 1 and resumed[0] >= 20, results["git_history"]
    logged = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(50, 2001, 50))  # each row once: the restart rewrote the log from the checkpoint


def torchrun_program(program: str, tmp_path: Path, *options: str) -> tuple[int, str]:
    """torchrun of the Python ``program`` (each process's output under tmp_path/logs): its exit code and stderr."""
    path = tmp_path / "program.py"
    path.write_text(program)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PROCESSES), *options]
        + ["--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(path)],
        cwd=REPO,
        env={**env(tmp_path), "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = launcher.communicate(timeout=300)
    return launcher.returncode, err


def test_a_restarted_attempt_joins_though_the_attempt_before_left_its_keys_in_the_store(tmp_path):
    """torchrun's agent keeps one store for every attempt: without a prefix of its own, a process of the second
    attempt that reads the store before the other has written it connects to the address of the first attempt."""
    program = (
        "import os, time, torch\n"
        "from experiments.harness.fit import join_processes\n"
        "attempt, rank = os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['RANK']\n"
        "if attempt == '1' and rank == '0':\n"
        "    time.sleep(5)  # rank 1 reads the store first\n"
        "join_processes(torch.device('cpu'))\n"
        "if attempt == '0' and rank == '1':\n"
        "    os._exit(1)  # ends the first attempt: torchrun starts both again\n"
        "torch.distributed.barrier()\n"
        "print(f'attempt {attempt} joined', flush=True)\n"
    )
    code, err = torchrun_program(program, tmp_path, "--max-restarts", "1")
    assert code == 0, err[-3000:]
    said = [path.read_text() for path in sorted((tmp_path / "logs").glob("*/attempt_1/*/stdout.log"))]
    assert said == ["attempt 1 joined\n"] * PROCESSES, said


def test_an_error_no_line_explains_is_the_failing_ranks_report_in_torchruns_summary(tmp_path):
    """An error the lifecycle leaves as it is (a bug, a CUDA fault) goes into torchrun's error file (``record``), so
    torchrun's "Root Cause" shows the failing rank's traceback instead of ``error_file: <N/A>``."""
    program = (
        "import os\n"
        "from experiments.harness.lifecycle import main\n"
        "def run(argv, life):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise RuntimeError('a bug that only rank 1 meets')\n"
        "main(run)\n"
    )
    code, err = torchrun_program(program, tmp_path)
    assert code == 1, err[-3000:]
    root = err[err.index("Root Cause") :]
    assert "rank      : 1" in root and "RuntimeError: a bug that only rank 1 meets" in root, err[-3000:]
    assert "<N/A>" not in root, root


def test_the_scripts_check_the_meta_batch_against_the_number_of_processes(tmp_path):
    check_shards(24, 3)
    with pytest.raises(
        UsageError,
        match=re.escape("--meta-batch 25: a meta-batch of 25 tasks cannot be split evenly across 3 processes"),
    ) as error:
        check_shards(25, 3)
    assert "multiple of 3 (e.g. 24 or 27)" in str(error.value) and "divides 25 (1, 5, 25)" in str(error.value)


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
