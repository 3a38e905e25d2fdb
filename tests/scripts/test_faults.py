"""The experiment scripts under faults and bad input: an interrupted --overwrite, an --out
that cannot be written, a missing device, a full disk, an unreachable wandb server, SIGKILL, data
that moved, a run lengthened or shortened on --resume, code changed under a run, runs shorter than
a log window, progress without a terminal, and --threads.

Most runs happen in this process (a tiny sine config: a second or two each); the ones that need a
process of their own (SIGKILL, wandb's per-process settings) are subprocesses.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, TINY, checkpoint, env, omniglot_root, one_error, run_sine, says, script

from experiments import omniglot, sine
from experiments.harness import rundir
from experiments.harness.config import parse_args
from experiments.harness.fit import setup
from experiments.harness.folder import FolderLock
from experiments.harness.lifecycle import main
from experiments.harness.rundir import prepare_out
from experiments.harness.trainer import Trainer
from tools import tables

TIMING = ("train/step_time_ms",)  # the only logged values that differ between equal runs
NO_PID = 4194305  # above Linux's largest pid_max (2**22): no process can hold it


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def timeless(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def temporaries(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(".*.tmp*"))


# ---------------------------------------------------------------------------- --overwrite


def old_run(out: Path) -> None:
    """What a finished run leaves in --out, a file of the user's, and a temporary file of a killed writer."""
    out.mkdir(parents=True)
    for name in (
        "config.yaml",
        "checkpoint.pt",
        "results.json",
        "metrics.jsonl",
        "learning_curves.png",
        "sine_fit.png",
        "task_grid.png",
    ):
        (out / name).write_text("the old run's")
    old = out / "wandb" / "offline-run-20260101_000000-oldrun01"
    old.mkdir(parents=True)
    (old / "run-oldrun01.wandb").write_text("the old run's")
    (out / "wandb" / "debug.log").write_text("the old run's")
    (out / "notes.txt").write_text("the user's")
    (out / f".checkpoint.pt.tmp{NO_PID}").write_text("half a checkpoint")


@pytest.mark.parametrize("stopped", ["before the first checkpoint", "after training"])
def test_overwrite_clears_the_old_runs_files_before_writing(capsys, tmp_path, monkeypatch, stopped):
    out = tmp_path / "run"
    old_run(out)

    def interrupt(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # as a second Ctrl-C does: at once

    if stopped == "before the first checkpoint":
        monkeypatch.setattr(Trainer, "run", interrupt)
    else:
        monkeypatch.setattr(sine, "evaluate", interrupt)
    args = [*TINY, "--iterations", "3", "--out", str(out), "--wandb", "disabled"]
    with pytest.raises(SystemExit) as stop:
        main(sine.run, [*args, "--overwrite"])
    assert stop.value.code == 130  # one line, no traceback (test_run_folder checks the lines)
    capsys.readouterr()

    # The new run's files only; the user's file kept.
    new = ["checkpoint.pt", "config.yaml", "metrics.jsonl"] if stopped == "after training" else ["config.yaml"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*new, "notes.txt"])
    assert "iterations: 3" in (out / "config.yaml").read_text()
    if stopped == "after training":
        assert checkpoint(out)["iteration"] == 3 and [r["iteration"] for r in rows(out / "metrics.jsonl")] == [3]
    else:  # the old run's checkpoint is gone and the new one ended before its first: --resume starts it over
        monkeypatch.undo()  # the training loop back
        err = run_sine(capsys, [*args, "--resume"])
        said = f"--resume: {out} holds no checkpoint, as its run ended before the first; starting it from the beginning"
        assert said in err.splitlines() and checkpoint(out)["iteration"] == 3
    assert (out / "notes.txt").read_text() == "the user's"


# ---------------------------------------------------------------------------- an --out that cannot be written, a missing device


def read_only(path: Path) -> bool:
    """Makes the folder ``path`` unwritable even for root (chattr +i); False where that is impossible."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return (
        shutil.which("chattr") is not None
        and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    )


def test_an_out_that_cannot_be_written_and_a_missing_device_are_one_line_and_exit_2(capsys, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("the user's")
    line = one_error(run_sine(capsys, ["--out", str(taken)], code=2))
    says(line, f"--out {taken}", "pass a folder")
    line = one_error(run_sine(capsys, ["--out", str(taken / "run")], code=2))
    says(line, f"--out {taken / 'run'}", "pass another --out")
    assert taken.read_text() == "the user's"

    line = one_error(run_sine(capsys, ["--out", str(tmp_path / "run"), "--device", "mps"], code=2))
    assert line.startswith("error: --device mps is not available on this machine (")
    assert re.search(r"\); use --device cpu( or --device \w+)?\.$", line), line  # or the accelerator it has
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]

    locked = tmp_path / "locked"
    locked.mkdir()
    if not read_only(locked):
        pytest.skip("cannot make a folder read-only for this user (root without chattr)")
    try:
        for out in (locked, locked / "run"):
            line = one_error(run_sine(capsys, ["--out", str(out)], code=2))
            assert re.fullmatch(
                rf"error: --out {re.escape(str(out))}: cannot write in {re.escape(str(locked))} "
                r"\((Permission denied|Operation not permitted|Read-only file system)\); make it "
                r"writable or pass another --out\.",
                line,
            ), line
        assert not list(locked.iterdir())
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(locked)], check=True)


# ---------------------------------------------------------------------------- a full disk


class FullDisk:
    """A file whose writes fail as on a full disk (the file itself was created, as on a real one)."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Every write to the file ``name`` (or its temporary file) fails with ENOSPC, through open() and pathlib."""
    real = builtins.open
    pattern = re.compile(rf"\.?{re.escape(name)}(\.tmp\d+)?")

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(file, mode, *args, **kwargs)
        writing = any(c in mode for c in "wax+") and isinstance(file, (str, os.PathLike))
        return FullDisk(f) if writing and pattern.fullmatch(Path(file).name) else f

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)


def mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def full_disk_message(path: Path) -> str:
    return (
        rf"error: no space left on device writing {re.escape(str(path))}; free space on the filesystem mounted at "
        rf"{re.escape(str(mount_point(path)))} \([0-9.]+ [KMGT]?i?B free\) or pass another --out\."
    )


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "checkpoint.pt", "results.json", "sine_fit.png"])
def test_a_full_disk_names_the_file_and_its_filesystem_and_leaves_no_temporary_file(
    capsys, tmp_path, monkeypatch, name
):
    out = tmp_path / "run"
    fill_disk(monkeypatch, name)
    line = one_error(run_sine(capsys, ["--iterations", "2", "--out", str(out)], code=2))
    assert re.fullmatch(full_disk_message(out / name), line), line
    if name == "config.yaml":
        assert not out.exists()  # the run had written nothing else yet
    else:
        assert not temporaries(out) and not (out / name).exists()


def test_a_real_full_tmpfs(capsys, tmp_path):
    """The same on a real 16 KiB tmpfs, where the kernel says ENOSPC (needs mount privileges: root)."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = small / "run"
        line = one_error(run_sine(capsys, ["--iterations", "2", "--out", str(out)], code=2))
        match = re.fullmatch(full_disk_message(out / "NAME").replace("NAME", r"(\S+)"), line)
        assert match and match.group(1) == "checkpoint.pt", line  # 20 KB on a 16 KiB disk
        assert not temporaries(out)
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


# ---------------------------------------------------------------------------- wandb online without a server


def test_wandb_online_without_a_server_or_a_key_logs_offline_without_waiting_for_wandbs_timeout(tmp_path):
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    cases = {
        # env() points WANDB_BASE_URL at http://127.0.0.1:9, which refuses connections.
        "refused": (
            {"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"},
            "cannot reach the W&B server at http://127.0.0.1:9 (Connection refused)",
        ),
        "no-key": (
            {"WANDB_BASE_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"},
            "no W&B API key (No API key configured. Use `wandb login` to log in.)",
        ),
    }
    procs, stderr = {}, {}

    def read(case: str, proc: subprocess.Popen) -> None:
        stderr[case] = [line.rstrip("\n") for line in proc.stderr]  # type: ignore[union-attr]

    readers = []
    for case, (extra, _) in cases.items():
        # wandb's own wait for a server (init_timeout) made an hour: a run that waited for it, instead of
        # finding the problem itself, would not end within the wait below.
        environ = {**env(tmp_path), "NETRC": str(tmp_path / "no-netrc"), "WANDB_INIT_TIMEOUT": "3600", **extra}
        if "WANDB_API_KEY" not in extra:
            environ.pop("WANDB_API_KEY", None)
        args = [*TINY, "--iterations", "2", "--out", str(tmp_path / case), "--wandb", "online"]
        # No terminal on stdin: wandb would ask there for a key instead of failing.
        procs[case] = subprocess.Popen(
            [sys.executable, "-m", "experiments.sine", *args],
            cwd=REPO,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        readers.append(threading.Thread(target=read, args=(case, procs[case])))
        readers[-1].start()
    for case, proc in procs.items():
        assert proc.wait(timeout=300) == 0, "\n".join(stderr.get(case, []))[-3000:]
    for reader in readers:
        reader.join()
    for proc in procs.values():
        proc.stderr.close()  # type: ignore[union-attr]
    silent.close()
    for case, (_, problem) in cases.items():
        out = tmp_path / case
        (warning,) = [line for line in stderr[case] if line.startswith("warning: --wandb online")]
        (run_dir,) = (out / "wandb").glob("offline-run-*")
        then = "wandb login, then " if case == "no-key" else ""
        assert warning == (
            f"warning: --wandb online: {problem}; logging offline instead. To upload the run later: "
            f"{then}wandb sync {run_dir}"
        )
        assert (out / "results.json").is_file() and not [line for line in stderr[case] if "Traceback" in line]


# ---------------------------------------------------------------------------- SIGKILL: metrics.jsonl and the wandb history


def test_after_sigkill_the_resumed_run_has_every_row_once_in_metrics_and_in_wandb(capsys, tmp_path):
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    args = [*TINY, "--log-every", "1", "--val-every", "7", "--checkpoint-every", "10"]
    proc = script(
        "experiments.sine", [*args, "--iterations", "100000", "--out", str(cut), "--wandb", "offline"], tmp_path
    )
    deadline = time.monotonic() + 300
    # Killed a few rows past the first checkpoint (iteration 10): those rows are in metrics.jsonl only.
    while proc.poll() is None and time.monotonic() < deadline:
        if (cut / "metrics.jsonl").exists() and len((cut / "metrics.jsonl").read_text().splitlines()) >= 15:
            break
        time.sleep(0.005)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    kept = checkpoint(cut)["iteration"]
    before = rows(cut / "metrics.jsonl")
    assert [r["iteration"] for r in before] == list(range(1, len(before) + 1)) and len(before) >= kept >= 10

    # The resumed run goes 10 iterations past the checkpoint (and --iterations may change on resume).
    end = kept + 10
    (cut / f".checkpoint.pt.tmp{NO_PID}").write_text("half a checkpoint")  # as a kill mid-write leaves it
    resumed = script(
        "experiments.sine",
        [*args, "--iterations", str(end), "--out", str(cut), "--wandb", "offline", "--resume"],
        tmp_path,
    )
    run_sine(capsys, [*args, "--iterations", str(end), "--out", str(whole)])
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    # Its progress, one line per log window, as stderr is a pipe: from the checkpoint on.
    assert [line.split()[1] for line in err.splitlines() if line.startswith("meta-train ")] == [
        f"{i}/{end}" for i in range(kept + 1, end + 1)
    ], err[-3000:]
    expected = rows(whole / "metrics.jsonl")
    assert [r["iteration"] for r in expected] == list(range(1, end + 1))
    after = rows(cut / "metrics.jsonl")
    assert timeless(after) == timeless(expected)  # every iteration once, equal to the uninterrupted run's
    assert timeless(after) == timeless(checkpoint(cut)["history"])
    assert not temporaries(cut)

    # The resumed offline run (a new directory with the killed run's id) logged the whole history again.
    killed, again = sorted((cut / "wandb").glob("offline-run-*"))
    assert killed.name.split("-")[-1] == again.name.split("-")[-1]
    inspect = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(again)],
        capture_output=True,
        text=True,
        env=env(tmp_path),
        timeout=120,
        check=True,
    )
    history = [
        json.loads(line)["history"]["item"] for line in inspect.stdout.splitlines() if '"type":"history"' in line
    ]
    logged = [{k: v for k, v in item.items() if not k.startswith("_")} for item in history]
    assert timeless(logged) == timeless(after)


# ---------------------------------------------------------------------------- --resume with moved data, another length


def test_resume_accepts_the_same_data_under_another_path_and_refuses_other_data(capsys, tmp_path, monkeypatch):
    root, out = omniglot_root(), tmp_path / "run"
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "cache"))
    args = [
        "--iterations",
        "2",
        "--meta-batch",
        "1",
        "--filters",
        "4",
        "--query",
        "2",
        "--val-tasks",
        "2",
        "--eval-tasks",
        "2",
        "--eval-chunk",
        "2",
        "--eval-steps",
        "1",
        "--log-every",
        "1",
        "--out",
        str(out),
    ]
    run_sine(capsys, ["--data", str(root), *args], module=omniglot)

    def resume(data: str) -> dict[str, Any] | None:
        cfg, flags = parse_args(
            "omniglot", omniglot.OmniglotConfig, ["--data", data, *args, "--resume"], "", omniglot.validate_config
        )
        cfg, opts = setup("omniglot", cfg, flags)
        with FolderLock() as lock:
            return prepare_out(opts, cfg.resolved(), lock)

    monkeypatch.chdir(tmp_path)
    for spelling in (f"{root}/", os.path.relpath(root, tmp_path), f"{root}/../{root.name}"):
        assert resume(spelling)["iteration"] == 2, spelling
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    assert resume(str(moved))["iteration"] == 2
    assert capsys.readouterr().err == f"resuming with --data {moved}: the same files as {root}, where the run began\n"

    (moved / "images_background_small2.zip").unlink()
    line = one_error(run_sine(capsys, ["--data", str(moved), *args, "--resume"], code=2, module=omniglot))
    says(line, "--resume", str(out), f"data={str(moved)!r}", repr(str(root)), f"--config {out / 'config.yaml'}")


def test_a_run_lengthened_on_resume_equals_the_longer_run_bit_for_bit(capsys, tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    cadence = ["--log-every", "4", "--val-every", "4", "--checkpoint-every", "3"]
    run_sine(capsys, [*cadence, "--iterations", "6", "--out", str(short)])
    run_sine(capsys, [*cadence, "--iterations", "10", "--out", str(long)])
    (short / f".checkpoint.pt.tmp{NO_PID}").write_text("half a checkpoint")
    # Longer, and logged, validated and checkpointed at another cadence: the trajectory is the same.
    run_sine(
        capsys,
        [
            "--iterations",
            "10",
            "--log-every",
            "2",
            "--val-every",
            "5",
            "--checkpoint-every",
            "5",
            "--out",
            str(short),
            "--resume",
        ],
    )
    a, b = checkpoint(short), checkpoint(long)
    assert a["iteration"] == b["iteration"] == 10
    for key, value in b["learner"]["model"].items():
        assert torch.equal(a["learner"]["model"][key], value), key
    assert torch.equal(a["generator"], b["generator"])
    for state_a, state_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_b)
    assert [r["iteration"] for r in rows(short / "metrics.jsonl")] == [4, 6, 8, 10]
    assert not temporaries(short)

    # Shorter than the checkpoint: nothing to train, the run evaluates what it has.
    err = run_sine(capsys, ["--iterations", "4", "--out", str(short), "--resume"])
    assert "the checkpoint is at iteration 10, at or past --iterations 4: no training; evaluating its parameters" in err
    results = json.loads((short / "results.json").read_text())
    assert results["iterations"] == 10 and "val/mse" in results["final_val"]
    assert checkpoint(short)["iteration"] == 10

    line = one_error(
        run_sine(capsys, ["--iterations", "12", "--meta-lr", "0.01", "--out", str(short), "--resume"], code=2)
    )
    says(line, "--resume", str(short), "meta_lr=0.01", "0.001", f"--config {short / 'config.yaml'}")


# ---------------------------------------------------------------------------- code changed under a run


def git(repo: Path, *args: str) -> str:
    """``git args`` in ``repo``: its output, stripped."""
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git checkout that stands for the code a run records (``rundir.CODE``), at its first commit: the test
    commits and changes it as a user changes the repository under a run."""
    repo = tmp_path / "code"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "rules.py").write_text("STEP = 1.0\n")
    git(repo, "add", "rules.py")
    git(repo, "commit", "-q", "-m", "the code a run starts with")
    monkeypatch.setattr(rundir, "CODE", repo)
    return repo


CADENCE = ["--log-every", "2", "--val-every", "2", "--checkpoint-every", "2"]


def test_a_resume_with_other_code_than_the_run_began_with_is_one_line_and_exit_2(capsys, tmp_path, code):
    out, first = tmp_path / "run", git(code, "rev-parse", "HEAD")
    run_sine(capsys, [*CADENCE, "--iterations", "4", "--out", str(out)])
    began = {"at": "start", "iteration": 0, "git_commit": first, "git_dirty": False, "git_changes": None}
    assert json.loads((out / "results.json").read_text())["git_history"] == [began]

    (code / "rules.py").write_text("STEP = 50.0\n")
    git(code, "commit", "-q", "-am", "another commit")
    line = one_error(run_sine(capsys, [*CADENCE, "--iterations", "6", "--out", str(out), "--resume"], code=2))
    says(line, "--resume", str(out), first[:10], git(code, "rev-parse", "HEAD")[:10], "pass --overwrite")
    git(code, "checkout", "-q", first)
    (code / "rules.py").write_text("STEP = 50.0\n")  # the commit it began at, with uncommitted changes
    changes = rundir.source()["git_changes"]
    line = one_error(run_sine(capsys, [*CADENCE, "--iterations", "6", "--out", str(out), "--resume"], code=2))
    assert line.endswith(
        f"and this is commit {first[:10]} with uncommitted changes {changes}: resume with the code "
        f"it began with, or pass --overwrite to start it anew."
    )
    assert checkpoint(out)["iteration"] == 4  # nothing trained, nothing written

    git(code, "checkout", "-q", "--", "rules.py")  # the code it began with: it resumes, and results.json says so
    run_sine(capsys, [*CADENCE, "--iterations", "6", "--out", str(out), "--resume"])
    results = json.loads((out / "results.json").read_text())
    assert results["git_history"] == [began, {**began, "at": "resume", "iteration": 4}]
    assert (results["git_commit"], results["git_dirty"]) == (first, False)


def test_a_run_started_with_uncommitted_changes_resumes_with_those_changes_only(capsys, tmp_path, code):
    out = tmp_path / "run"
    (code / "rules.py").write_text("STEP = 50.0\n")
    run_sine(capsys, [*CADENCE, "--iterations", "2", "--out", str(out)])
    (code / "rules.py").write_text("STEP = 2.0\n")
    line = one_error(run_sine(capsys, [*CADENCE, "--iterations", "4", "--out", str(out), "--resume"], code=2))
    assert "began with the code of commit" in line and "with uncommitted changes" in line
    (code / "rules.py").write_text("STEP = 50.0\n")  # the very changes it began with: the same code
    run_sine(capsys, [*CADENCE, "--iterations", "4", "--out", str(out), "--resume"])
    start, resume = json.loads((out / "results.json").read_text())["git_history"]
    assert start["git_dirty"] and resume["git_changes"] == start["git_changes"] is not None


@pytest.mark.parametrize("change", ["reverted before its end", "committed before its end"])
def test_a_run_whose_code_changed_before_its_end_is_refused_by_the_tables(capsys, tmp_path, code, monkeypatch, change):
    """The inner step scaled x50 as the run starts, and the change reverted (or committed) before it ends: results.json
    records both, and the tables refuse the run, which they rendered as a clean run of the last commit."""
    out, first = tmp_path / "run", git(code, "rev-parse", "HEAD")
    (code / "rules.py").write_text("STEP = 50.0\n")
    undo = ["checkout", "-q", "--", "rules.py"] if change.startswith("reverted") else ["commit", "-qam", "x50"]
    train = Trainer.run

    def change_the_code(self: Trainer, *args: Any) -> None:
        train(self, *args)
        git(code, *undo)

    monkeypatch.setattr(Trainer, "run", change_the_code)
    run_sine(capsys, ["--iterations", "2", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert results["git_dirty"] is False and results["git_history"][0]["git_dirty"] is True
    assert (results["git_commit"] == first) == change.startswith("reverted")
    with pytest.raises(tables.TableError, match="^'sine' started in a tree with uncommitted changes: run it again"):
        tables.provenance([results])


# ---------------------------------------------------------------------------- short runs, progress, threads


def test_a_run_shorter_than_a_log_window_logs_and_validates_its_last_iteration(capsys, tmp_path):
    out = tmp_path / "run"
    run_sine(capsys, ["--iterations", "3", "--out", str(out)])  # log_every 100, val_every 1000
    results = json.loads((out / "results.json").read_text())
    assert set(results["final_val"]) == {"val/mse", "val/mse_ci95"}
    (row,) = checkpoint(out)["history"]
    assert row["iteration"] == 3 and "train/meta_loss" in row and "val/mse" in row
    assert rows(out / "metrics.jsonl") == [row]


def test_without_a_terminal_progress_is_one_plain_line_per_log_window(capsys, tmp_path):
    err = run_sine(
        capsys, ["--iterations", "6", "--log-every", "2", "--out", str(tmp_path / "run")]
    )  # stderr: not a tty
    lines = [line for line in err.splitlines() if line.startswith("meta-train")]
    pattern = r"meta-train (\d+)/6 \(\d+ %\): meta-loss [0-9.e+-]+, [0-9.]+ it/s, ETA \d+:\d\d:\d\d"
    assert [int(re.fullmatch(pattern, line).group(1)) for line in lines] == [2, 4, 6], err  # type: ignore[union-attr]


def test_threads(capsys, tmp_path):
    before = torch.get_num_threads()  # the conftest fixture restores it after the test
    cfg, flags = parse_args("sine", sine.SineConfig, ["--threads", "1"], "", sine.validate_config)
    assert torch.get_num_threads() == before  # the parser reads the flags; the set-up step applies them
    setup("sine", cfg, flags)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    run_sine(capsys, ["--iterations", "1", "--out", str(tmp_path / "one")])
    assert torch.get_num_threads() == 1  # sine's default: its small steps run fastest on one thread
    torch.set_num_threads(2)
    run_sine(capsys, ["--iterations", "1", "--out", str(tmp_path / "null"), "--threads", "null"])
    assert torch.get_num_threads() == 2  # PyTorch's (here, the one set before)
    torch.set_num_threads(before)
    line = one_error(run_sine(capsys, ["--threads", "0", "--out", str(tmp_path / "run")], code=2))
    says(line, "--threads 0", ">= 1", "null", f"{before} on this machine")
